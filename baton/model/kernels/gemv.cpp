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
// accumulators as they are: no horizontal reductions. In the batch-invariant mode (the default) the
// model uses it for every projection and row count; with BATON_BATCH_INVARIANT=0 only per weight
// shape and row count where it measured faster than oneDNN (`baton.model.linear`).
//
// Packed weight: [ceil(N/64), K/2, 64, 2] bf16 (N padded with zero rows; K must be even).
// x [..., K] bf16 -> [..., N] bf16 (rounded to nearest even, as torch) or fp32.
//
// Batch invariance: every output row is computed by the same arithmetic in the same order whatever
// the number of rows M and wherever the row sits in x (so greedy tokens do not depend on what else
// shares a step; a request resumed in another batch continues with the tokens already sent). The
// AVX512-BF16 path: each row has its own accumulators, reduced over K in pair order; the row tile
// (6, 5, ..., 1 rows) only decides how many rows share a weight load. Where AMX is usable (Intel
// Sapphire Rapids and later) and K % 32 == 0, every row count runs the AMX path instead (one
// kernel per machine and shape, never chosen by M): each 16 x 16 output tile accumulates K in
// 32-column chunks, in order, with TDPBF16PS, whose rows are independent; a tail of fewer than 16
// rows is copied into a zero-padded tile. AMX keeps the kernel near oneDNN's speed at 16-512 rows
// (AVX512-BF16 pair products are 4-7x slower there on that CPU), so that one kernel for every row
// count costs little (docs/performance.md, batch invariance).
#include "vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

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
  store_tiles<MT, 4>(acc, bias, n0, N, out_f, out_b);
}

}  // namespace
#endif

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define BATON_GEMV_AMX 1
namespace {

// Tile registers: tmm0-3 outputs (16 rows x 16 fp32), tmm4-5 activations (16 rows x 32 bf16),
// tmm6-7 weights (16 column pairs x 16 outputs x 2 bf16: 16 rows of 64 bytes, read in place from
// the packed strip with a 256-byte stride).
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

inline void amx_load_config() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// The kernel asks the OS for the AMX tile state once per process (Linux gives it only on request:
// without it the first tile instruction is SIGILL); where that is refused the AVX512-BF16 path runs.
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// AMX unless `gemv_kernel("avx512bf16")` said otherwise (the model's prepare() passes
// RuntimeConfig.gemv_amx down through that call: the environment is read in Python, once)
bool& amx_selected() {
  static bool selected = true;
  return selected;
}

// Bias, rounding and the store of one 16 x 16 output tile (rows valid of them; cols of 16 valid).
inline void amx_store(const float* tile, int64_t rows, const float* bias, int64_t c0, int64_t N, float* out_f,
                      c10::BFloat16* out_b) {
  const int64_t cols = std::min<int64_t>(16, N - c0);
  const __mmask16 mask = (__mmask16)((1u << cols) - 1);
  const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 y = _mm512_add_ps(_mm512_loadu_ps(tile + 16 * m), bv);
    if (out_f != nullptr) _mm512_mask_storeu_ps(out_f + m * N + c0, mask, y);
    else _mm256_mask_storeu_epi16(out_b + m * N + c0, mask, (__m256i)_mm512_cvtneps_pbh(y));
  }
}

// One strip of 64 outputs for one block of 16 activation rows (x0: 16 rows, stride K); the strip is
// read once, in order. rows: how many of the 16 are real.
inline void amx_strip_16(const c10::BFloat16* x0, int64_t K, const c10::BFloat16* strip, int64_t rows,
                         const float* bias, int64_t n0, int64_t N, float* out_f, c10::BFloat16* out_b) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t xs = K * 2, ws = kStrip * 2 * 2;  // bytes per activation row, per packed pair row
  for (int64_t k = 0; k < K; k += 32) {
    const c10::BFloat16* w = strip + (k / 2) * kStrip * 2;
    _tile_loadd(4, x0 + k, xs);
    _tile_loadd(6, w, ws);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, w + 32, ws);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, w + 64, ws);
    _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(7, w + 96, ws);
    _tile_dpbf16ps(3, 4, 7);
  }
  alignas(64) float tile[4][256];
  _tile_stored(0, tile[0], 64);
  _tile_stored(1, tile[1], 64);
  _tile_stored(2, tile[2], 64);
  _tile_stored(3, tile[3], 64);
  for (int j = 0; j < 4 && n0 + 16 * j < N; ++j) amx_store(tile[j], rows, bias, n0 + 16 * j, N, out_f, out_b);
}

// The same for two blocks of 16 rows (x0 and x1), 32 outputs at a time: each weight tile loaded
// once serves 32 rows. The same per-row arithmetic as amx_strip_16 (tile rows are independent and
// each output accumulates the same chunks in the same order).
inline void amx_strip_32(const c10::BFloat16* x0, const c10::BFloat16* x1, int64_t K, const c10::BFloat16* strip,
                         int64_t rows1, const float* bias, int64_t n0, int64_t N, float* out_f0,
                         c10::BFloat16* out_b0, float* out_f1, c10::BFloat16* out_b1) {
  const int64_t xs = K * 2, ws = kStrip * 2 * 2;
  for (int half = 0; half < 2; ++half) {
    const int64_t c = n0 + 32 * half;
    if (c >= N) break;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
      const c10::BFloat16* w = strip + (k / 2) * kStrip * 2 + 64 * half;
      _tile_loadd(4, x0 + k, xs);
      _tile_loadd(6, w, ws);
      _tile_loadd(7, w + 32, ws);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, x1 + k, xs);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    alignas(64) float tile[4][256];
    _tile_stored(0, tile[0], 64);
    _tile_stored(1, tile[1], 64);
    _tile_stored(2, tile[2], 64);
    _tile_stored(3, tile[3], 64);
    for (int j = 0; j < 2 && c + 16 * j < N; ++j) {
      amx_store(tile[j], 16, bias, c + 16 * j, N, out_f0, out_b0);
      amx_store(tile[2 + j], rows1, bias, c + 16 * j, N, out_f1, out_b1);
    }
  }
}

void gemv_amx(const c10::BFloat16* xp, int64_t M, int64_t K, const c10::BFloat16* wp, int64_t NS, const float* b,
              int64_t N, float* out_f, c10::BFloat16* out_b) {
  // a tail of fewer than 16 rows: copied into a zero-padded block (tile loads read 16 rows)
  const int64_t full = M / 16, tail = M % 16;
  std::vector<c10::BFloat16> padded;
  if (tail != 0) {
    padded.assign(16 * K, c10::BFloat16(0.f));
    std::memcpy(padded.data(), xp + full * 16 * K, tail * K * sizeof(c10::BFloat16));
  }
  const int64_t blocks = full + (tail != 0);
  auto block_x = [&](int64_t i) { return i < full ? xp + i * 16 * K : padded.data(); };
  auto block_rows = [&](int64_t i) { return i < full ? int64_t{16} : tail; };
  at::parallel_for(0, NS, 4, [&](int64_t begin, int64_t end) {
    amx_load_config();
    for (int64_t s = begin; s < end; ++s) {
      const c10::BFloat16* strip = wp + s * K * kStrip;
      int64_t i = 0;
      for (; i + 2 <= blocks; i += 2) {
        const int64_t r0 = i * 16, r1 = r0 + 16;
        amx_strip_32(block_x(i), block_x(i + 1), K, strip, block_rows(i + 1), b, s * kStrip, N,
                     out_f ? out_f + r0 * N : nullptr, out_b ? out_b + r0 * N : nullptr,
                     out_f ? out_f + r1 * N : nullptr, out_b ? out_b + r1 * N : nullptr);
      }
      if (i < blocks) {
        const int64_t r0 = i * 16;
        amx_strip_16(block_x(i), K, strip, block_rows(i), b, s * kStrip, N, out_f ? out_f + r0 * N : nullptr,
                     out_b ? out_b + r0 * N : nullptr);
      }
    }
    _tile_release();
  });
}

}  // namespace
#endif

// Which kernel `gemv` runs here: "amx" or "avx512bf16" (or "none"). `choice` "amx" / "avx512bf16"
// selects one for the rest of the process (`CausalLM.prepare` makes RuntimeConfig.gemv_amx's choice
// here; benchmarks and tests pick one too; the default is AMX where it is usable); "" only asks.
std::string gemv_kernel(std::string choice) {
#if defined(BATON_GEMV_AMX)
  if (choice == "amx" || choice == "avx512bf16") amx_selected() = choice == "amx";
  return amx_selected() && amx_permitted() ? "amx" : "avx512bf16";
#elif defined(__AVX512BF16__)
  return "avx512bf16";
#else
  return "none";
#endif
}

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
  const torch::Tensor bias_f = bias_as_float(bias, N);
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const auto* xp = x2.data_ptr<c10::BFloat16>();
  const auto* wp = packed.data_ptr<c10::BFloat16>();
  float* out_f = out_float ? out.data_ptr<float>() : nullptr;
  c10::BFloat16* out_b = out_float ? nullptr : out.data_ptr<c10::BFloat16>();
#if defined(BATON_GEMV_AMX)
  if (K % 32 == 0 && M > 0 && amx_selected() && amx_permitted()) {
    gemv_amx(xp, M, K, wp, NS, b, N, out_f, out_b);
    return out.view(out_shape);
  }
#endif
  over_strips_and_row_tiles(NS, M, [&](int64_t s, int64_t m0, auto tile) {
    strip_kernel<decltype(tile)::value>(xp + m0 * K, K, wp + s * K * kStrip, b, s * kStrip, N,
                                        out_f ? out_f + m0 * N : nullptr, out_b ? out_b + m0 * N : nullptr);
  });
  return out.view(out_shape);
#else
  TORCH_CHECK(false, "gemv needs AVX512-BF16");
  return x;
#endif
}
