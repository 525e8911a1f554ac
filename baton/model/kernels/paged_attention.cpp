// Decode attention that reads K/V in place through the block table: no gather copy.
//
// One query token per request. Work is split over (request, KV head) pairs; the query heads that
// share a KV head (GQA) are handled together, so every K and V row is read from memory once per
// step. Scores and the softmax are in fp32; K/V may be bf16 or fp32. Where the compiler targets
// AVX-512 (-march=native on such a CPU), or AVX2 with FMA, bf16 with head_dim 64 or 128 runs an
// intrinsics version that keeps rows and accumulators in registers; everything else runs generic
// loops written for the auto-vectoriser, so the file builds on any CPU and compiler that builds
// torch extensions.
//
// Shapes: q [B, H, D]; k_cache, v_cache [KVH, S, D] (one layer, head-major, S = slots);
// block_ids [B, W] int64 (block tables padded to W with block 0); context_lens [B] int64;
// returns [B, H, D] in q's dtype.
#include "vec.h"

namespace {

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

// Calls f(t, row) for the L rows of one head's K or V, in order, each converted to fp32 into
// `row` [D]. Walks block by block: a block's rows are contiguous, and no division per token.
template <typename T, typename F>
inline void for_each_row(const T* head, const int64_t* table, int64_t L, int64_t block_size, int64_t D,
                         float* row, F&& f) {
  for (int64_t t0 = 0; t0 < L; t0 += block_size) {
    const T* block = head + table[t0 / block_size] * block_size * D;
    const int64_t n = std::min(block_size, L - t0);
    for (int64_t j = 0; j < n; ++j) {
      const T* src = block + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) row[d] = to_float(src[d]);
      f(t0 + j, row);
    }
  }
}




// A quantized cache (`--kv-cache-dtype int8 | fp8`, baton/model/kv_quant.py): each row is D
// one-byte codes, then its fp32 scale (kKVScaleBytes), RW = D + 4 elements a row. The value of
// code c is value(c) * scale; int8's codes are integers, e4m3's are converted by bits: its
// exponent and mantissa shifted into an fp32's, times 2^120 (the bias difference, 127 - 7), which
// is exact for normal and subnormal codes alike and vectorises (a table lookup did not).
constexpr int64_t kKVScaleBytes = 4;

inline float code_value(int8_t c) { return static_cast<float>(c); }
inline float code_value(c10::Float8_e4m3fn c) {
  const uint32_t bits = (static_cast<uint32_t>(c.x & 0x7f) << 20) | (static_cast<uint32_t>(c.x & 0x80) << 24);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f * 0x1p120f;
}
inline float code_max(int8_t) { return 127.f; }
inline float code_max(c10::Float8_e4m3fn) { return 448.f; }
inline int8_t to_code(float v, int8_t) { return static_cast<int8_t>(std::nearbyint(std::min(127.f, std::max(-127.f, v)))); }
inline c10::Float8_e4m3fn to_code(float v, c10::Float8_e4m3fn) {
  return c10::Float8_e4m3fn(std::min(448.f, std::max(-448.f, v)));
}

// x [D] fp32 -> one quantized row at dst [D + 4]: as kv_quant.quantize_rows (absmax / code_max)
template <typename Code>
inline void quantize_row(const float* x, int64_t D, Code* dst) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float scale = amax > 0.f ? amax / code_max(Code()) : 1.f;
  for (int64_t d = 0; d < D; ++d) dst[d] = to_code(x[d] / scale, Code());
  std::memcpy(dst + D, &scale, sizeof(float));
}

// Calls f(t, codes, scale) for the L quantized rows of one head's K or V, in order, through the
// block table (rows of D codes and their scale; no division per token).
template <typename Code, typename F>
inline void for_each_code_row(const Code* head, const int64_t* table, int64_t L, int64_t block_size, int64_t D,
                              F&& f) {
  const int64_t RW = D + kKVScaleBytes;
  for (int64_t t0 = 0; t0 < L; t0 += block_size) {
    const Code* block = head + table[t0 / block_size] * block_size * RW;
    const int64_t n = std::min(block_size, L - t0);
    for (int64_t j = 0; j < n; ++j) {
      const Code* src = block + j * RW;
      float s;
      std::memcpy(&s, src + D, sizeof(float));
      f(t0 + j, src, s);
    }
  }
}

// As for_each_row, over quantized rows: row [D] = value(codes) * the row's scale.
template <typename Code, typename F>
inline void for_each_dequantized_row(const Code* head, const int64_t* table, int64_t L, int64_t block_size,
                                     int64_t D, float* row, F&& f) {
  for_each_code_row(head, table, L, block_size, D, [&](int64_t t, const Code* src, float s) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) row[d] = code_value(src[d]) * s;
    f(t, row);
  });
}
template <typename F>
inline void for_each_row(const int8_t* head, const int64_t* table, int64_t L, int64_t block_size, int64_t D, float* row,
                         F&& f) {
  for_each_dequantized_row(head, table, L, block_size, D, row, f);
}
template <typename F>
inline void for_each_row(const c10::Float8_e4m3fn* head, const int64_t* table, int64_t L, int64_t block_size,
                         int64_t D, float* row, F&& f) {
  for_each_dequantized_row(head, table, L, block_size, D, row, f);
}

template <typename C>
constexpr int64_t row_width(int64_t D) {
  return std::is_same_v<C, int8_t> || std::is_same_v<C, c10::Float8_e4m3fn> ? D + kKVScaleBytes : D;
}

// T: q's and out's dtype; C: the cache's (T itself, or a quantized cache's codes: for_each_row's
// overloads below read those)
template <typename T, typename C>
void decode_kernel(const T* q, const C* k_cache, const C* v_cache, const int64_t* block_ids,
                   const int64_t* context_lens, T* out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                   int64_t S, int64_t W, int64_t block_size, float scale) {
  const int64_t G = H / KVH, RW = row_width<C>(D);
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
      const C* kh = k_cache + h * S * RW;
      const C* vh = v_cache + h * S * RW;
      // scores[g, t] = q_g . k_t
      for_each_row(kh, table, L, block_size, D, row.data(), [&](int64_t t, const float* k) {
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * k[d];
          scores[g * L + t] = s;
        }
      });
      softmax_rows(scores.data(), G, L);
      // out_g = sum_t p[g, t] v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_row(vh, table, L, block_size, D, row.data(), [&](int64_t t, const float* v) {
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * v[d];
        }
      });
      for (int64_t g = 0; g < G; ++g) {
        T* orow = out + (b * H + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[g * D + d]);
      }
    }
  });
}


inline bool quantized_kv(at::ScalarType t) { return t == at::kChar || t == at::kFloat8_e4m3fn; }

// The intrinsics kernels (AVX-512 or AVX2, bf16): one per head width and GQA group size G, which
// are template parameters so that the accumulators of a group stay in registers.
using NativeKernel = void (*)(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                              const int64_t* block_ids, const int64_t* context_lens, c10::BFloat16* out, int64_t B,
                              int64_t H, int64_t KVH, int64_t S, int64_t W, int64_t block_size, float scale);

// Family<NC, 1..8>::kernel for the group size G; nullptr past 8 (the generic loops serve those).
template <template <int, int> class Family, int NC, int G = 1>
NativeKernel pick_by_group(int64_t group) {
  if constexpr (G > 8) {
    return nullptr;
  } else {
    return group == G ? Family<NC, G>::kernel : pick_by_group<Family, NC, G + 1>(group);
  }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Walks a request's tokens through its block table without a division per token.
struct RowCursor {
  const c10::BFloat16* head;
  const int64_t* table;
  int64_t block_size, D, block = 0, offset = 0;
  const c10::BFloat16* next() {
    const c10::BFloat16* row = head + (table[block] * block_size + offset) * D;
    if (++offset == block_size) offset = 0, ++block;
    return row;
  }
};

// Software prefetch of an item's rows ahead of their use, K rows then V rows as one stream
// (position p < L is K row p, p >= L is V row p - L), so that the first V rows are in flight while
// the last K tile is computed. Blocks sit anywhere in the pool: the hardware prefetcher cannot
// follow a block table. Hint: the cache level (_MM_HINT_T0: L1, _MM_HINT_T1: L2).
template <int Hint>
struct RowPrefetcher {
  RowCursor k, v;
  int64_t L, done = 0;
  void upto(int64_t position) {
    position = std::min(position, 2 * L);
    for (; done < position; ++done) {
      const char* r = reinterpret_cast<const char*>(done < L ? k.next() : v.next());
      for (int64_t o = 0; o < k.D * 2; o += 64) _mm_prefetch(r + o, static_cast<_mm_hint>(Hint));
    }
  }
};
#endif

#if defined(__AVX512F__)

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

// A quantized cache's rows (int8 or e4m3 codes, then the row's fp32 scale) with head_dim = 16 * NC:
// 16 codes widened to fp32 in registers (e4m3 by its bits, as code_value), the row's scale applied
// to its score (K) and to its probability (V), never to the D elements.
inline __m512 load_codes16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load_codes16(const c10::Float8_e4m3fn* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7f)), 20),
                                       _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24));
  return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
}

template <typename Code, int NC, int G>
void decode_item_quantized_avx512(const c10::BFloat16* q, const Code* kh, const Code* vh, const int64_t* table,
                                  int64_t L, int64_t block_size, float scale, float* scores, c10::BFloat16* out) {
  constexpr int64_t D = 16 * NC;
  __m512 qv[G][NC];
  const __m512 sv = _mm512_set1_ps(scale);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) qv[g][c] = _mm512_mul_ps(load_bf16x16(q + g * D + 16 * c), sv);
  for_each_code_row(kh, table, L, block_size, D, [&](int64_t t, const Code* row, float row_scale) {
    __m512 kr[NC];  // scores[g, t] = s_t (q_g . c_t)
    for (int c = 0; c < NC; ++c) kr[c] = load_codes16(row + 16 * c);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(kr[0], qv[g][0]);
      for (int c = 1; c < NC; ++c) acc = _mm512_fmadd_ps(kr[c], qv[g][c], acc);
      scores[g * L + t] = _mm512_reduce_add_ps(acc) * row_scale;
    }
  });
  softmax_rows_avx512(scores, G, L);
  __m512 acc[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_setzero_ps();
  for_each_code_row(vh, table, L, block_size, D, [&](int64_t t, const Code* row, float row_scale) {
    __m512 vr[NC];  // out_g = sum_t (p[g, t] s_t) c_t
    for (int c = 0; c < NC; ++c) vr[c] = load_codes16(row + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * L + t] * row_scale);
      for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_fmadd_ps(p, vr[c], acc[g][c]);
    }
  });
  alignas(64) float tmp[D];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < NC; ++c) _mm512_store_ps(tmp + 16 * c, acc[g][c]);
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<c10::BFloat16>(tmp[d]);
  }
}

// Every (request, KV head) item of a quantized cache's decode, for head_dim 16 * NC and group G.
template <typename Code, int NC, int G>
void decode_quantized_avx512(const c10::BFloat16* q, const Code* k_cache, const Code* v_cache, const int64_t* block_ids,
                             const int64_t* context_lens, c10::BFloat16* out, int64_t B, int64_t H, int64_t KVH,
                             int64_t S, int64_t W, int64_t block_size, float scale) {
  constexpr int64_t D = 16 * NC, RW = D + kKVScaleBytes;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH, L = context_lens[b];
      scores.resize(G * L);
      decode_item_quantized_avx512<Code, NC, G>(q + (b * H + h * G) * D, k_cache + h * S * RW, v_cache + h * S * RW,
                                                block_ids + b * W, L, block_size, scale, scores.data(),
                                                out + (b * H + h * G) * D);
    }
  });
}

// The quantized kernel for head_dim D (64 or 128) and group size (1..8), or false where none fits.
template <typename Code, int G = 1>
bool run_quantized_avx512(int64_t D, int64_t group, const c10::BFloat16* q, const Code* k, const Code* v,
                          const int64_t* ids, const int64_t* lens, c10::BFloat16* out, int64_t B, int64_t H,
                          int64_t KVH, int64_t S, int64_t W, int64_t block_size, float scale) {
  if constexpr (G > 8) {
    return false;
  } else {
    if (group != G) return run_quantized_avx512<Code, G + 1>(D, group, q, k, v, ids, lens, out, B, H, KVH, S, W, block_size, scale);
    if (D == 64) decode_quantized_avx512<Code, 4, G>(q, k, v, ids, lens, out, B, H, KVH, S, W, block_size, scale);
    else if (D == 128) decode_quantized_avx512<Code, 8, G>(q, k, v, ids, lens, out, B, H, KVH, S, W, block_size, scale);
    else return false;
    return true;
  }
}

// bf16 with head_dim = 16 * NC: K/V rows converted in registers, accumulators kept in registers
// (the generic loops above leave the dot-product reductions and the V accumulators to memory).

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

#if defined(__AVX512BF16__)
// How far ahead rows are prefetched, and into L2 (T1, RowPrefetcher's hint): measured on Zen 4
// over a 30-layer pool at batch 64, context 256: 16/16 rows into L1 24.9 ms, 32/32 26.3, 64/32 into L2 23.1 (docs/performance.md).
constexpr int64_t K_AHEAD = 64;
constexpr int64_t V_AHEAD = 32;

// The same item with AVX512-BF16 on both products, ~2x fewer instructions per token than the
// version above (which was compute-bound: ~65 cycles per token and KV head on Zen 4):
// - q.K: 16 tokens at a time, each token's G dot products as pair dot products on the raw rows,
//   the 16 sums reduced together (reduce16) instead of one horizontal reduction per token;
// - p.V: two tokens per pair dot product: their V rows interleaved (unpack) and multiplied by the
//   two probabilities as a bf16 pair. The probabilities are rounded to bf16 first, as the torch bf16
//   path does (`probs.to(v.dtype)` before its matmul); the accumulators stay fp32. The unpack
//   permutes the output columns within each 128-bit lane; the permutation is undone at the store.
template <int NC, int G>
void decode_item_dpbf16(const c10::BFloat16* q, const c10::BFloat16* kh, const c10::BFloat16* vh,
                        const int64_t* table, int64_t L, int64_t block_size, float scale, float* scores,
                        uint16_t* probs, c10::BFloat16* out) {
  constexpr int64_t D = 16 * NC;
  constexpr int NP = NC / 2;  // zmm of 32 bf16 per row
  static_assert(NC % 2 == 0, "head_dim must be a multiple of 32");
  __m512bh qb[G][NP];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NP; ++c) qb[g][c] = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * c);
  const __m512 scale_v = _mm512_set1_ps(scale);
  RowCursor kc{kh, table, block_size, D};
  RowPrefetcher<_MM_HINT_T1> ahead{kc, RowCursor{vh, table, block_size, D}, L};
  const c10::BFloat16* rows[16];
  for (int64_t t0 = 0; t0 < L; t0 += 16) {
    ahead.upto(t0 + 16 + K_AHEAD);
    const int64_t n = std::min<int64_t>(16, L - t0);
    for (int j = 0; j < n; ++j) rows[j] = kc.next();
    for (int j = n; j < 16; ++j) rows[j] = rows[0];  // padding lanes: computed, never stored
    const __mmask16 mask = (__mmask16)((1u << n) - 1);
    for (int g = 0; g < G; ++g) {
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0], (__m512bh)_mm512_loadu_si512(rows[j]));
        for (int c = 1; c < NP; ++c) a = _mm512_dpbf16_ps(a, qb[g][c], (__m512bh)_mm512_loadu_si512(rows[j] + 32 * c));
        acc[j] = a;
      }
      _mm512_mask_storeu_ps(scores + g * L + t0, mask, _mm512_mul_ps(reduce16(acc), scale_v));
    }
  }
  softmax_rows_avx512(scores, G, L);
  const int64_t Lp = (L + 1) & ~int64_t(1);  // even: the last pair of an odd L is (p, 0)
  for (int g = 0; g < G; ++g) {
    int64_t t = 0;
    for (; t + 16 <= L; t += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + g * Lp + t),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(scores + g * L + t)));
    for (; t < L; ++t) probs[g * Lp + t] = c10::BFloat16(scores[g * L + t]).x;
    if (Lp > L) probs[g * Lp + L] = 0;
  }
  __m512 acc[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_setzero_ps();
  RowCursor vc{vh, table, block_size, D};
  for (int64_t t = 0; t < L; t += 2) {
    ahead.upto(L + t + 2 + V_AHEAD);
    const c10::BFloat16* ra = vc.next();
    const c10::BFloat16* rb = t + 1 < L ? vc.next() : nullptr;
    __m512bh pairs[NC];
    for (int c = 0; c < NP; ++c) {
      const __m512i a = _mm512_loadu_si512(ra + 32 * c);
      const __m512i b = rb != nullptr ? _mm512_loadu_si512(rb + 32 * c) : _mm512_setzero_si512();
      pairs[2 * c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      pairs[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    for (int g = 0; g < G; ++g) {
      int32_t pp;
      std::memcpy(&pp, probs + g * Lp + t, sizeof(pp));
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(pp);
      for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], pv, pairs[c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(64) float tmp[D];
    for (int c = 0; c < NP; ++c) {
      alignas(64) float lo[16], hi[16];
      _mm512_store_ps(lo, acc[g][2 * c]);
      _mm512_store_ps(hi, acc[g][2 * c + 1]);
      for (int l = 0; l < 4; ++l)  // lane l of lo holds columns 8l..8l+3 of the chunk, of hi 8l+4..8l+7
        for (int j = 0; j < 4; ++j) {
          tmp[32 * c + 8 * l + j] = lo[4 * l + j];
          tmp[32 * c + 8 * l + 4 + j] = hi[4 * l + j];
        }
    }
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<c10::BFloat16>(tmp[d]);
  }
}
#endif

template <int NC, int G>
void decode_kernel_avx512(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                          const int64_t* block_ids, const int64_t* context_lens, c10::BFloat16* out, int64_t B,
                          int64_t H, int64_t KVH, int64_t S, int64_t W, int64_t block_size, float scale) {
  constexpr int64_t D = 16 * NC;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<uint16_t> probs;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t L = context_lens[b];
      scores.resize(G * L);
#if defined(__AVX512BF16__)
      probs.resize(G * (L + 1));
      decode_item_dpbf16<NC, G>(q + (b * H + h * G) * D, k_cache + h * S * D, v_cache + h * S * D,
                                block_ids + b * W, L, block_size, scale, scores.data(), probs.data(),
                                out + (b * H + h * G) * D);
#else
      decode_item_avx512<NC, G>(q + (b * H + h * G) * D, k_cache + h * S * D, v_cache + h * S * D,
                                block_ids + b * W, L, block_size, scale, scores.data(), out + (b * H + h * G) * D);
#endif
    }
  });
}

template <int NC, int G>
struct Avx512Decode {
  static constexpr NativeKernel kernel = decode_kernel_avx512<NC, G>;
};

NativeKernel pick_native_kernel(int64_t D, int64_t G) {
  return D == 64 ? pick_by_group<Avx512Decode, 4>(G) : D == 128 ? pick_by_group<Avx512Decode, 8>(G) : nullptr;
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// AVX2 (Zen 2/3, Intel client cores without AVX-512), bf16 with head_dim = 8 * NC: the generic loops
// above convert every K/V row to fp32 in memory, reduce each dot product horizontally and keep the
// V accumulators in memory; at context 1024 the default model's attention cost 7.7 ms of a 23 ms
// step on Zen 3 (its KV is 23.5 MB: ~1.8 ms at the core's bandwidth). Here rows are converted in
// registers, q.K runs 8 tokens at a time (their 8 sums reduced together), and p.V keeps its
// accumulators in registers, a few columns of the head at a time (G x CW ymm): each pass reads
// its columns of every V row (a 64-byte line of a 128-dim row), so no byte is read twice.


// exp(x) for x <= 0 (softmax inputs after the max is subtracted): 2^n * 2^f, |f| <= 1/2, 2^f by the
// degree-6 polynomial of exp_avx512; n clamped at -126 (exp(-87) is 0 next to the max's 1).
inline __m256 exp_avx2_nonpositive(__m256 x) {
  const __m256 t = _mm256_max_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f)), _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 p = exp2_fraction_avx2(_mm256_sub_ps(t, n));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

inline void softmax_rows_avx2(float* scores, int64_t G, int64_t L) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    float m = -INFINITY;
    for (int64_t t = 0; t < L; ++t) m = sg[t] > m ? sg[t] : m;
    const __m256 mb = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= L; t += 8) {
      const __m256 e = exp_avx2_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mb));
      _mm256_storeu_ps(sg + t, e);
      sv = _mm256_add_ps(sv, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sv);
    float sum = 0.f;
    for (float lane : lanes) sum += lane;
    for (; t < L; ++t) {
      sg[t] = std::exp(sg[t] - m);
      sum += sg[t];
    }
    const float inv = 1.f / sum;
    for (t = 0; t < L; ++t) sg[t] *= inv;
  }
}

// [sum(v[0]), ..., sum(v[7])] for 8 vectors of 8 floats.
inline __m256 reduce8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

constexpr int64_t kRowsAhead = 32;  // rows prefetched ahead into L1 (without: a third of the gain)

// One (request, KV head) item: G query heads against L tokens. qf [G, D]: the queries in fp32,
// pre-scaled. CW: ymm columns per p.V pass (the G x CW accumulators and CW rows fit 16 registers).
template <int NC, int G>
void decode_item_avx2(const float* qf, const c10::BFloat16* kh, const c10::BFloat16* vh, const int64_t* table,
                      int64_t L, int64_t block_size, float* scores, c10::BFloat16* out) {
  constexpr int64_t D = 8 * NC;
  constexpr int CW = G <= 3 ? 4 : G <= 6 ? 2 : 1;
  static_assert(NC % CW == 0, "the column passes must cover the head");
  RowCursor kw{kh, table, block_size, D};
  RowPrefetcher<_MM_HINT_T0> ahead{RowCursor{kh, table, block_size, D}, RowCursor{vh, table, block_size, D}, L};
  const c10::BFloat16* rows[8];
  for (int64_t t0 = 0; t0 < L; t0 += 8) {
    ahead.upto(t0 + 8 + kRowsAhead);
    const int64_t n = std::min<int64_t>(8, L - t0);
    for (int j = 0; j < n; ++j) rows[j] = kw.next();
    for (int j = n; j < 8; ++j) rows[j] = rows[0];  // padding lanes: computed, never stored
    for (int g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) {
        __m256 a = _mm256_mul_ps(load_bf16x8(rows[j]), _mm256_loadu_ps(qg));
        for (int c = 1; c < NC; ++c) a = _mm256_fmadd_ps(load_bf16x8(rows[j] + 8 * c), _mm256_loadu_ps(qg + 8 * c), a);
        acc[j] = a;
      }
      const __m256 sums = reduce8(acc);
      if (n == 8) {
        _mm256_storeu_ps(scores + g * L + t0, sums);
      } else {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, sums);
        std::memcpy(scores + g * L + t0, tmp, n * sizeof(float));
      }
    }
  }
  softmax_rows_avx2(scores, G, L);
  for (int c0 = 0; c0 < NC; c0 += CW) {
    __m256 acc[G][CW];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CW; ++c) acc[g][c] = _mm256_setzero_ps();
    RowCursor vw{vh, table, block_size, D};
    for (int64_t t = 0; t < L; ++t) {
      if (c0 == 0 && (t & 7) == 0) ahead.upto(L + t + 8 + kRowsAhead);  // later passes find the rows in L2
      const c10::BFloat16* row = vw.next() + 8 * c0;
      __m256 vr[CW];
      for (int c = 0; c < CW; ++c) vr[c] = load_bf16x8(row + 8 * c);
      for (int g = 0; g < G; ++g) {
        const __m256 p = _mm256_broadcast_ss(scores + g * L + t);
        for (int c = 0; c < CW; ++c) acc[g][c] = _mm256_fmadd_ps(p, vr[c], acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g) {
      alignas(32) float tmp[8 * CW];
      for (int c = 0; c < CW; ++c) _mm256_store_ps(tmp + 8 * c, acc[g][c]);
      for (int d = 0; d < 8 * CW; ++d) out[g * D + 8 * c0 + d] = static_cast<c10::BFloat16>(tmp[d]);
    }
  }
}

template <int NC, int G>
void decode_kernel_avx2(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                        const int64_t* block_ids, const int64_t* context_lens, c10::BFloat16* out, int64_t B,
                        int64_t H, int64_t KVH, int64_t S, int64_t W, int64_t block_size, float scale) {
  constexpr int64_t D = 8 * NC;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    alignas(32) float qf[G * D];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t L = context_lens[b];
      scores.resize(G * L);
      const c10::BFloat16* qh = q + (b * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = to_float(qh[i]) * scale;
      decode_item_avx2<NC, G>(qf, k_cache + h * S * D, v_cache + h * S * D, block_ids + b * W, L, block_size,
                              scores.data(), out + (b * H + h * G) * D);
    }
  });
}

template <int NC, int G>
struct Avx2Decode {
  static constexpr NativeKernel kernel = decode_kernel_avx2<NC, G>;
};

NativeKernel pick_native_kernel(int64_t D, int64_t G) {
  return D == 64 ? pick_by_group<Avx2Decode, 8>(G) : D == 128 ? pick_by_group<Avx2Decode, 16>(G) : nullptr;
}
#endif

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_ids, torch::Tensor context_lens, int64_t block_size,
                           double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q [B,H,D], caches [KVH,S,D]");
  const bool quantized = quantized_kv(k_cache.scalar_type());
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && (quantized || q.scalar_type() == k_cache.scalar_type()),
              "q and the caches must share a dtype (or the caches are int8 / fp8 rows)");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_ids and context_lens must be int64");
  q = q.contiguous();
  k_cache = k_cache.contiguous();
  v_cache = v_cache.contiguous();
  block_ids = block_ids.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(0), S = k_cache.size(1);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(2) == D + (quantized ? kKVScaleBytes : 0), "head shapes do not match");
  TORCH_CHECK(block_ids.dim() == 2 && block_ids.size(0) == B && context_lens.size(0) == B, "one row per request");
  const int64_t W = block_ids.size(1);
  auto lens = context_lens.accessor<int64_t, 1>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= W * block_size, "context length outside its block table");
  auto out = torch::empty_like(q);
  if (quantized) {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, "q bfloat16 or float32");
#if defined(__AVX512F__)
    if (q.scalar_type() == at::kBFloat16) {
      const auto* qp = q.data_ptr<c10::BFloat16>();
      auto* op = out.data_ptr<c10::BFloat16>();
      const float sc = static_cast<float>(scale);
      const bool done = k_cache.scalar_type() == at::kChar
          ? run_quantized_avx512(D, H / KVH, qp, k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(),
                                 block_ids.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), op, B, H, KVH, S, W,
                                 block_size, sc)
          : run_quantized_avx512(D, H / KVH, qp, k_cache.data_ptr<c10::Float8_e4m3fn>(),
                                 v_cache.data_ptr<c10::Float8_e4m3fn>(), block_ids.data_ptr<int64_t>(),
                                 context_lens.data_ptr<int64_t>(), op, B, H, KVH, S, W, block_size, sc);
      if (done) return out;
    }
#endif
    auto run = [&](auto* qp, auto* outp) {
      if (k_cache.scalar_type() == at::kChar)
        decode_kernel(qp, k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), block_ids.data_ptr<int64_t>(),
                                context_lens.data_ptr<int64_t>(), outp, B, H, KVH, D, S, W, block_size,
                                static_cast<float>(scale));
      else
        decode_kernel(qp, k_cache.data_ptr<c10::Float8_e4m3fn>(), v_cache.data_ptr<c10::Float8_e4m3fn>(),
                                block_ids.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), outp, B, H, KVH, D, S,
                                W, block_size, static_cast<float>(scale));
    };
    if (q.scalar_type() == at::kBFloat16)
      run(q.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
    else
      run(q.data_ptr<float>(), out.data_ptr<float>());
    return out;
  }
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const NativeKernel kernel = q.scalar_type() == at::kBFloat16 ? pick_native_kernel(D, H / KVH) : nullptr;
  if (kernel != nullptr) {
    kernel(q.data_ptr<c10::BFloat16>(), k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(),
           block_ids.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), out.data_ptr<c10::BFloat16>(), B, H,
           KVH, S, W, block_size, static_cast<float>(scale));
    return out;
  }
#endif
  if (q.scalar_type() == at::kBFloat16) {
    decode_kernel(q.data_ptr<c10::BFloat16>(), k_cache.data_ptr<c10::BFloat16>(),
                                 v_cache.data_ptr<c10::BFloat16>(), block_ids.data_ptr<int64_t>(),
                                 context_lens.data_ptr<int64_t>(), out.data_ptr<c10::BFloat16>(), B, H, KVH,
                                 D, S, W, block_size, static_cast<float>(scale));
  } else if (q.scalar_type() == at::kFloat) {
    decode_kernel(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                         block_ids.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                         B, H, KVH, D, S, W, block_size, static_cast<float>(scale));
  } else {
    TORCH_CHECK(false, "paged_decode supports bfloat16 and float32");
  }
  return out;
}

// A decode-only step's attention for one layer in one call: RoPE on the q and k heads of the fused
// qkv projection, the new K/V written into their slots, then `paged_decode`. In torch these are ~15
// ops per layer (slices, roll, mul, addcmul, two index_copy_, selects), each a dispatch; at batch 1
// their overhead was a sixth of the step. bf16 only (the fast path); RoPE rounds as the torch bf16
// path does: bf16(bf16(x * cos) + roll(x) * sin_signed), the sum in fp32.
//
// qkv [B, (H + 2 KVH) * D]; cos, sin_signed [B, D] (or [B, 1, D]); kv_cache [2, KVH, S, D] (one
// layer); slot_mapping [B] int64; block_ids [B, W]; context_lens [B] (each including the new token)
// -> [B, H * D]
torch::Tensor rope_write_decode(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin_signed, torch::Tensor kv_cache,
                                torch::Tensor slot_mapping, torch::Tensor block_ids, torch::Tensor context_lens,
                                int64_t num_heads, int64_t block_size, double scale) {
  const bool quantized = quantized_kv(kv_cache.scalar_type());
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && (quantized || kv_cache.scalar_type() == at::kBFloat16),
              "bf16 only (the cache bf16, or int8 / fp8 rows)");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(), "kv_cache [2, KVH, S, D]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
  const int64_t KVH = kv_cache.size(1), S = kv_cache.size(2), H = num_heads;
  const int64_t D = kv_cache.size(3) - (quantized ? kKVScaleBytes : 0), RW = kv_cache.size(3);
  const int64_t B = qkv.size(0);
  qkv = qkv.contiguous();
  TORCH_CHECK(qkv.numel() == B * (H + 2 * KVH) * D, "qkv must be [B, (H + 2 KVH) * D]");
  cos = cos.reshape({B, D}).contiguous();
  sin_signed = sin_signed.reshape({B, D}).contiguous();
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin_signed.scalar_type() == at::kBFloat16, "rope tables bf16");
  slot_mapping = slot_mapping.contiguous();
  TORCH_CHECK(slot_mapping.numel() == B, "one slot per request");
  auto q = torch::empty({B, H, D}, qkv.options());
  const auto* src = qkv.data_ptr<c10::BFloat16>();
  const auto* cp = cos.data_ptr<c10::BFloat16>();
  const auto* sp = sin_signed.data_ptr<c10::BFloat16>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  auto* qp = q.data_ptr<c10::BFloat16>();
  auto* kc = quantized ? nullptr : kv_cache.data_ptr<c10::BFloat16>();
  auto* vc = quantized ? nullptr : kc + KVH * S * D;
  const int64_t half = D / 2, row = (H + 2 * KVH) * D;
  std::vector<float> krow(D);  // a quantized cache's K row after RoPE (bf16-rounded), then quantized
  auto write_quantized = [&](int64_t h, int64_t slot, const float* x, bool is_v) {
    const int64_t offset = ((is_v ? KVH : 0) + h) * S * RW + slot * RW;
    if (kv_cache.scalar_type() == at::kChar)
      quantize_row(x, D, kv_cache.data_ptr<int8_t>() + offset);
    else
      quantize_row(x, D, kv_cache.data_ptr<c10::Float8_e4m3fn>() + offset);
  };
  for (int64_t b = 0; b < B; ++b) {
    const int64_t slot = slots[b];
    TORCH_CHECK(slot >= 0 && slot < S, "slot outside the cache");
    const c10::BFloat16* c = cp + b * D;
    const c10::BFloat16* s = sp + b * D;
    for (int64_t h = 0; h < H + KVH; ++h) {
      const c10::BFloat16* x = src + b * row + h * D;
      const bool to_quantize = quantized && h >= H;
      c10::BFloat16* dst = h < H ? qp + (b * H + h) * D : to_quantize ? nullptr : kc + ((h - H) * S + slot) * D;
      for (int64_t d = 0; d < D; ++d) {
        const float first = to_float(c10::BFloat16(to_float(x[d]) * to_float(c[d])));
        const float rolled = to_float(x[d < half ? d + half : d - half]);
        const c10::BFloat16 value(first + rolled * to_float(s[d]));
        if (to_quantize)
          krow[d] = to_float(value);
        else
          dst[d] = value;
      }
      if (to_quantize) write_quantized(h - H, slot, krow.data(), false);
    }
    for (int64_t h = 0; h < KVH; ++h) {
      const c10::BFloat16* v = src + b * row + (H + KVH + h) * D;
      if (quantized) {
        for (int64_t d = 0; d < D; ++d) krow[d] = to_float(v[d]);
        write_quantized(h, slot, krow.data(), true);
      } else {
        std::memcpy(vc + (h * S + slot) * D, v, D * sizeof(c10::BFloat16));
      }
    }
  }
  auto out = paged_decode(q, kv_cache[0], kv_cache[1], block_ids, context_lens, block_size, scale);
  return out.view({B, H * D});
}
