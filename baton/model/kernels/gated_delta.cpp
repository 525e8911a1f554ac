// The Gated DeltaNet decode step (Qwen3.5, Qwen3-Next: three of every four layers) for a batch of
// one-token rows, in place on the rows' state slots: the depthwise causal conv's one output position
// and its state shift, silu, the l2-normed q and k, and the delta rule's state update and output.
//
// The torch path (baton/model/gated_deltanet.py: decode_conv, recurrent_gated_delta_rule) runs the
// rule as mul_ (decay), bmm (k^T S), baddbmm_ (S += k delta^T) and bmm (q^T S) over [rows * heads,
// 128, 128] fp32 states: four passes over 64 KB per head and request, 24-48 ms of a Qwen3.5-0.8B
// decode step at batch 16 on 2 threads. Here each (row, value head) is one work item that reads
// its state once from memory (pass 1: k^T of the decayed state; the 64 KB stay in L2) and once more
// from L2 (pass 2: the decayed state again, + k delta^T, stored, and q^T of it), in the reference's
// order of operations: S' = decay * S,
// kv = k^T S', delta = (v - kv) * beta, S'' = S' + k delta^T, out = q^T S''. A row's numbers do not
// depend on the batch (each item is computed alone), and the rounding of the model's dtype follows
// the torch path: the conv output and silu are rounded to it, the rule runs in fp32.
#include "vec.h"

namespace {

template <typename scalar_t>
inline float round_to(float x) {
  return static_cast<float>(static_cast<scalar_t>(x));
}

// y[i] <- silu(y[i]) = y / (1 + exp(-y)), rounded to scalar_t's precision (a no-op for float), over
// n values: 8 at a time with the vectorised exp where the CPU has AVX2 (std::exp was ~40 ns a
// channel, single-threaded at batch 1: two thirds of a Qwen3.5 layer's decode step on Zen 3), the
// same division and rounding as the scalar tail.
template <typename scalar_t>
inline void silu_rounded(float* y, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(y + i);
    __m256 out = _mm256_div_ps(v, _mm256_add_ps(one, exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), v))));
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) out = round_bf16x8(out);
    _mm256_storeu_ps(y + i, out);
  }
#endif
  for (; i < n; ++i) y[i] = round_to<scalar_t>(y[i] / (1.f + std::exp(-y[i])));
}

// A prefill span's conv: out [L, C] = silu(conv) for each of the span's L positions, from the window
// of the slot's K - 1 saved inputs then the span's; the state keeps the window's last K - 1 after.
// The weights are read transposed ([K, C] fp32) so that the loop over channels is contiguous.
template <typename scalar_t>
void span_conv_silu(const scalar_t* x, int64_t x_stride, scalar_t* state, const scalar_t* weight, int64_t L,
                    int64_t C, int64_t K, scalar_t* out) {
  const int64_t keep = K - 1;
  std::vector<float> wt(K * C);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t j = 0; j < K; ++j) wt[j * C + c] = to_float(weight[c * K + j]);
  // window position i (0 .. keep + L - 1): the saved inputs first, then the span's rows
  auto at = [&](int64_t i, int64_t c) -> float {
    return i < keep ? to_float(state[c * keep + i]) : to_float(x[(i - keep) * x_stride + c]);
  };
  at::parallel_for(0, L, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(C);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < K; ++j) {
        const float* w = wt.data() + j * C;
        if (t + j >= keep) {  // a row of the span: contiguous over channels
          const scalar_t* row = x + (t + j - keep) * x_stride;
          for (int64_t c = 0; c < C; ++c) acc[c] += to_float(row[c]) * w[c];
        } else {
          for (int64_t c = 0; c < C; ++c) acc[c] += at(t + j, c) * w[c];
        }
      }
      for (int64_t c = 0; c < C; ++c) acc[c] = round_to<scalar_t>(acc[c]);  // the conv's output, rounded
      silu_rounded<scalar_t>(acc.data(), C);
      scalar_t* dst = out + t * C;
      for (int64_t c = 0; c < C; ++c) dst[c] = static_cast<scalar_t>(acc[c]);  // exact: rounded already
    }
  });
  std::vector<scalar_t> last(C * keep);  // the window's last keep positions, read before any is written
  for (int64_t c = 0; c < C; ++c)
    for (int64_t i = 0; i < keep; ++i) last[c * keep + i] = static_cast<scalar_t>(at(L + i, c));
  std::copy(last.begin(), last.end(), state);
}

// Phase 1: the conv for every row and channel, into `mixed` [D, C] fp32 (already rounded as the
// torch path rounds), and the conv states shifted. Work items are (row, chunk of channels), so that
// one row's channels are split across the threads too.
template <typename scalar_t>
void decode_conv_silu(const scalar_t* qkv, int64_t qkv_stride, scalar_t* conv_pool, const int64_t* slots,
                      const scalar_t* weight, int64_t D, int64_t C, int64_t K, float* mixed) {
  const int64_t keep = K - 1;
  constexpr int64_t kChannels = 512;
  const int64_t chunks = (C + kChannels - 1) / kChannels;
  at::parallel_for(0, D * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / chunks, c0 = (item % chunks) * kChannels, c1 = std::min(C, c0 + kChannels);
      scalar_t* state = conv_pool + slots[r] * C * keep;  // [C, K - 1]
      const scalar_t* x = qkv + r * qkv_stride;
      float* out = mixed + r * C;
      for (int64_t c = c0; c < c1; ++c) {
        scalar_t* s = state + c * keep;
        const scalar_t* w = weight + c * K;
        float acc = 0.f;
        for (int64_t t = 0; t < keep; ++t) acc += to_float(s[t]) * to_float(w[t]);
        acc += to_float(x[c]) * to_float(w[keep]);
        for (int64_t t = 0; t + 1 < keep; ++t) s[t] = s[t + 1];
        if (keep > 0) s[keep - 1] = x[c];
        out[c] = round_to<scalar_t>(acc);  // decode_conv's result, in the weight's dtype
      }
      silu_rounded<scalar_t>(out + c0, c1 - c0);  // silu, rounded again
    }
  });
}

// l2norm(x) * scale over n values into out (the reference: x * rsqrt(sum(x^2) + 1e-6)).
inline void l2_normed(const float* x, int64_t n, float scale, float* out) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum + 1e-6f);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv / scale;
}

// Phase 2: the delta rule for every (row, value head), then the gated RMSNorm of its output (the
// reference's RMSNormGated, as gated_deltanet.GatedRMSNorm rounds it: the rule's output to the model's
// dtype, x * rsqrt(mean(x^2) + eps) rounded, times the weight rounded, times silu(z) in fp32, rounded).
template <typename scalar_t>
void delta_rule(const float* mixed, int64_t C, float* rec_pool, const int64_t* slots, const float* g,
                const float* beta, const scalar_t* z, int64_t z_stride, const scalar_t* norm_weight, float eps,
                int64_t D, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, scalar_t* out) {
  const int64_t rep = Hv / Hk, key_dim = Hk * Dk;
  const float q_scale = std::sqrt(static_cast<float>(Dk));  // the reference divides by it
  at::parallel_for(0, D * Hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(2 * Dk + 4 * Dv);
    float* __restrict__ q = buf.data();
    float* __restrict__ k = q + Dk;
    float* __restrict__ kv = k + Dk;
    float* __restrict__ delta = kv + Dv;
    float* __restrict__ o = delta + Dv;
    float* __restrict__ gate = o + Dv;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / Hv, h = item % Hv, kh = h / rep;
      const float* row = mixed + r * C;
      l2_normed(row + kh * Dk, Dk, q_scale, q);
      l2_normed(row + key_dim + kh * Dk, Dk, 1.f, k);
      const float* v = row + 2 * key_dim + h * Dv;
      float* __restrict__ S = rec_pool + (slots[r] * Hv + h) * Dk * Dv;  // [Dk, Dv]
      const float decay = std::exp(g[r * Hv + h]), b = beta[r * Hv + h];
      std::fill(kv, kv + Dv, 0.f);
      for (int64_t i = 0; i < Dk; ++i) {
        float* __restrict__ s = S + i * Dv;
        const float ki = k[i];
        for (int64_t j = 0; j < Dv; ++j) kv[j] += ki * (decay * s[j]);  // S' not stored: pass 2 remakes it
      }
      for (int64_t j = 0; j < Dv; ++j) delta[j] = (v[j] - kv[j]) * b;
      std::fill(o, o + Dv, 0.f);
      for (int64_t i = 0; i < Dk; ++i) {
        float* __restrict__ s = S + i * Dv;
        const float ki = k[i], qi = q[i];
        for (int64_t j = 0; j < Dv; ++j) {
          const float updated = decay * s[j] + ki * delta[j];
          s[j] = updated;
          o[j] += qi * updated;
        }
      }
      float sum = 0.f;
      for (int64_t j = 0; j < Dv; ++j) {
        o[j] = round_to<scalar_t>(o[j]);
        sum += o[j] * o[j];
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(Dv) + eps);
      const scalar_t* zh = z + r * z_stride + h * Dv;
      for (int64_t j = 0; j < Dv; ++j) gate[j] = to_float(zh[j]);
      silu_rounded<float>(gate, Dv);  // silu(z) in fp32, not rounded
      scalar_t* dst = out + item * Dv;
      for (int64_t j = 0; j < Dv; ++j) {
        const float normed = round_to<scalar_t>(to_float(norm_weight[j]) * round_to<scalar_t>(o[j] * inv));
        dst[j] = static_cast<scalar_t>(normed * gate[j]);
      }
    }
  });
}

}  // namespace

// qkv: [D, 2 * Hk * Dk + Hv * Dv] (rows may be strided; the model's dtype), the projections before
// the conv; z: [D, Hv * Dv] (the gate, rows may be strided); g, beta: [D, Hv] fp32; conv_pool:
// [slots, C, K - 1], conv_weight: [C, 1, K], norm_weight: [Dv] (the model's dtype); rec_pool:
// [slots, Hv, Dk, Dv] fp32; slots: [D] long. Returns the gated norm of the rule's output, [D, Hv * Dv]
// in the model's dtype (what out_proj takes); the rows' conv and recurrent states advance in place.
torch::Tensor gated_delta_decode(torch::Tensor qkv, torch::Tensor z, torch::Tensor g, torch::Tensor beta,
                                 torch::Tensor conv_pool, torch::Tensor conv_weight, torch::Tensor rec_pool,
                                 torch::Tensor slots, torch::Tensor norm_weight, double eps, int64_t num_k_heads,
                                 int64_t head_k_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [D, C] with contiguous rows");
  const int64_t D = qkv.size(0), C = qkv.size(1);
  TORCH_CHECK(conv_pool.dim() == 3 && conv_pool.size(1) == C && conv_pool.is_contiguous(), "conv_pool: [slots, C, K-1]");
  TORCH_CHECK(conv_weight.dim() == 3 && conv_weight.size(0) == C && conv_weight.is_contiguous(), "conv_weight: [C, 1, K]");
  const int64_t K = conv_weight.size(2);
  TORCH_CHECK(conv_pool.size(2) == K - 1, "conv_pool holds K - 1 inputs");
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "bf16 or fp32");
  TORCH_CHECK(conv_pool.scalar_type() == dtype && conv_weight.scalar_type() == dtype && z.scalar_type() == dtype &&
              norm_weight.scalar_type() == dtype, "qkv, z, conv_pool, conv_weight and norm_weight share one dtype");
  TORCH_CHECK(rec_pool.dim() == 4 && rec_pool.scalar_type() == at::kFloat && rec_pool.is_contiguous(),
              "rec_pool: [slots, Hv, Dk, Dv] fp32");
  const int64_t Hv = rec_pool.size(1), Dk = rec_pool.size(2), Dv = rec_pool.size(3);
  TORCH_CHECK(Dk == head_k_dim && num_k_heads > 0 && Hv % num_k_heads == 0 && C == 2 * num_k_heads * Dk + Hv * Dv,
              "qkv's width is 2 * Hk * Dk + Hv * Dv");
  TORCH_CHECK(z.dim() == 2 && z.size(0) == D && z.size(1) == Hv * Dv && z.stride(1) == 1, "z: [D, Hv * Dv]");
  TORCH_CHECK(norm_weight.numel() == Dv, "norm_weight: [Dv]");
  norm_weight = norm_weight.contiguous();
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == D, "slots: [D] long");
  slots = slots.contiguous();
  g = g.contiguous();
  beta = beta.contiguous();
  TORCH_CHECK(g.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat && g.numel() == D * Hv &&
              beta.numel() == D * Hv, "g, beta: [D, Hv] fp32");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < D; ++r)
    TORCH_CHECK(slot[r] >= 0 && slot[r] < conv_pool.size(0) && slot[r] < rec_pool.size(0), "slot out of range");
  auto mixed = torch::empty({D, C}, qkv.options().dtype(at::kFloat));
  auto out = torch::empty({D, Hv * Dv}, qkv.options());
  auto run = [&](auto zero) {
    using T = decltype(zero);
    decode_conv_silu<T>(qkv.data_ptr<T>(), qkv.stride(0), conv_pool.data_ptr<T>(), slot, conv_weight.data_ptr<T>(),
                        D, C, K, mixed.data_ptr<float>());
    delta_rule<T>(mixed.data_ptr<float>(), C, rec_pool.data_ptr<float>(), slot, g.data_ptr<float>(),
                  beta.data_ptr<float>(), z.data_ptr<T>(), z.stride(0), norm_weight.data_ptr<T>(),
                  static_cast<float>(eps), D, num_k_heads, Hv, Dk, Dv, out.data_ptr<T>());
  };
  if (dtype == at::kBFloat16) run(c10::BFloat16());
  else run(0.f);
  return out;
}

// x: [L, C] (rows may be strided; the model's dtype), a prefill span's projections before the conv;
// state: [C, K - 1] (the request's slot, contiguous; that dtype), advanced in place; weight: [C, 1, K].
// Returns silu(conv) [L, C] in that dtype, rounded as torch's conv1d and silu round it.
torch::Tensor causal_conv_silu(torch::Tensor x, torch::Tensor state, torch::Tensor weight) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [L, C] with contiguous rows");
  const int64_t L = x.size(0), C = x.size(1);
  TORCH_CHECK(weight.dim() == 3 && weight.size(0) == C && weight.is_contiguous(), "weight: [C, 1, K]");
  const int64_t K = weight.size(2);
  TORCH_CHECK(state.dim() == 2 && state.size(0) == C && state.size(1) == K - 1 && state.is_contiguous(),
              "state: [C, K - 1], contiguous");
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && state.scalar_type() == dtype &&
              weight.scalar_type() == dtype, "x, state and weight: one dtype, bf16 or fp32");
  auto out = torch::empty({L, C}, x.options());
  if (dtype == at::kBFloat16) {
    using T = c10::BFloat16;
    span_conv_silu<T>(x.data_ptr<T>(), x.stride(0), state.data_ptr<T>(), weight.data_ptr<T>(), L, C, K,
                      out.data_ptr<T>());
  } else {
    span_conv_silu<float>(x.data_ptr<float>(), x.stride(0), state.data_ptr<float>(), weight.data_ptr<float>(), L,
                          C, K, out.data_ptr<float>());
  }
  return out;
}
