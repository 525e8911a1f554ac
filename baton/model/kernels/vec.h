// Shared helpers of the native kernels: bf16 <-> fp32 and a vectorised exp.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// fn(std::integral_constant<int, MT>{}) for the row tile MT = mt (1..6): the matmul kernels keep
// MT rows' accumulators in registers, so MT must be a compile-time constant.
template <typename Fn>
inline void with_row_tile(int64_t mt, Fn&& fn) {
  switch (mt) {
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    default: fn(std::integral_constant<int, 1>{}); break;
  }
}

// A matmul's optional bias [N] as contiguous fp32 (undefined when there is none).
inline torch::Tensor bias_as_float(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return torch::Tensor();
  auto out = bias->to(at::kFloat).contiguous();
  TORCH_CHECK(out.numel() == N, "bias must be [N]");
  return out;
}

// fn(strip, first_row, tile) for every strip of the packed weight (strips in parallel) and every
// tile of up to 6 activation rows, in order: the strip stays in cache while its row tiles run.
template <typename Fn>
inline void over_strips_and_row_tiles(int64_t num_strips, int64_t M, Fn&& fn) {
  at::parallel_for(0, num_strips, 4, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s)
      for (int64_t m0 = 0; m0 < M; m0 += 6)
        with_row_tile(std::min<int64_t>(M - m0, 6), [&](auto tile) { fn(s, m0, tile); });
  });
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

#if defined(__AVX2__)
// 8 bf16 values -> 8 fp32 (a bf16 is the upper half of an fp32).
inline __m256 load_bf16x8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// 8 fp32 rounded to bf16's precision (nearest even, as torch converts), kept as fp32 (NaN not expected).
inline __m256 round_bf16x8(__m256 y) {
  const __m256i bits = _mm256_castps_si256(y);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// 2^f for |f| <= 1/2: exp_avx512's degree-6 polynomial in 8 lanes (relative error < 2e-8).
inline __m256 exp2_fraction_avx2(__m256 f) {
  __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  return _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
}

// exp_avx512's algorithm in 8 lanes (AVX2 has no scalef: 2^n is made as 2^(n/2) * 2^(n - n/2) from
// exponent bits, so that large |x| still underflows to 0 or overflows to inf, as exp does).
inline __m256 exp_avx2(__m256 x) {
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 p = exp2_fraction_avx2(_mm256_sub_ps(t, n));
  n = _mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-252.f)), _mm256_set1_ps(254.f));  // NaN -> -252, p NaN
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
#endif

#if defined(__AVX512F__)
// fp32 -> bf16 rounded to nearest even, as torch converts (NaN is not expected here).
inline __m256i to_bf16x16(__m512 y) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(y);
#else
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

// The matmul kernels' epilogue: for each of the J accumulators of 16 outputs of MT rows (columns
// n0 + 16 j, masked at N), add the bias and store as fp32 (out_f) or bf16 (out_b), rows N apart.
template <int MT, int J>
inline void store_tiles(const __m512 (&acc)[MT][J], const float* bias, int64_t n0, int64_t N, float* out_f,
                        c10::BFloat16* out_b) {
  for (int j = 0; j < J; ++j) {
    const int64_t c0 = n0 + 16 * j;
    if (c0 >= N) break;
    const int64_t cols = std::min<int64_t>(16, N - c0);
    const __mmask16 mask = (__mmask16)((1u << cols) - 1);
    const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m) {
      const __m512 y = _mm512_add_ps(acc[m][j], bv);
      if (out_f != nullptr) _mm512_mask_storeu_ps(out_f + m * N + c0, mask, y);
      else _mm256_mask_storeu_epi16(out_b + m * N + c0, mask, to_bf16x16(y));
    }
  }
}

// 16 bf16 values -> 16 fp32 (a bf16 is the upper half of an fp32).
inline __m512 load_bf16x16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x) = 2^(x log2 e) = 2^n * 2^f with |f| <= 1/2, 2^f by its degree-6 Taylor polynomial
// (relative error < 2e-8, far below bf16's resolution); scalef makes large |x| underflow to 0 or
// overflow to inf, as exp does.
inline __m512 exp_avx512(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// [sum(v[0]), sum(v[1]), ..., sum(v[15])] for 16 vectors of 16 floats: a transpose-add tree,
// 45 instructions where 16 horizontal reductions take ~130.
inline __m512 reduce16(const __m512* v) {
  __m512 s2[8];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    s2[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  __m512 s4[4];
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(s2[2 * i]), b = _mm512_castps_pd(s2[2 * i + 1]);
    s4[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // each 128-bit lane of s4[i] now holds that lane's partial sums of vectors 4i..4i+3
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(s4[0], s4[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(s4[0], s4[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2], s4[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(s4[2], s4[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

}  // namespace
