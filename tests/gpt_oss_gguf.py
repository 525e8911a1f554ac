"""A gpt-oss checkpoint with MXFP4 experts written as llama.cpp's converter writes it
(`convert_hf_to_gguf.py`, its `conversion/gpt_oss.py`), for the tests: the converter is not a package
the suite can install.

Its departures from the checkpoint, each undone on load by baton.model.gguf_gpt_oss: ggml names
(`attn_sinks.weight`, `ffn_gate_inp` for the router); gate_up_proj's interleaved rows (and bias) split
into `ffn_gate_exps` (even rows) and `ffn_up_exps` (odd); the MXFP4 blocks repacked in ggml's layout
(per 32 values the scale byte, then 16 bytes holding values j and j + 16), `repack_mxfp4` and
`transform_nibble_layout` there; YaRN's keys as `rope.scaling.*`; no SwiGLU limit (llama.cpp's graph has
7.0 built in). Checked tensor for tensor and key for key against the converter's output (llama-cpp-python
0.3.36's vendored llama.cpp, `--outtype f32`) on the tiny model of tests/test_moe_quant.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tests.qwen35_gguf import _copy_tokenizer

PER_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
             "mlp.router.bias": "ffn_gate_inp.bias", "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
             **{f"self_attn.{hf}_proj.{kind}": f"attn_{ggml}.{kind}"
                for hf, ggml in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")) for kind in ("weight", "bias")}}
TOP_LEVEL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """The checkpoint's (blocks [..., G, 16], scales [..., G]) as ggml MXFP4 bytes [..., G * 17]."""
    b = blocks.numpy()
    codes = np.empty((*b.shape[:-1], 32), dtype=np.uint8)
    codes[..., 0::2], codes[..., 1::2] = b & 0x0F, b >> 4  # value 2i low, 2i + 1 high
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # byte j: value j low, j + 16 high
    data = np.concatenate([scales.numpy()[..., None], packed], axis=-1)
    return np.ascontiguousarray(data.reshape(*data.shape[:-2], -1))


def write_gpt_oss_gguf(model_dir: Path, out: Path, tokenizer_gguf: Path) -> Path:
    """`model_dir` (a GptOssForCausalLM checkpoint with MXFP4 experts, float32 otherwise) as a GGUF."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    tensors = load_file(str(model_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out), "gpt-oss")
    writer.add_name("Tiny gpt-oss")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg["rope_parameters"]
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_expert_count(cfg["num_local_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_expert_feed_forward_length(cfg["intermediate_size"])
    _copy_tokenizer(writer, tokenizer_gguf)
    for name, t in tensors.items():
        if name in TOP_LEVEL:
            writer.add_tensor(TOP_LEVEL[name], t.float().numpy())
            continue
        _, _, block, rest = name.split(".", 3)
        blk = f"blk.{block}."
        if rest in PER_LAYER:
            writer.add_tensor(blk + PER_LAYER[rest], t.float().numpy())
        elif rest == "mlp.experts.gate_up_proj_bias":
            writer.add_tensor(blk + "ffn_gate_exps.bias", t[:, ::2].float().contiguous().numpy())
            writer.add_tensor(blk + "ffn_up_exps.bias", t[:, 1::2].float().contiguous().numpy())
        elif rest == "mlp.experts.gate_up_proj_blocks":
            scales = tensors[name.replace("_blocks", "_scales")]
            for leaf, rows in (("ffn_gate_exps", slice(0, None, 2)), ("ffn_up_exps", slice(1, None, 2))):
                writer.add_tensor(blk + leaf + ".weight", ggml_mxfp4(t[:, rows], scales[:, rows]),
                                  raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        elif rest == "mlp.experts.down_proj_blocks":
            writer.add_tensor(blk + "ffn_down_exps.weight", ggml_mxfp4(t, tensors[name.replace("_blocks", "_scales")]),
                              raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        elif not rest.endswith("_scales"):
            raise KeyError(name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
