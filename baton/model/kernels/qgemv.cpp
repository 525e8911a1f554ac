// int8 matmuls in GGUF's Q8_0 form: weights in blocks of 32 along K, each block 32 int8 values and
// one scale (w = d * q), multiplied as llama.cpp multiplies Q8_0: the activation rows are quantized
// per block of 32 too (x = s * p, p int8, one scale per row and block), and each block's dot
// product is an integer one (AVX512-VNNI VPDPBUSD: 64 u8 x s8 products into 16 int32 per
// instruction), scaled once per block into fp32 accumulators. The weight is read once per
// MT activation rows at 1.25 bytes per weight (bf16: 2), strictly sequentially.
//
// VPDPBUSD multiplies unsigned by signed bytes: the activations are stored offset by 128 (u = p +
// 128), so each block's integer dot is sum(u * q) = sum(p * q) + 128 * sum(q); the second term is
// a property of the weight block, stored next to its scale premultiplied (c = 128 * d * sum(q)),
// so that d * sum(p * q) = d * dot - c: one fused multiply-subtract per block and 16 outputs.
//
// Packed weight, one contiguous stream per strip of 32 outputs: [ceil(N/32), K/32, 1280] bytes;
// per (strip, block): 8 groups of 4 K-columns x 32 outputs x 4 int8 (1024 bytes: the 4 bytes a
// VPDPBUSD lane takes are 4 consecutive K of one output), then 32 fp32 scales d, then 32 fp32 c.
// N is padded with zero rows (scale 0). K must be a multiple of 32.
//
// 4-bit weights (GGUF's Q4_0, Q4_1 and Q4_K, repacked as they are): blocks of 32 along K, each 32
// unsigned nibbles q in [0, 15], a scale d and an offset m (w = d * q + m; Q4_0 is m = -8 d, Q4_K's
// sub-blocks are d = d_super * sc, m = -dmin * mn). Here the nibbles are the unsigned operand of
// VPDPBUSD and the activations (p, not offset) the signed one, so the dot needs no correction term;
// the offset adds m * s * sum(p) per block. Packed: [ceil(N/32), K/32, 640] bytes; per (strip, block)
// 8 groups of 4 K-columns x 16 outputs x 4 bytes (64 bytes: the low nibbles are outputs 0-15, the high
// ones outputs 16-31, the 4 bytes of a lane 4 consecutive K), then 32 fp16 d, then 32 fp16 m: 0.625
// bytes per weight, as GGUF's Q4_1. `qgemv` runs either pack (its last size says which).
//
// x [..., K] bf16 or fp32 -> [..., N] bf16 (rounded to nearest even, as torch) or fp32. Each output
// row is computed by the same arithmetic whatever M is (the row tile only decides how many rows
// share a weight load): batch-invariant, as the bf16 kernel.
#include "vec.h"

// Which integer dot product the kernels use: AVX512-VNNI's VPDPBUSD, or AVX2's VPMADDUBSW +
// VPMADDWD (Zen 2/3, Intel client cores without AVX-512: see the AVX2 strips below). Neither: no
// native kernel, and the loader serves a GGUF's dequantized weights instead.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define BATON_QGEMV_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define BATON_QGEMV_AVX2 1
#endif

namespace {

constexpr int64_t kQStrip = 32;  // outputs per strip: 2 zmm of int32 (and 2 of fp32) per row
constexpr int64_t kQBlock = 32;  // K per block (GGUF's QK8_0)
constexpr int64_t kQBlockBytes = 8 * kQStrip * 4 + 2 * kQStrip * 4;  // weights, d, c: 1280
constexpr int64_t kQ4BlockBytes = 8 * 64 + 2 * kQStrip * 2;  // nibbles, d, m (fp16): 640

#if defined(BATON_QGEMV_AVX512)
constexpr int kQ8Offset = 128;  // the activations are VPDPBUSD's unsigned operand: p + 128

// One strip of 32 outputs for MT activation rows. xq: [MT, K] u8 (offset 128), xs: [MT, K/32] fp32.
template <int MT>
inline void q8_strip(const uint8_t* xq, const float* xs, int64_t K, const uint8_t* strip, const float* bias,
                     int64_t n0, int64_t N, float* out_f, c10::BFloat16* out_b) {
  __m512 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int64_t blocks = K / kQBlock;
  const int32_t* x4 = reinterpret_cast<const int32_t*>(xq);  // 4 activation bytes as one word
  const int64_t words = K / 4;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = strip + b * kQBlockBytes;
    __m512i dot[MT][2];
    for (int m = 0; m < MT; ++m) dot[m][0] = dot[m][1] = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g) {
      const __m512i w0 = _mm512_loadu_si512(blk + g * 128);
      const __m512i w1 = _mm512_loadu_si512(blk + g * 128 + 64);
      for (int m = 0; m < MT; ++m) {
        const __m512i xv = _mm512_set1_epi32(x4[m * words + b * 8 + g]);
        dot[m][0] = _mm512_dpbusd_epi32(dot[m][0], xv, w0);
        dot[m][1] = _mm512_dpbusd_epi32(dot[m][1], xv, w1);
      }
    }
    const float* dc = reinterpret_cast<const float*>(blk + 1024);
    const __m512 d0 = _mm512_loadu_ps(dc), d1 = _mm512_loadu_ps(dc + 16);
    const __m512 c0 = _mm512_loadu_ps(dc + 32), c1 = _mm512_loadu_ps(dc + 48);
    for (int m = 0; m < MT; ++m) {
      const __m512 s = _mm512_set1_ps(xs[m * blocks + b]);
      acc[m][0] = _mm512_fmadd_ps(_mm512_fmsub_ps(_mm512_cvtepi32_ps(dot[m][0]), d0, c0), s, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(_mm512_fmsub_ps(_mm512_cvtepi32_ps(dot[m][1]), d1, c1), s, acc[m][1]);
    }
  }
  store_tiles<MT, 2>(acc, bias, n0, N, out_f, out_b);
}

// The 4-bit strip. xq: [MT, K] int8 (not offset), xs: [MT, K/32] scales, xsum: [MT, K/32] s * sum(p).
template <int MT>
inline void q4_strip(const uint8_t* xq, const float* xs, const float* xsum, int64_t K, const uint8_t* strip,
                     const float* bias, int64_t n0, int64_t N, float* out_f, c10::BFloat16* out_b) {
  __m512 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int64_t blocks = K / kQBlock;
  const int32_t* x4 = reinterpret_cast<const int32_t*>(xq);
  const int64_t words = K / 4;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = strip + b * kQ4BlockBytes;
    __m512i dot[MT][2];
    for (int m = 0; m < MT; ++m) dot[m][0] = dot[m][1] = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g) {
      const __m512i v = _mm512_loadu_si512(blk + g * 64);
      const __m512i w0 = _mm512_and_si512(v, low4);
      const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      for (int m = 0; m < MT; ++m) {
        const __m512i xv = _mm512_set1_epi32(x4[m * words + b * 8 + g]);
        dot[m][0] = _mm512_dpbusd_epi32(dot[m][0], w0, xv);
        dot[m][1] = _mm512_dpbusd_epi32(dot[m][1], w1, xv);
      }
    }
    const __m256i* dm = reinterpret_cast<const __m256i*>(blk + 512);
    const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256(dm)), d1 = _mm512_cvtph_ps(_mm256_loadu_si256(dm + 1));
    const __m512 o0 = _mm512_cvtph_ps(_mm256_loadu_si256(dm + 2)), o1 = _mm512_cvtph_ps(_mm256_loadu_si256(dm + 3));
    for (int m = 0; m < MT; ++m) {
      const __m512 s = _mm512_set1_ps(xs[m * blocks + b]);
      const __m512 sp = _mm512_set1_ps(xsum[m * blocks + b]);
      acc[m][0] = _mm512_fmadd_ps(o0, sp, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[m][0]), d0), s, acc[m][0]));
      acc[m][1] = _mm512_fmadd_ps(o1, sp, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[m][1]), d1), s, acc[m][1]));
    }
  }
  store_tiles<MT, 2>(acc, bias, n0, N, out_f, out_b);
}
#elif defined(BATON_QGEMV_AVX2)
// AVX2 has no VPDPBUSD: VPMADDUBSW multiplies u8 by s8 bytes and adds adjacent pairs into int16,
// saturating, and VPMADDWD by ones adds those pairs into the int32 lane (4 consecutive K of one
// output, the same packed layout as above). The Q8_0 dot uses llama.cpp's sign trick so that no
// pair can saturate: |w| (u8, at most 128) times x carrying w's sign (|p| <= 127), 2 * 128 * 127 <
// 2^15; the activations are therefore signed (p, not offset) and the packed c is not read. The
// 4-bit dot (nibbles <= 15 times |p| <= 127) stays within int16 over a whole block's 8 groups
// (8 * 2 * 15 * 127 < 2^15), so it widens to int32 once per block. A strip runs as two halves of 16
// outputs (2 ymm of sums and 2 of dots per row: 16 registers hold 3 rows); a tile of more rows is
// two passes over the strip, which is then in L1/L2. Each row's arithmetic is the same whatever the
// tile: batch-invariant, as the AVX-512 kernel.
constexpr int kQ8Offset = 0;

// 8 fp32 -> 8 bf16, rounded to nearest even as torch converts (NaN is not expected here).
inline __m128i to_bf16x8(__m256 y) {
  const __m256i bits = _mm256_castps_si256(y);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i packed = _mm256_packus_epi32(top, top);  // per 128-bit lane: t0..t3 t0..t3 | t4..t7 t4..t7
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0)));
}

// Outputs n0 .. n0 + 15 (masked at N) of MT rows, N apart: sums + bias, as fp32 or bf16.
template <int MT>
inline void store_half(const __m256 (&acc)[MT][2], const float* bias, int64_t n0, int64_t N, float* out_f,
                       c10::BFloat16* out_b) {
  for (int j = 0; j < 2; ++j) {
    const int64_t c0 = n0 + 8 * j;
    if (c0 >= N) break;
    const int64_t cols = std::min<int64_t>(8, N - c0);
    alignas(32) float bias8[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (bias != nullptr) std::memcpy(bias8, bias + c0, cols * sizeof(float));
    const __m256 bv = _mm256_load_ps(bias8);
    for (int m = 0; m < MT; ++m) {
      const __m256 y = _mm256_add_ps(acc[m][j], bv);
      if (out_f != nullptr) {
        if (cols == 8) {
          _mm256_storeu_ps(out_f + m * N + c0, y);
        } else {
          alignas(32) float tmp[8];
          _mm256_store_ps(tmp, y);
          std::memcpy(out_f + m * N + c0, tmp, cols * sizeof(float));
        }
      } else {
        const __m128i h = to_bf16x8(y);
        if (cols == 8) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out_b + m * N + c0), h);
        } else {
          alignas(16) uint16_t tmp[8];
          _mm_store_si128(reinterpret_cast<__m128i*>(tmp), h);
          std::memcpy(out_b + m * N + c0, tmp, cols * sizeof(uint16_t));
        }
      }
    }
  }
}

// Half `half` (outputs 16 half .. 16 half + 15) of a Q8_0 strip for MT <= 3 rows. xq: [MT, K] s8.
template <int MT>
inline void q8_half(const uint8_t* xq, const float* xs, int64_t K, const uint8_t* strip, int half,
                    __m256 (&acc)[MT][2]) {
  const int64_t blocks = K / kQBlock;
  const int32_t* x4 = reinterpret_cast<const int32_t*>(xq);
  const int64_t words = K / 4;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = strip + b * kQBlockBytes;
    __m256i dot[MT][2];
    for (int m = 0; m < MT; ++m) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + g * 128 + half * 64));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + g * 128 + half * 64 + 32));
      const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
      for (int m = 0; m < MT; ++m) {
        const __m256i xv = _mm256_set1_epi32(x4[m * words + b * 8 + g]);
        const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xv, w0));
        const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xv, w1));
        dot[m][0] = _mm256_add_epi32(dot[m][0], _mm256_madd_epi16(p0, ones));
        dot[m][1] = _mm256_add_epi32(dot[m][1], _mm256_madd_epi16(p1, ones));
      }
    }
    const float* d = reinterpret_cast<const float*>(blk + 1024) + half * 16;
    const __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8);
    for (int m = 0; m < MT; ++m) {
      const __m256 s = _mm256_set1_ps(xs[m * blocks + b]);
      acc[m][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot[m][0]), d0), s, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot[m][1]), d1), s, acc[m][1]);
    }
  }
}

// Half `half` of a 4-bit strip for MT <= 3 rows: the low nibbles are outputs 0-15, the high 16-31.
template <int MT>
inline void q4_half(const uint8_t* xq, const float* xs, const float* xsum, int64_t K, const uint8_t* strip,
                    int half, __m256 (&acc)[MT][2]) {
  const int64_t blocks = K / kQBlock;
  const int32_t* x4 = reinterpret_cast<const int32_t*>(xq);
  const int64_t words = K / 4;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = strip + b * kQ4BlockBytes;
    __m256i dot[MT][2];  // int16 pairs: the whole block fits (see above)
    for (int m = 0; m < MT; ++m) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {
      __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + g * 64));
      __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + g * 64 + 32));
      if (half != 0) {
        v0 = _mm256_srli_epi16(v0, 4);
        v1 = _mm256_srli_epi16(v1, 4);
      }
      const __m256i w0 = _mm256_and_si256(v0, low4), w1 = _mm256_and_si256(v1, low4);
      for (int m = 0; m < MT; ++m) {
        const __m256i xv = _mm256_set1_epi32(x4[m * words + b * 8 + g]);
        dot[m][0] = _mm256_add_epi16(dot[m][0], _mm256_maddubs_epi16(w0, xv));
        dot[m][1] = _mm256_add_epi16(dot[m][1], _mm256_maddubs_epi16(w1, xv));
      }
    }
    const __m128i* dm = reinterpret_cast<const __m128i*>(blk + 512) + half * 2;  // 32 fp16 d, then 32 m
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128(dm)), d1 = _mm256_cvtph_ps(_mm_loadu_si128(dm + 1));
    const __m256 o0 = _mm256_cvtph_ps(_mm_loadu_si128(dm + 4)), o1 = _mm256_cvtph_ps(_mm_loadu_si128(dm + 5));
    for (int m = 0; m < MT; ++m) {
      const __m256 s = _mm256_set1_ps(xs[m * blocks + b]);
      const __m256 sp = _mm256_set1_ps(xsum[m * blocks + b]);
      const __m256 f0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot[m][0], ones));
      const __m256 f1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot[m][1], ones));
      acc[m][0] = _mm256_fmadd_ps(o0, sp, _mm256_fmadd_ps(_mm256_mul_ps(f0, d0), s, acc[m][0]));
      acc[m][1] = _mm256_fmadd_ps(o1, sp, _mm256_fmadd_ps(_mm256_mul_ps(f1, d1), s, acc[m][1]));
    }
  }
}

// One strip of 32 outputs for MT activation rows (the AVX-512 strips' signature).
template <int MT>
inline void q8_strip(const uint8_t* xq, const float* xs, int64_t K, const uint8_t* strip, const float* bias,
                     int64_t n0, int64_t N, float* out_f, c10::BFloat16* out_b) {
  if constexpr (MT > 3) {
    const int64_t blocks = K / kQBlock;
    q8_strip<3>(xq, xs, K, strip, bias, n0, N, out_f, out_b);
    q8_strip<MT - 3>(xq + 3 * K, xs + 3 * blocks, K, strip, bias, n0, N, out_f ? out_f + 3 * N : nullptr,
                     out_b ? out_b + 3 * N : nullptr);
  } else {
    for (int half = 0; half < 2 && n0 + 16 * half < N; ++half) {
      __m256 acc[MT][2];
      q8_half<MT>(xq, xs, K, strip, half, acc);
      store_half<MT>(acc, bias, n0 + 16 * half, N, out_f, out_b);
    }
  }
}

template <int MT>
inline void q4_strip(const uint8_t* xq, const float* xs, const float* xsum, int64_t K, const uint8_t* strip,
                     const float* bias, int64_t n0, int64_t N, float* out_f, c10::BFloat16* out_b) {
  if constexpr (MT > 3) {
    const int64_t blocks = K / kQBlock;
    q4_strip<3>(xq, xs, xsum, K, strip, bias, n0, N, out_f, out_b);
    q4_strip<MT - 3>(xq + 3 * K, xs + 3 * blocks, xsum + 3 * blocks, K, strip, bias, n0, N,
                     out_f ? out_f + 3 * N : nullptr, out_b ? out_b + 3 * N : nullptr);
  } else {
    for (int half = 0; half < 2 && n0 + 16 * half < N; ++half) {
      __m256 acc[MT][2];
      q4_half<MT>(xq, xs, xsum, K, strip, half, acc);
      store_half<MT>(acc, bias, n0 + 16 * half, N, out_f, out_b);
    }
  }
}
#endif

// One block of 32 activations quantized as the scalar loop in quantize_rows does it, bit for bit
// (the same IEEE division, reciprocal and products, round to nearest even, an exact max and an exact
// integer sum). The scalar loop (a serial max chain and a scalar rounding per element) measured
// ~5 ns an element: half the time of a 576-wide Q8_0 matmul at 64 rows, a third at one row.
// False (nothing written) for a block holding a NaN: the scalar loop's handling stays the only one.
#if defined(BATON_QGEMV_AVX512)
inline void load_block(const float* src, __m512& v0, __m512& v1) {
  v0 = _mm512_loadu_ps(src);
  v1 = _mm512_loadu_ps(src + 16);
}
inline void load_block(const c10::BFloat16* src, __m512& v0, __m512& v1) {
  v0 = load_bf16x16(src);
  v1 = load_bf16x16(src + 16);
}

template <typename T>
inline bool quantize_block_simd(const T* src, int offset, uint8_t* dst, float* scale, float* psum) {
  __m512 v0, v1;
  load_block(src, v0, v1);
  if (_mm512_cmp_ps_mask(v0, v1, _CMP_UNORD_Q) != 0) return false;  // a NaN in either (max would hide it)
  const __m512 a = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
  const float s = _mm512_reduce_max_ps(a) / 127.f;
  const float inv = s > 0.f ? 1.f / s : 0.f;
  *scale = s;
  const __m512 vinv = _mm512_set1_ps(inv);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i p0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, vinv), kNearest);
  const __m512i p1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, vinv), kNearest);
  const __m512i off = _mm512_set1_epi32(offset);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(_mm512_add_epi32(p0, off)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(_mm512_add_epi32(p1, off)));
  if (psum != nullptr) *psum = s * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(p0, p1)));
  return true;
}
#elif defined(BATON_QGEMV_AVX2)
inline __m256 load_8(const float* src) { return _mm256_loadu_ps(src); }
inline __m256 load_8(const c10::BFloat16* src) { return load_bf16x8(src); }

template <typename T>
inline bool quantize_block_simd(const T* src, int offset, uint8_t* dst, float* scale, float* psum) {
  __m256 v[4];
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 a = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = load_8(src + 8 * i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));  // max would hide a NaN
    a = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), a);
  }
  if (_mm256_movemask_ps(nan) != 0) return false;
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float s = _mm_cvtss_f32(m) / 127.f;
  const float inv = s > 0.f ? 1.f / s : 0.f;
  *scale = s;
  const __m256 vinv = _mm256_set1_ps(inv);
  alignas(32) int32_t p[kQBlock];
  for (int i = 0; i < 4; ++i)  // MXCSR's rounding: to nearest even, as std::nearbyint here
    _mm256_store_si256(reinterpret_cast<__m256i*>(p + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vinv)));
  int sum = 0;
  for (int i = 0; i < kQBlock; ++i) {
    sum += p[i];
    dst[i] = static_cast<uint8_t>(p[i] + offset);
  }
  if (psum != nullptr) *psum = s * static_cast<float>(sum);
  return true;
}
#endif

// Row m of x -> its blocks as bytes p + offset (kQ8Offset for the Q8_0 kernel, 0 for the
// 4-bit one's signed operand), their scales s = amax / 127 (0 for an all-zero block) and, where xsum
// is given, s * sum(p) per block.
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int offset, uint8_t* xq, float* xs, float* xsum) {
  const int64_t blocks = K / kQBlock;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        const T* src = x + m * K + b * kQBlock;
#if defined(BATON_QGEMV_AVX512) || defined(BATON_QGEMV_AVX2)
        if (quantize_block_simd(src, offset, xq + m * K + b * kQBlock, xs + m * blocks + b,
                                  xsum != nullptr ? xsum + m * blocks + b : nullptr))
          continue;
#endif
        float v[kQBlock];
        float amax = 0.f;
        for (int i = 0; i < kQBlock; ++i) {
          v[i] = to_float(src[i]);
          amax = std::max(amax, std::fabs(v[i]));
        }
        const float s = amax / 127.f;
        const float inv = s > 0.f ? 1.f / s : 0.f;
        xs[m * blocks + b] = s;
        uint8_t* dst = xq + m * K + b * kQBlock;
        int sum = 0;
        for (int i = 0; i < kQBlock; ++i) {
          const int p = static_cast<int>(std::nearbyint(v[i] * inv));
          sum += p;
          dst[i] = static_cast<uint8_t>(p + offset);
        }
        if (xsum != nullptr) xsum[m * blocks + b] = s * static_cast<float>(sum);
      }
    }
  });
}

#if defined(BATON_QGEMV_AVX512) || defined(BATON_QGEMV_AVX2)
// A matmul's activation rows, quantized: bytes [M, K], scales [M, K/32], and for the 4-bit kernel
// s * sum(p) [M, K/32] (else null).
struct QuantizedRows {
  uint8_t* xq;
  float* xs;
  float* xsum;
};

// x [M, K] (contiguous, bf16 or fp32) quantized for the Q8_0 (offset operand) or the 4-bit kernel into
// this thread's scratch buffers, grown as needed and reused (a decode step makes ~4 calls per layer,
// and two allocations each were measurable at batch 1): valid until this thread's next call.
inline QuantizedRows quantize_into_scratch(const torch::Tensor& x, bool four_bit) {
  const int64_t M = x.size(0), K = x.size(1), blocks = K / kQBlock;
  thread_local std::vector<uint8_t> xq_scratch;
  thread_local std::vector<float> xs_scratch;
  if (static_cast<int64_t>(xq_scratch.size()) < M * K) xq_scratch.resize(M * K);
  if (static_cast<int64_t>(xs_scratch.size()) < 2 * M * blocks) xs_scratch.resize(2 * M * blocks);
  QuantizedRows rows{xq_scratch.data(), xs_scratch.data(), four_bit ? xs_scratch.data() + M * blocks : nullptr};
  const int offset = four_bit ? 0 : kQ8Offset;
  if (x.scalar_type() == at::kBFloat16)
    quantize_rows(x.data_ptr<c10::BFloat16>(), M, K, offset, rows.xq, rows.xs, rows.xsum);
  else
    quantize_rows(x.data_ptr<float>(), M, K, offset, rows.xq, rows.xs, rows.xsum);
  return rows;
}
#endif

}  // namespace

// The integer dot product qgemv runs on this build, in words ("" where it has none).
std::string qgemv_isa() {
#if defined(BATON_QGEMV_AVX512)
  return "AVX512-VNNI";
#elif defined(BATON_QGEMV_AVX2)
  return "AVX2";
#else
  return "";
#endif
}

bool q8_available() {
#if defined(BATON_QGEMV_AVX512) || defined(BATON_QGEMV_AVX2)
  return true;
#else
  return false;
#endif
}

// q [N, K] int8, d [N, K/32] fp32 (w = d * q per block) -> the packed stream above ([NS, K/32, 1280] u8)
torch::Tensor q8_pack(torch::Tensor q, torch::Tensor d) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "q must be [N, K] int8");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(K % kQBlock == 0, "K must be a multiple of 32");
  const int64_t blocks = K / kQBlock;
  TORCH_CHECK(d.dim() == 2 && d.size(0) == N && d.size(1) == blocks, "d must be [N, K/32]");
  auto qc = q.contiguous();
  auto dc = d.to(at::kFloat).contiguous();
  const int64_t NS = (N + kQStrip - 1) / kQStrip;
  auto out = torch::zeros({NS, blocks, kQBlockBytes}, q.options().dtype(at::kByte));
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* dp = dc.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, NS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* blk = op + (s * blocks + b) * kQBlockBytes;
        float* dd = reinterpret_cast<float*>(blk + 1024);
        for (int64_t r = 0; r < kQStrip; ++r) {
          const int64_t n = s * kQStrip + r;
          if (n >= N) break;  // padding: zero weights, zero scales
          const int8_t* src = qp + n * K + b * kQBlock;
          int32_t sum = 0;
          for (int g = 0; g < 8; ++g)
            for (int i = 0; i < 4; ++i) {
              blk[g * 128 + r * 4 + i] = static_cast<uint8_t>(src[g * 4 + i]);
              sum += src[g * 4 + i];
            }
          const float scale = dp[n * blocks + b];
          dd[r] = scale;
          dd[kQStrip + r] = 128.f * scale * static_cast<float>(sum);
        }
      }
    }
  });
  return out;
}

// q [N, K] uint8 nibbles in [0, 15], d and m [N, K/32] (w = d * q + m per block; stored as fp16)
// -> the 4-bit packed stream above ([NS, K/32, 640] u8)
torch::Tensor q4_pack(torch::Tensor q, torch::Tensor d, torch::Tensor m) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "q must be [N, K] uint8");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(K % kQBlock == 0, "K must be a multiple of 32");
  const int64_t blocks = K / kQBlock;
  TORCH_CHECK(d.dim() == 2 && d.size(0) == N && d.size(1) == blocks && m.sizes() == d.sizes(),
              "d and m must be [N, K/32]");
  auto qc = q.contiguous();
  auto dc = d.to(at::kHalf).contiguous();
  auto mc = m.to(at::kHalf).contiguous();
  TORCH_CHECK(qc.max().item<int64_t>() <= 15, "q must be 4-bit (0..15)");
  const int64_t NS = (N + kQStrip - 1) / kQStrip;
  auto out = torch::zeros({NS, blocks, kQ4BlockBytes}, q.options().dtype(at::kByte));
  const uint8_t* qp = qc.data_ptr<uint8_t>();
  const at::Half* dp = dc.data_ptr<at::Half>();
  const at::Half* mp = mc.data_ptr<at::Half>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, NS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* blk = op + (s * blocks + b) * kQ4BlockBytes;
        at::Half* dd = reinterpret_cast<at::Half*>(blk + 512);
        for (int64_t r = 0; r < kQStrip; ++r) {
          const int64_t n = s * kQStrip + r;
          if (n >= N) break;  // padding: zero weights, zero scale and offset
          const uint8_t* src = qp + n * K + b * kQBlock;
          const int64_t lane = r % 16, shift = r < 16 ? 0 : 4;
          for (int g = 0; g < 8; ++g)
            for (int i = 0; i < 4; ++i) blk[g * 64 + lane * 4 + i] |= static_cast<uint8_t>(src[g * 4 + i] << shift);
          dd[r] = dp[n * blocks + b];
          dd[kQStrip + r] = mp[n * blocks + b];
        }
      }
    }
  });
  return out;
}

// x [M, K] bf16 or fp32 -> the activations as qgemv quantizes them: (bytes p + offset [M, K] u8,
// scales s [M, K/32] fp32, s * sum(p) [M, K/32] fp32). For tests: the kernels read them from scratch.
std::vector<torch::Tensor> quantize_activations(torch::Tensor x, int64_t offset) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kQBlock == 0, "x must be [M, K] with K a multiple of 32");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be bf16 or fp32");
  TORCH_CHECK(offset == 0 || offset == 128, "offset must be 0 or 128");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  auto xq = torch::empty({M, K}, xc.options().dtype(at::kByte));
  auto xs = torch::empty({M, K / kQBlock}, xc.options().dtype(at::kFloat));
  auto xsum = torch::empty({M, K / kQBlock}, xc.options().dtype(at::kFloat));
  if (xc.scalar_type() == at::kBFloat16)
    quantize_rows(xc.data_ptr<c10::BFloat16>(), M, K, static_cast<int>(offset), xq.data_ptr<uint8_t>(),
                  xs.data_ptr<float>(), xsum.data_ptr<float>());
  else
    quantize_rows(xc.data_ptr<float>(), M, K, static_cast<int>(offset), xq.data_ptr<uint8_t>(),
                  xs.data_ptr<float>(), xsum.data_ptr<float>());
  return {xq, xs, xsum};
}

// x [..., K] -> [..., N] through a q8_pack or a q4_pack (the pack's last size says which).
torch::Tensor qgemv(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N,
                    bool out_float) {
#if defined(BATON_QGEMV_AVX512) || defined(BATON_QGEMV_AVX2)
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be bf16 or fp32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte &&
                  (packed.size(2) == kQBlockBytes || packed.size(2) == kQ4BlockBytes),
              "packed must come from q8_pack or q4_pack");
  const bool four_bit = packed.size(2) == kQ4BlockBytes;
  const int64_t K = x.size(-1), NS = packed.size(0), blocks = packed.size(1);
  TORCH_CHECK(blocks * kQBlock == K && N <= NS * kQStrip && N > (NS - 1) * kQStrip,
              "x or N does not match the packed weight");
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  auto out_dtype = out_float ? at::kFloat : at::kBFloat16;
  auto out = torch::empty({M, N}, x.options().dtype(out_dtype));
  if (M == 0) return out.view(out_shape);
  const QuantizedRows rows = quantize_into_scratch(x2, four_bit);
  uint8_t* xqp = rows.xq;
  float* xsp = rows.xs;
  float* xsum = rows.xsum;
  const torch::Tensor bias_f = bias_as_float(bias, N);
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int64_t strip_bytes = blocks * packed.size(2);
  float* out_f = out_float ? out.data_ptr<float>() : nullptr;
  c10::BFloat16* out_b = out_float ? nullptr : out.data_ptr<c10::BFloat16>();
  over_strips_and_row_tiles(NS, M, [&](int64_t s, int64_t m0, auto tile) {
    constexpr int MT = decltype(tile)::value;
    float* of = out_f ? out_f + m0 * N : nullptr;
    c10::BFloat16* ob = out_b ? out_b + m0 * N : nullptr;
    if (four_bit)
      q4_strip<MT>(xqp + m0 * K, xsp + m0 * blocks, xsum + m0 * blocks, K, wp + s * strip_bytes, b, s * kQStrip, N,
                   of, ob);
    else
      q8_strip<MT>(xqp + m0 * K, xsp + m0 * blocks, K, wp + s * strip_bytes, b, s * kQStrip, N, of, ob);
  });
  return out.view(out_shape);
#else
  TORCH_CHECK(false, "qgemv needs AVX512-VNNI or AVX2");
  return x;
#endif
}

// Row r of x through its own packed weight: out[r] = x[r] @ W_r^T, every row's strips in one parallel
// region. A MoE's decode tokens each go to a few experts (8 of 64): one call for all of a layer's
// chosen experts instead of one qgemv (one fork and join) per expert. x [R, K] bf16 or fp32, packs: R
// packs of one layout (all q8_pack or all q4_pack, N outputs) -> [R, N] in x's dtype (fp32 out when x
// is fp32). Each row is computed as qgemv computes it (the same quantization and arithmetic: a row's
// result never depends on the others), so this equals qgemv of each row alone, bit for bit.
torch::Tensor qgemv_rows(torch::Tensor x, std::vector<torch::Tensor> packs, int64_t N) {
#if defined(BATON_QGEMV_AVX512) || defined(BATON_QGEMV_AVX2)
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be [R, K] bf16 or fp32");
  const int64_t R = x.size(0), K = x.size(1);
  TORCH_CHECK(static_cast<int64_t>(packs.size()) == R, "one pack per row of x");
  auto out = torch::empty({R, N}, x.options());
  if (R == 0) return out;
  const auto shape = packs[0].sizes().vec();
  TORCH_CHECK(packs[0].dim() == 3 && packs[0].scalar_type() == at::kByte &&
                  (shape[2] == kQBlockBytes || shape[2] == kQ4BlockBytes),
              "packs must come from q8_pack or q4_pack");
  const bool four_bit = shape[2] == kQ4BlockBytes;
  const int64_t NS = shape[0], blocks = shape[1];
  TORCH_CHECK(blocks * kQBlock == K && N <= NS * kQStrip && N > (NS - 1) * kQStrip,
              "x or N does not match the packed weights");
  std::vector<const uint8_t*> weights(R);
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(packs[r].sizes().vec() == shape && packs[r].scalar_type() == at::kByte && packs[r].is_contiguous(),
                "every pack must have the first one's layout");
    weights[r] = packs[r].data_ptr<uint8_t>();
  }
  const QuantizedRows rows = quantize_into_scratch(x.contiguous(), four_bit);
  uint8_t* xqp = rows.xq;
  float* xsp = rows.xs;
  float* xsum = rows.xsum;
  const bool out_float = x.scalar_type() == at::kFloat;
  float* out_f = out_float ? out.data_ptr<float>() : nullptr;
  c10::BFloat16* out_b = out_float ? nullptr : out.data_ptr<c10::BFloat16>();
  const int64_t strip_bytes = blocks * shape[2];
  // (row, strip) pairs in row order: a thread's share is whole strips of consecutive rows' weights
  at::parallel_for(0, R * NS, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / NS, s = i % NS;
      float* of = out_f ? out_f + r * N : nullptr;
      c10::BFloat16* ob = out_b ? out_b + r * N : nullptr;
      const uint8_t* strip = weights[r] + s * strip_bytes;
      if (four_bit)
        q4_strip<1>(xqp + r * K, xsp + r * blocks, xsum + r * blocks, K, strip, nullptr, s * kQStrip, N, of, ob);
      else
        q8_strip<1>(xqp + r * K, xsp + r * blocks, K, strip, nullptr, s * kQStrip, N, of, ob);
    }
  });
  return out;
#else
  TORCH_CHECK(false, "qgemv_rows needs AVX512-VNNI or AVX2");
  return x;
#endif
}
