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

namespace {

constexpr int64_t kQStrip = 32;  // outputs per strip: 2 zmm of int32 (and 2 of fp32) per row
constexpr int64_t kQBlock = 32;  // K per block (GGUF's QK8_0)
constexpr int64_t kQBlockBytes = 8 * kQStrip * 4 + 2 * kQStrip * 4;  // weights, d, c: 1280
constexpr int64_t kQ4BlockBytes = 8 * 64 + 2 * kQStrip * 2;  // nibbles, d, m (fp16): 640

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
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
#endif

// Row m of x -> its blocks as bytes p + offset (128 for the Q8_0 kernel's unsigned operand, 0 for the
// 4-bit one's signed operand), their scales s = amax / 127 (0 for an all-zero block) and, where xsum
// is given, s * sum(p) per block.
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int offset, uint8_t* xq, float* xs, float* xsum) {
  const int64_t blocks = K / kQBlock;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        const T* src = x + m * K + b * kQBlock;
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

}  // namespace

bool q8_available() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
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

// x [..., K] -> [..., N] through a q8_pack or a q4_pack (the pack's last size says which).
torch::Tensor qgemv(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N,
                    bool out_float) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
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
  // the quantized activations live in this thread's scratch buffers, grown as needed and reused:
  // a decode step makes ~4 calls per layer, and two allocations each were measurable at batch 1
  thread_local std::vector<uint8_t> xq_scratch;
  thread_local std::vector<float> xs_scratch;
  if (static_cast<int64_t>(xq_scratch.size()) < M * K) xq_scratch.resize(M * K);
  if (static_cast<int64_t>(xs_scratch.size()) < 2 * M * blocks) xs_scratch.resize(2 * M * blocks);
  uint8_t* xqp = xq_scratch.data();
  float* xsp = xs_scratch.data();
  float* xsum = four_bit ? xsp + M * blocks : nullptr;
  const int offset = four_bit ? 0 : 128;
  if (x2.scalar_type() == at::kBFloat16)
    quantize_rows(x2.data_ptr<c10::BFloat16>(), M, K, offset, xqp, xsp, xsum);
  else
    quantize_rows(x2.data_ptr<float>(), M, K, offset, xqp, xsp, xsum);
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
  TORCH_CHECK(false, "qgemv needs AVX512-VNNI");
  return x;
#endif
}
