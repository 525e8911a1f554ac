// Pointwise and row-wise kernels of the bf16 CPU fast path: greedy pick, fused residual add +
// RMSNorm, SwiGLU activation. Each equals its torch counterpart (tests/test_kernels.py).
#include "vec.h"
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>  // _mm_getcsr / _mm_setcsr
#endif

// Greedy pick per row of fp32 logits [S, V]: the first index of the maximum (torch.argmax's
// tie rule) and its log-probability, logit - logsumexp(row). Two passes over the row instead of
// argmax + logsumexp's four (torch's CPU argmax alone is ~14x slower than amax here).
std::vector<torch::Tensor> greedy_pick(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits must be [S, V] float32");
  logits = logits.contiguous();
  const int64_t S = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V >= 1, "empty vocabulary");
  auto tokens = torch::empty({S}, logits.options().dtype(at::kLong));
  auto logprobs = torch::empty({S}, logits.options());
  const float* x = logits.data_ptr<float>();
  int64_t* tok = tokens.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * V;
      float best = row[0];
      int64_t best_i = 0;
      int64_t i = 0;
#if defined(__AVX512F__)
      __m512 vmax = _mm512_set1_ps(-INFINITY);
      for (; i + 16 <= V; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + i));
      best = _mm512_reduce_max_ps(vmax);
      for (int64_t j = i; j < V; ++j) best = row[j] > best ? row[j] : best;
      for (best_i = 0; best_i < V && !(row[best_i] == best); ++best_i) {}
      if (best_i == V) best_i = 0;  // all NaN: like argmax, an index, never out of range
      const __m512 mb = _mm512_set1_ps(best);
      __m512 vsum = _mm512_setzero_ps();
      for (i = 0; i + 16 <= V; i += 16) vsum = _mm512_add_ps(vsum, exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(row + i), mb)));
      float sum = _mm512_reduce_add_ps(vsum);
#else
      for (i = 1; i < V; ++i)
        if (row[i] > best) { best = row[i]; best_i = i; }
      float sum = 0.f;
      i = 0;
#endif
      for (; i < V; ++i) sum += std::exp(row[i] - best);
      tok[r] = best_i;
      lp[r] = -std::log(sum);  // logit(best) - logsumexp = -log(sum exp(x - best))
    }
  });
  return {tokens, logprobs};
}

namespace {

// The rows of a fused residual add + RMSNorm: x += delta on each row (rounded to bf16, as torch's add;
// none when dp is null), then write(t, row, inv) with the row's fp32 values and 1 / rms(row). x:
// [T, H] bf16 rows `stride` apart (contiguous when dp is given); delta: [T, H] contiguous.
template <typename Write>
void add_and_norm_rows(c10::BFloat16* xp, int64_t stride, const c10::BFloat16* dp, int64_t T, int64_t H,
                       double eps, Write&& write) {
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t t = begin; t < end; ++t) {
      c10::BFloat16* xr = xp + t * stride;
      float sum_sq = 0.f;
      for (int64_t i = 0; i < H; ++i) {
        float v = static_cast<float>(xr[i]);
        if (dp != nullptr) {
          xr[i] = static_cast<c10::BFloat16>(v + static_cast<float>(dp[t * H + i]));
          v = static_cast<float>(xr[i]);
        }
        row[i] = v;
        sum_sq += v * v;
      }
      write(t, row.data(), 1.f / std::sqrt(sum_sq / static_cast<float>(H) + static_cast<float>(eps)));
    }
  });
}

// The checks shared by both norms; returns the contiguous delta (undefined when there is none).
torch::Tensor checked_delta(const torch::Tensor& x, const c10::optional<torch::Tensor>& delta,
                            const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16, "x must be [T, H] bf16 rows");
  TORCH_CHECK(weight.numel() == x.size(1) && weight.scalar_type() == at::kBFloat16, "weight must be [H] bf16");
  if (!delta.has_value()) return torch::Tensor();
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous when a delta is added to it");
  auto d = delta->contiguous();
  TORCH_CHECK(d.sizes() == x.sizes() && d.scalar_type() == at::kBFloat16, "delta must match x");
  return d;
}

}  // namespace

// The residual stream's `x += delta` fused with the next RMSNorm: returns weight * rms_norm(x), and
// updates x in place. One pass over x instead of the add plus the norm's several ops. bf16: the sum
// is rounded to bf16 (as torch's add), the norm computed in fp32, rounded, then scaled by the
// weight (the reference's order). x, delta: [T, H]; weight: [H].
torch::Tensor add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous [T, H] bf16");
  const torch::Tensor d = checked_delta(x, delta, weight);
  weight = weight.contiguous();
  const int64_t H = x.size(1);
  auto out = torch::empty_like(x);
  const c10::BFloat16* wp = weight.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  add_and_norm_rows(x.data_ptr<c10::BFloat16>(), H, d.defined() ? d.data_ptr<c10::BFloat16>() : nullptr, x.size(0), H,
                    eps, [&](int64_t t, const float* row, float inv) {
                      c10::BFloat16* orow = op + t * H;
                      for (int64_t i = 0; i < H; ++i) {
                        const float normed = static_cast<float>(static_cast<c10::BFloat16>(row[i] * inv));
                        orow[i] = static_cast<c10::BFloat16>(normed * static_cast<float>(wp[i]));
                      }
                    });
  return out;
}

// Gemma's RMSNorm (also Qwen3.5's and Qwen3-Next's: weights stored as offsets from 1), with the
// residual add fused as in add_rms_norm: out = x_hat * (1 + w) computed in fp32 and rounded once,
// as the reference's `(x.float() * rsqrt(mean(x^2) + eps) * (1.0 + w.float())).type_as(x)`. Six
// torch ops and their temporaries per norm before (~100 us at one row of 1024 on 2 threads, 61 norms
// a step of a Qwen3.5-0.8B). x: [T, H] bf16 (rows may be strided when there is no delta: a q or k
// view of heads); delta: [T, H] or None; weight: [H] bf16. x is updated in place when delta is given.
torch::Tensor add_offset_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight,
                                  double eps) {
  const torch::Tensor d = checked_delta(x, delta, weight);
  weight = weight.contiguous();
  const int64_t T = x.size(0), H = x.size(1);
  std::vector<float> scale(H);  // (1 + w) in fp32, as the reference's `1.0 + w.float()`
  const c10::BFloat16* wp = weight.data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < H; ++i) scale[i] = 1.f + static_cast<float>(wp[i]);
  auto out = torch::empty({T, H}, x.options().memory_format(at::MemoryFormat::Contiguous));
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  add_and_norm_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), d.defined() ? d.data_ptr<c10::BFloat16>() : nullptr, T,
                    H, eps, [&](int64_t t, const float* row, float inv) {
                      c10::BFloat16* orow = op + t * H;
                      for (int64_t i = 0; i < H; ++i) orow[i] = static_cast<c10::BFloat16>(row[i] * inv * scale[i]);
                    });
  return out;
}

// SwiGLU's activation on the fused gate|up projection: out = silu(gate) * up, one pass instead of
// three ops (bf16 silu alone is ~1.3 ns per element in torch on one thread). gate_up: [T, 2I] bf16;
// silu(gate) is rounded to bf16 before the product, as torch computes silu(gate) * up.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.scalar_type() == at::kBFloat16,
              "gate_up must be [T, 2I] bf16");
  gate_up = gate_up.contiguous();
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  const c10::BFloat16* in = gate_up.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const c10::BFloat16* gate = in + t * 2 * I;
      const c10::BFloat16* up = gate + I;
      c10::BFloat16* orow = op + t * I;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= I; i += 16) {
        const __m512 g = load_bf16x16(gate + i);
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
#if defined(__AVX512BF16__)
        // round silu(gate) to bf16 and back (torch's intermediate), multiply, round to bf16
        const __m256i s16 = (__m256i)_mm512_cvtneps_pbh(s);
        const __m512 s_rounded = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(s16), 16));
        const __m512 prod = _mm512_mul_ps(s_rounded, load_bf16x16(up + i));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + i), (__m256i)_mm512_cvtneps_pbh(prod));
#else
        alignas(64) float tmp[16];
        _mm512_store_ps(tmp, s);
        for (int k = 0; k < 16; ++k)
          orow[i + k] = static_cast<c10::BFloat16>(static_cast<float>(static_cast<c10::BFloat16>(tmp[k])) *
                                                   static_cast<float>(up[i + k]));
#endif
      }
#endif
      for (; i < I; ++i) {
        const float g = static_cast<float>(gate[i]);
        const float s = static_cast<float>(static_cast<c10::BFloat16>(g / (1.f + std::exp(-g))));
        orow[i] = static_cast<c10::BFloat16>(s * static_cast<float>(up[i]));
      }
    }
  });
  return out;
}

// How many threads a parallel_for over `n` items runs on in these kernels (at most
// torch.get_num_threads()): 1 when the extension was built without OpenMP, whatever --threads says.
int64_t parallel_threads(int64_t n) {
  std::atomic<int64_t> most{1};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    const int64_t mine = at::get_thread_num() + 1;
    int64_t seen = most.load();
    while (mine > seen && !most.compare_exchange_weak(seen, mine)) {}
  });
  return most.load();
}

// Flush denormal floats to zero (FTZ) and read them as zero (DAZ), or stop, on the calling thread and
// on every thread of its OpenMP team. A state layer's decays (Gated DeltaNet's exp of cumulative gates,
// Mamba-2's exp(dt * A)) make fp32 values below 1e-38, and a matmul over them runs 5x slower on x86
// (a Qwen3.5-shaped prefill's chunked rule: 129 against 25 ms per layer at 512 tokens, 2 threads).
// torch.set_flush_denormal sets the calling thread only: the pool's threads keep the mode they were
// created with. The mode is for the state layers only (`on` then off again around them): fp8 and
// E8M0 codes convert through denormal floats, which DAZ would read as zero. Returns whether the
// calling thread had the mode before. Elsewhere than x86: nothing, false.
bool flush_denormals(bool on) {
#if defined(__x86_64__) || defined(__i386__)
  constexpr unsigned int kBits = 0x8040;  // FTZ (bit 15) | DAZ (bit 6)
  const bool before = (_mm_getcsr() & kBits) == kBits;
  auto set = [&] { _mm_setcsr(on ? (_mm_getcsr() | kBits) : (_mm_getcsr() & ~kBits)); };
  set();
#pragma omp parallel
  set();
  return before;
#else
  (void)on;
  return false;
#endif
}
