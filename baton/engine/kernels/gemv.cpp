// bf16 matmuls with few activation rows (a decode step's M = batch size, small).
//
// At batch 1 a decode step is 121 weight matmuls with one activation row each: the step's time is
// the time to stream 269 MB of weights. oneDNN's bf16 path (even with prepacked weights) reads them
// at ~10-15 GB/s on one core of a machine that reads 30+ (measured on Zen 4, docs/performance.md).
// This kernel streams the weight strictly sequentially from a layout packed once at load time and
// uses AVX512-BF16 pair dot products (no conversion of the weight): for a strip of 64 output
// columns, each pair of input columns is one 256-byte vector row of the strip; an activation row's
// pair is broadcast and multiplied into 4 accumulators (64 outputs) per activation row, MT
// activation rows at a time (MT x 4 accumulators in registers). The outputs come out of the
// accumulators as they are: no horizontal reductions. The model uses it per weight shape and row
// count only where it measured faster than oneDNN (`baton.engine.linear`), so a CPU where oneDNN
// is the better choice keeps oneDNN.
//
// Packed weight: [ceil(N/64), K/2, 64, 2] bf16 (N padded with zero rows; K must be even).
// x [..., K] bf16 -> [..., N] bf16 (rounded to nearest even, as torch) or fp32.
#include "vec.h"

#if defined(__AVX512BF16__)
namespace {

constexpr int64_t kStrip = 64;  // output columns per strip: 4 zmm accumulators per activation row

// One strip of 64 outputs for MT activation rows; the strip's K/2 x 256 bytes are read in order.
template <int MT>
inline void strip_kernel(const c10::BFloat16* x, int64_t K, const c10::BFloat16* strip, const float* bias,
                         int64_t n0, int64_t N, float* out_f, c10::BFloat16* out_b) {
  __m512 acc[MT][4];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  const int32_t* xpairs = reinterpret_cast<const int32_t*>(x);  // (x[2p], x[2p+1]) as one 32-bit word
  const int64_t pairs = K / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    // no software prefetch: the strip is one sequential stream, which the hardware prefetcher
    // follows best (measured: prefetching 2-8 KiB ahead made M = 1 10-30% slower on Zen 4)
    const c10::BFloat16* w = strip + p * kStrip * 2;
    __m512bh wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + 32 * j);
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(xpairs[m * pairs + p]);
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    const int64_t c0 = n0 + 16 * j;
    if (c0 >= N) break;
    const int64_t cols = std::min<int64_t>(16, N - c0);
    const __mmask16 mask = (__mmask16)((1u << cols) - 1);
    const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m) {
      const __m512 y = _mm512_add_ps(acc[m][j], bv);
      if (out_f != nullptr) _mm512_mask_storeu_ps(out_f + m * N + c0, mask, y);
      else _mm256_mask_storeu_epi16(out_b + m * N + c0, mask, (__m256i)_mm512_cvtneps_pbh(y));
    }
  }
}

}  // namespace
#endif

bool gemv_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// w [N, K] bf16 -> the packed layout above
torch::Tensor gemv_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "w must be [N, K] bf16");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % 2 == 0, "K must be even");
  const int64_t NS = (N + 63) / 64;
  auto padded = torch::zeros({NS * 64, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  // [NS, 64, K/2, 2] -> [NS, K/2, 64, 2]
  return padded.view({NS, 64, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

torch::Tensor gemv(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N,
                   bool out_float) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 64 && packed.size(3) == 2, "packed must come from gemv_pack");
  const int64_t K = x.size(-1), NS = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == K && N <= NS * 64 && N > (NS - 1) * 64, "x or N does not match the packed weight");
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  auto out = torch::empty({M, N}, x.options().dtype(out_float ? at::kFloat : at::kBFloat16));
  const float* b = nullptr;
  torch::Tensor bias_f;
  if (bias.has_value()) {
    bias_f = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_f.numel() == N, "bias must be [N]");
    b = bias_f.data_ptr<float>();
  }
  const auto* xp = x2.data_ptr<c10::BFloat16>();
  const auto* wp = packed.data_ptr<c10::BFloat16>();
  float* out_f = out_float ? out.data_ptr<float>() : nullptr;
  c10::BFloat16* out_b = out_float ? nullptr : out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, NS, 4, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const c10::BFloat16* strip = wp + s * K * kStrip;
      for (int64_t m0 = 0; m0 < M;) {
        const int64_t left = M - m0;
        const c10::BFloat16* x0 = xp + m0 * K;
        float* of = out_f ? out_f + m0 * N : nullptr;
        c10::BFloat16* ob = out_b ? out_b + m0 * N : nullptr;
        int64_t mt = left >= 6 ? 6 : left;
        switch (mt) {
          case 6: strip_kernel<6>(x0, K, strip, b, s * kStrip, N, of, ob); break;
          case 5: strip_kernel<5>(x0, K, strip, b, s * kStrip, N, of, ob); break;
          case 4: strip_kernel<4>(x0, K, strip, b, s * kStrip, N, of, ob); break;
          case 3: strip_kernel<3>(x0, K, strip, b, s * kStrip, N, of, ob); break;
          case 2: strip_kernel<2>(x0, K, strip, b, s * kStrip, N, of, ob); break;
          default: strip_kernel<1>(x0, K, strip, b, s * kStrip, N, of, ob); break;
        }
        m0 += mt;
      }
    }
  });
  return out.view(out_shape);
#else
  TORCH_CHECK(false, "gemv needs AVX512-BF16");
  return x;
#endif
}
