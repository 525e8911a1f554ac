// Shared helpers of the native kernels: bf16 <-> fp32 and a vectorised exp.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

#if defined(__AVX512F__)
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
