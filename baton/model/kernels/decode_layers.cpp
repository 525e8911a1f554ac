// All decoder layers of a decode-only step in one call.
//
// At batch 1 the matmuls stream the weights at the machine's bandwidth (gemv.cpp); what was left
// of the step above its floor was ~8 native calls per layer made from Python, each a few
// microseconds of interpreter, argument parsing and tensor wrapping: 240 per step, ~15% of it. This
// loop makes the same calls from C++, in the same order, so its output equals the Python loop's
// bit for bit (tests/test_kernels.py). Each projection runs the native few-row kernel up to its
// tuned row count (every row count in the batch-invariant mode: max_native_rows is then 2^40) and
// oneDNN's prepacked matmul (through the dispatcher, as torch.ops would) above it, as RowSplitLinear
// does. A projection whose native pack is a q8_pack or q4_pack (uint8: qgemv.cpp) runs qgemv for
// every row count. Used for bias-free projections only (LayersPlan.build decides).
//
// x [T, H] bf16: the residual stream (updated in place); norms: the 2L + 1 RMSNorm weights in the
// order they apply (layer 0 input, layer 0 post-attention, layer 1 input, ..., final); weights: per
// layer qkv, o, gate_up, down, each as its gemv_pack (or an empty tensor where max_native_rows is 0)
// and its oneDNN-packed weight, 8 per layer; out_features and max_native_rows: per projection kind;
// kv_cache [L, 2, KVH, S, D]; the rest as rope_write_decode. Returns the final norm's output [T, H].
//
// gate_words (int32, empty: no gate), gate_watch, gate_release, gate_threads: threads lent for this
// step by another process (baton/model/thread_gate.py). Before each layer, if a watched word is no
// longer 1 (its owner wants its cores back), the rest of the call runs on gate_threads threads and
// the release words are set to 0, so that the owner waits for one layer, not the whole step. Between
// layers no parallel region runs: once the words are cleared nothing of this call uses the lent
// cores. The thread count never changes what a row computes (every native kernel splits outputs, not sums).
#include <ATen/core/dispatch/Dispatcher.h>

// oneDNN's prepacked bf16 matmul (what PackedLinear calls through torch.ops), called from C++.
// Exported too, so that LlamaModel.prepare can check it against PackedLinear before relying on it.
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  // mkldnn::_linear_pointwise(Tensor X, Tensor W, Tensor? B, str attr, Scalar?[] scalars, str? algorithm)
  std::vector<c10::IValue> stack{x, packed, c10::IValue(), c10::IValue(std::string("none")),
                                 c10::IValue(c10::List<c10::optional<at::Scalar>>()), c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

torch::Tensor decode_layers(torch::Tensor x, std::vector<torch::Tensor> norms, double eps,
                            std::vector<torch::Tensor> weights, std::vector<int64_t> out_features,
                            std::vector<int64_t> max_native_rows, torch::Tensor kv_cache, torch::Tensor cos,
                            torch::Tensor sin_signed, torch::Tensor slot_mapping, torch::Tensor block_ids,
                            torch::Tensor context_lens, int64_t num_heads, int64_t block_size, double scale,
                            torch::Tensor gate_words, std::vector<int64_t> gate_watch,
                            std::vector<int64_t> gate_release, int64_t gate_threads) {
  const int64_t L = static_cast<int64_t>(weights.size()) / 8;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 8 * L && static_cast<int64_t>(norms.size()) == 2 * L + 1,
              "8 weights per layer (4 projections x native and oneDNN), 2L + 1 norms");
  TORCH_CHECK(out_features.size() == 4 && max_native_rows.size() == 4, "per projection: qkv, o, gate_up, down");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == L, "kv_cache [L, 2, KVH, S, D]");
  const int64_t rows = x.size(0);
  const c10::optional<torch::Tensor> no_bias;
  auto project = [&](const torch::Tensor& in, int64_t layer, int kind) {
    const torch::Tensor& native = weights[8 * layer + 2 * kind];
    if (native.scalar_type() == at::kByte) return qgemv(in, native, no_bias, out_features[kind], false);
    if (rows <= max_native_rows[kind]) return gemv(in, native, no_bias, out_features[kind], false);
    return onednn_linear(in, weights[8 * layer + 2 * kind + 1]);
  };
  bool gated = gate_words.numel() > 0 && !gate_watch.empty();
  int32_t* words = nullptr;
  if (gated) {
    TORCH_CHECK(gate_words.scalar_type() == at::kInt && gate_words.is_contiguous() && gate_threads >= 1,
                "gate_words must be contiguous int32 and gate_threads >= 1");
    words = gate_words.data_ptr<int32_t>();
    for (int64_t w : gate_watch) TORCH_CHECK(0 <= w && w < gate_words.numel(), "gate word out of range");
    for (int64_t w : gate_release) TORCH_CHECK(0 <= w && w < gate_words.numel(), "gate word out of range");
  }
  auto look = [&]() {  // between parallel regions only
    if (!gated) return;
    for (int64_t w : gate_watch) {
      if (__atomic_load_n(words + w, __ATOMIC_SEQ_CST) != 1) {
        at::set_num_threads(static_cast<int>(gate_threads));
        for (int64_t r : gate_release) __atomic_store_n(words + r, 0, __ATOMIC_SEQ_CST);
        gated = false;
        return;
      }
    }
  };
  torch::Tensor h = add_rms_norm(x, no_bias, norms[0], eps);
  for (int64_t i = 0; i < L; ++i) {
    look();
    const torch::Tensor attn = rope_write_decode(project(h, i, 0), cos, sin_signed, kv_cache[i], slot_mapping,
                                                 block_ids, context_lens, num_heads, block_size, scale);
    h = add_rms_norm(x, project(attn, i, 1), norms[2 * i + 1], eps);
    const torch::Tensor act = silu_mul(project(h, i, 2));
    h = add_rms_norm(x, project(act, i, 3), norms[2 * i + 2], eps);
  }
  return h;
}
