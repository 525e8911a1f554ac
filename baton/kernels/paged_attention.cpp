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

template <int NC>
void decode_kernel_avx512(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                          const int64_t* block_ids, const int64_t* context_lens, c10::BFloat16* out, int64_t B,
                          int64_t H, int64_t KVH, int64_t S, int64_t W, int64_t block_size, float scale) {
  constexpr int64_t D = 16 * NC;
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<__m512> qv(G * NC);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t L = context_lens[b];
      const int64_t* table = block_ids + b * W;
      scores.resize(G * L);
      for (int64_t g = 0; g < G; ++g)
        for (int c = 0; c < NC; ++c)
          qv[g * NC + c] = _mm512_mul_ps(load_bf16x16(q + (b * H + h * G + g) * D + 16 * c), _mm512_set1_ps(scale));
      const c10::BFloat16* kh = k_cache + h * S * D;
      const c10::BFloat16* vh = v_cache + h * S * D;
      for (int64_t t0 = 0; t0 < L; t0 += block_size) {
        const c10::BFloat16* kblock = kh + table[t0 / block_size] * block_size * D;
        const int64_t n = std::min(block_size, L - t0);
        for (int64_t j = 0; j < n; ++j) {
          __m512 kr[NC];
          for (int c = 0; c < NC; ++c) kr[c] = load_bf16x16(kblock + j * D + 16 * c);
          for (int64_t g = 0; g < G; ++g) {
            __m512 acc = _mm512_mul_ps(qv[g * NC], kr[0]);
            for (int c = 1; c < NC; ++c) acc = _mm512_fmadd_ps(qv[g * NC + c], kr[c], acc);
            scores[g * L + t0 + j] = _mm512_reduce_add_ps(acc);
          }
        }
      }
      softmax_rows_avx512(scores.data(), G, L);
      for (int64_t g = 0; g < G; ++g) {
        __m512 acc[NC];
        for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
        const float* pg = scores.data() + g * L;
        for (int64_t t0 = 0; t0 < L; t0 += block_size) {
          const c10::BFloat16* vblock = vh + table[t0 / block_size] * block_size * D;
          const int64_t n = std::min(block_size, L - t0);
          for (int64_t j = 0; j < n; ++j) {
            const __m512 p = _mm512_set1_ps(pg[t0 + j]);
            for (int c = 0; c < NC; ++c) acc[c] = _mm512_fmadd_ps(p, load_bf16x16(vblock + j * D + 16 * c), acc[c]);
          }
        }
        c10::BFloat16* orow = out + (b * H + h * G + g) * D;
        alignas(64) float tmp[D];
        for (int c = 0; c < NC; ++c) _mm512_store_ps(tmp + 16 * c, acc[c]);
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<c10::BFloat16>(tmp[d]);
      }
    }
  });
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
  if (q.scalar_type() == at::kBFloat16 && (D == 64 || D == 128)) {
    auto kernel = D == 64 ? decode_kernel_avx512<4> : decode_kernel_avx512<8>;
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
