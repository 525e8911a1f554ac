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
#endif

}  // namespace
