// Decode attention that reads K/V in place through the block table: no gather copy.
//
// One query token per request. Work is split over (request, KV head) pairs; the query heads that
// share a KV head (GQA) are handled together, so every K and V row is read from memory once per
// step. Scores and the softmax are in fp32; K/V may be bf16 or fp32. Where the compiler targets
// AVX-512 (-march=native on such a CPU) bf16 with head_dim 64 or 128 runs an intrinsics version that
// keeps rows and accumulators in registers; everything else runs generic loops written for the
// auto-vectoriser, so the file builds on any CPU and compiler that builds torch extensions.
//
// Shapes: q [B, H, D]; k_cache, v_cache [KVH, S, D] (one layer, head-major, S = slots);
// block_ids [B, W] int64 (block tables padded to W with block 0); context_lens [B] int64;
// returns [B, H, D] in q's dtype.
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


// p[g, :] = softmax(scores[g, :]) in place, for each of the G rows of length L
inline void softmax_rows(float* scores, int64_t G, int64_t L) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    float m = -INFINITY;
    for (int64_t t = 0; t < L; ++t) m = sg[t] > m ? sg[t] : m;
    float sum = 0.f;
    for (int64_t t = 0; t < L; ++t) {
      sg[t] = std::exp(sg[t] - m);
      sum += sg[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
  }
}

template <typename T>
void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_ids,
                   const int64_t* context_lens, T* out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                   int64_t S, int64_t W, int64_t block_size, float scale) {
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    std::vector<float> row(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t L = context_lens[b];
      const int64_t* table = block_ids + b * W;
      scores.assign(G * L, 0.f);
      for (int64_t g = 0; g < G; ++g) {
        const T* qrow = q + (b * H + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(qrow[d]) * scale;
      }
      const T* kh = k_cache + h * S * D;
      const T* vh = v_cache + h * S * D;
      // scores[g, t] = q_g . k_t, block by block (no division per token: a block's rows are contiguous)
      for (int64_t t0 = 0; t0 < L; t0 += block_size) {
        const T* kblock = kh + table[t0 / block_size] * block_size * D;
        const int64_t n = std::min(block_size, L - t0);
        for (int64_t j = 0; j < n; ++j) {
          const T* krow = kblock + j * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) row[d] = to_float(krow[d]);
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qg[d] * row[d];
            scores[g * L + t0 + j] = s;
          }
        }
      }
      softmax_rows(scores.data(), G, L);
      // out_g = sum_t p[g, t] v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += block_size) {
        const T* vblock = vh + table[t0 / block_size] * block_size * D;
        const int64_t n = std::min(block_size, L - t0);
        for (int64_t j = 0; j < n; ++j) {
          const T* vrow = vblock + j * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) row[d] = to_float(vrow[d]);
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * L + t0 + j];
            float* ag = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* orow = out + (b * H + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[g * D + d]);
      }
    }
  });
}


#if defined(__AVX512F__)
// bf16 with head_dim = 16 * NC: K/V rows converted in registers, accumulators kept in registers
// (the generic loops above leave the dot-product reductions and the V accumulators to memory).
inline __m512 load_bf16x16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}


// exp(x) for x <= 0 (scores minus their max): 2^(x log2 e) = 2^n * 2^f, |f| <= 1/2, 2^f by its
// degree-6 Taylor polynomial (relative error < 2e-8, far below bf16's resolution).
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

inline void softmax_rows_avx512(float* scores, int64_t G, int64_t L) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= L; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sg + t));
    float m = _mm512_reduce_max_ps(mv);
    for (int64_t r = t; r < L; ++r) m = sg[r] > m ? sg[r] : m;
    const __m512 mb = _mm512_set1_ps(m);
    __m512 sv = _mm512_setzero_ps();
    for (t = 0; t + 16 <= L; t += 16) {
      const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(sg + t), mb));
      _mm512_storeu_ps(sg + t, e);
      sv = _mm512_add_ps(sv, e);
    }
    float sum = _mm512_reduce_add_ps(sv);
    for (int64_t r = t; r < L; ++r) {
      sg[r] = std::exp(sg[r] - m);
      sum += sg[r];
    }
    const float inv = 1.f / sum;
    const __m512 iv = _mm512_set1_ps(inv);
    for (t = 0; t + 16 <= L; t += 16) _mm512_storeu_ps(sg + t, _mm512_mul_ps(_mm512_loadu_ps(sg + t), iv));
    for (int64_t r = t; r < L; ++r) sg[r] *= inv;
  }
}

inline void prefetch_block(const c10::BFloat16* p, int64_t elements) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t offset = 0; offset < elements * 2; offset += 64) _mm_prefetch(bytes + offset, _MM_HINT_T0);
}

// One (request, KV head) item: G query heads against L tokens of K/V, NC vectors of 16 per row.
// K rows are read once for all G heads (with AVX512-BF16, as bf16 pair dot products on the raw
// rows: no conversion); V rows are converted once and accumulated into G x NC registers.
template <int NC, int G>
void decode_item_avx512(const c10::BFloat16* q, const c10::BFloat16* kh, const c10::BFloat16* vh,
                        const int64_t* table, int64_t L, int64_t block_size, float scale, float* scores,
                        c10::BFloat16* out) {
  constexpr int64_t D = 16 * NC;
#if defined(__AVX512BF16__)
  __m512bh qb[G][NC / 2];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC / 2; ++c) qb[g][c] = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * c);
#else
  __m512 qv[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) qv[g][c] = load_bf16x16(q + g * D + 16 * c);
#endif
  const int64_t num_blocks = (L + block_size - 1) / block_size;
  prefetch_block(kh + table[0] * block_size * D, std::min(block_size, L) * D);
  for (int64_t t0 = 0; t0 < L; t0 += block_size) {
    const int64_t i = t0 / block_size;
    const c10::BFloat16* kblock = kh + table[i] * block_size * D;
    const int64_t n = std::min(block_size, L - t0);
    // Blocks sit anywhere in the pool: the hardware prefetcher cannot guess the next one.
    if (i + 1 < num_blocks) prefetch_block(kh + table[i + 1] * block_size * D, block_size * D);
    else prefetch_block(vh + table[0] * block_size * D, std::min(block_size, L) * D);
    for (int64_t j = 0; j < n; ++j) {
      const c10::BFloat16* krow = kblock + j * D;
#if defined(__AVX512BF16__)
      __m512bh kb[NC / 2];
      for (int c = 0; c < NC / 2; ++c) kb[c] = (__m512bh)_mm512_loadu_si512(krow + 32 * c);
      for (int g = 0; g < G; ++g) {
        __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0], kb[0]);
        for (int c = 1; c < NC / 2; ++c) acc = _mm512_dpbf16_ps(acc, qb[g][c], kb[c]);
        scores[g * L + t0 + j] = _mm512_reduce_add_ps(acc) * scale;
      }
#else
      __m512 kr[NC];
      for (int c = 0; c < NC; ++c) kr[c] = load_bf16x16(krow + 16 * c);
      for (int g = 0; g < G; ++g) {
        __m512 acc = _mm512_mul_ps(qv[g][0], kr[0]);
        for (int c = 1; c < NC; ++c) acc = _mm512_fmadd_ps(qv[g][c], kr[c], acc);
        scores[g * L + t0 + j] = _mm512_reduce_add_ps(acc) * scale;
      }
#endif
    }
  }
  softmax_rows_avx512(scores, G, L);
  __m512 acc[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < L; t0 += block_size) {
    const int64_t i = t0 / block_size;
    const c10::BFloat16* vblock = vh + table[i] * block_size * D;
    const int64_t n = std::min(block_size, L - t0);
    if (i + 1 < num_blocks) prefetch_block(vh + table[i + 1] * block_size * D, block_size * D);
    for (int64_t j = 0; j < n; ++j) {
      __m512 vr[NC];
      for (int c = 0; c < NC; ++c) vr[c] = load_bf16x16(vblock + j * D + 16 * c);
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * L + t0 + j]);
        for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_fmadd_ps(p, vr[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(64) float tmp[D];
    for (int c = 0; c < NC; ++c) _mm512_store_ps(tmp + 16 * c, acc[g][c]);
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<c10::BFloat16>(tmp[d]);
  }
}

template <int NC, int G>
void decode_kernel_avx512(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                          const int64_t* block_ids, const int64_t* context_lens, c10::BFloat16* out, int64_t B,
                          int64_t H, int64_t KVH, int64_t S, int64_t W, int64_t block_size, float scale) {
  constexpr int64_t D = 16 * NC;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t L = context_lens[b];
      scores.resize(G * L);
      decode_item_avx512<NC, G>(q + (b * H + h * G) * D, k_cache + h * S * D, v_cache + h * S * D,
                                block_ids + b * W, L, block_size, scale, scores.data(), out + (b * H + h * G) * D);
    }
  });
}

using AvxKernel = void (*)(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, const int64_t*,
                           const int64_t*, c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           float);

template <int NC>
AvxKernel pick_avx512_kernel(int64_t G) {
  switch (G) {
    case 1: return decode_kernel_avx512<NC, 1>;
    case 2: return decode_kernel_avx512<NC, 2>;
    case 3: return decode_kernel_avx512<NC, 3>;
    case 4: return decode_kernel_avx512<NC, 4>;
    case 5: return decode_kernel_avx512<NC, 5>;
    case 6: return decode_kernel_avx512<NC, 6>;
    case 7: return decode_kernel_avx512<NC, 7>;
    case 8: return decode_kernel_avx512<NC, 8>;
    default: return nullptr;
  }
}
#endif

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_ids, torch::Tensor context_lens, int64_t block_size,
                           double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q [B,H,D], caches [KVH,S,D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_ids and context_lens must be int64");
  q = q.contiguous();
  k_cache = k_cache.contiguous();
  v_cache = v_cache.contiguous();
  block_ids = block_ids.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(0), S = k_cache.size(1);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(2) == D, "head shapes do not match");
  TORCH_CHECK(block_ids.dim() == 2 && block_ids.size(0) == B && context_lens.size(0) == B, "one row per request");
  const int64_t W = block_ids.size(1);
  auto lens = context_lens.accessor<int64_t, 1>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= W * block_size, "context length outside its block table");
  auto out = torch::empty_like(q);
#if defined(__AVX512F__)
  AvxKernel kernel = q.scalar_type() != at::kBFloat16 ? nullptr
                     : D == 64 ? pick_avx512_kernel<4>(H / KVH)
                     : D == 128 ? pick_avx512_kernel<8>(H / KVH) : nullptr;
  if (kernel != nullptr) {
    kernel(q.data_ptr<c10::BFloat16>(), k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(),
           block_ids.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), out.data_ptr<c10::BFloat16>(), B, H,
           KVH, S, W, block_size, static_cast<float>(scale));
    return out;
  }
#endif
  if (q.scalar_type() == at::kBFloat16) {
    decode_kernel<c10::BFloat16>(q.data_ptr<c10::BFloat16>(), k_cache.data_ptr<c10::BFloat16>(),
                                 v_cache.data_ptr<c10::BFloat16>(), block_ids.data_ptr<int64_t>(),
                                 context_lens.data_ptr<int64_t>(), out.data_ptr<c10::BFloat16>(), B, H, KVH,
                                 D, S, W, block_size, static_cast<float>(scale));
  } else if (q.scalar_type() == at::kFloat) {
    decode_kernel<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                         block_ids.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                         B, H, KVH, D, S, W, block_size, static_cast<float>(scale));
  } else {
    TORCH_CHECK(false, "paged_decode supports bfloat16 and float32");
  }
  return out;
}

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

// The residual stream's `x += delta` fused with the next RMSNorm: returns weight * rms_norm(x), and
// updates x in place. One pass over x instead of the add plus the norm's several ops. bf16: the sum
// is rounded to bf16 (as torch's add), the norm computed in fp32, rounded, then scaled by the
// weight (the reference's order). x, delta: [T, H]; weight: [H].
torch::Tensor add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x must be contiguous [T, H] bf16");
  TORCH_CHECK(weight.numel() == x.size(1) && weight.scalar_type() == at::kBFloat16, "weight must be [H] bf16");
  const int64_t T = x.size(0), H = x.size(1);
  torch::Tensor d;
  if (delta.has_value()) {
    d = delta->contiguous();
    TORCH_CHECK(d.sizes() == x.sizes() && d.scalar_type() == at::kBFloat16, "delta must match x");
  }
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* dp = d.defined() ? d.data_ptr<c10::BFloat16>() : nullptr;
  const c10::BFloat16* wp = weight.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t t = begin; t < end; ++t) {
      c10::BFloat16* xr = xp + t * H;
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
      const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(H) + static_cast<float>(eps));
      c10::BFloat16* orow = op + t * H;
      for (int64_t i = 0; i < H; ++i) {
        const float normed = static_cast<float>(static_cast<c10::BFloat16>(row[i] * inv));
        orow[i] = static_cast<c10::BFloat16>(normed * static_cast<float>(wp[i]));
      }
    }
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
