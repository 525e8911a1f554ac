// All decoder layers of a small decode-only step in one call.
//
// At batch 1 the matmuls stream the weights at the machine's bandwidth (gemv.cpp); what was left
// of the step above its floor was ~8 native calls per layer made from Python, each a few
// microseconds of interpreter, argument parsing and tensor wrapping: 240 per step, ~15% of it. This
// loop makes the same calls from C++, in the same order, so its output equals the Python loop's
// bit for bit (tests/test_kernels.py). Used only where every projection of every layer takes the
// native few-row kernel for this many rows, without biases (LlamaModel.prepare decides).
//
// x [T, H] bf16: the residual stream (updated in place); norms: the 2L + 1 RMSNorm weights in the
// order they apply (layer 0 input, layer 0 post-attention, layer 1 input, ..., final); qkv, o,
// gate_up, down: the L packed weights of each projection (gemv_pack); out_features: their N;
// kv_cache [L, 2, KVH, S, D]; the rest as rope_write_decode. Returns the final norm's output [T, H].
torch::Tensor decode_layers(torch::Tensor x, std::vector<torch::Tensor> norms, double eps,
                            std::vector<torch::Tensor> qkv, std::vector<torch::Tensor> o,
                            std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down,
                            std::vector<int64_t> out_features, torch::Tensor kv_cache, torch::Tensor cos,
                            torch::Tensor sin_signed, torch::Tensor slot_mapping, torch::Tensor block_ids,
                            torch::Tensor context_lens, int64_t num_heads, int64_t block_size, double scale) {
  const int64_t L = static_cast<int64_t>(qkv.size());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * L + 1 && static_cast<int64_t>(o.size()) == L &&
                  static_cast<int64_t>(gate_up.size()) == L && static_cast<int64_t>(down.size()) == L,
              "one weight per layer and projection, 2L + 1 norms");
  TORCH_CHECK(out_features.size() == 4, "out_features: qkv, o, gate_up, down");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == L, "kv_cache [L, 2, KVH, S, D]");
  const c10::optional<torch::Tensor> no_bias;
  torch::Tensor h = add_rms_norm(x, no_bias, norms[0], eps);
  for (int64_t i = 0; i < L; ++i) {
    const torch::Tensor attn = rope_write_decode(gemv(h, qkv[i], no_bias, out_features[0], false), cos, sin_signed,
                                                 kv_cache[i], slot_mapping, block_ids, context_lens, num_heads,
                                                 block_size, scale);
    h = add_rms_norm(x, gemv(attn, o[i], no_bias, out_features[1], false), norms[2 * i + 1], eps);
    const torch::Tensor act = silu_mul(gemv(h, gate_up[i], no_bias, out_features[2], false));
    h = add_rms_norm(x, gemv(act, down[i], no_bias, out_features[3], false), norms[2 * i + 2], eps);
  }
  return h;
}
