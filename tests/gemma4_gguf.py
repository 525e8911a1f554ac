"""A Gemma 4 checkpoint written as llama.cpp's converter writes it (`convert_hf_to_gguf.py`, its
`conversion/gemma.py` `Gemma4Model`), for the tests: the converter is not a package the suite can install.

What the file says differently from the checkpoint, each read back by baton.common.gguf_config and
baton.common.gguf_names: per-layer arrays for the MLP width (double on the shared layers) and the KV
heads; the layer pattern as booleans; the sliding layers' head width under `*_swa` keys; the full
layers' partial rotary as a `rope_freqs` tensor (1 per rotated pair, 1e30 for the rest); ggml names,
`layer_scalar` as `layer_output_scale.weight`, the router's scales as `ffn_gate_inp.scale` and
`ffn_down_exps.scale`; a vision-language checkpoint's text model alone. Checked key for key and tensor
for tensor against the converter's output (llama-cpp-python 0.3.36's vendored llama.cpp, `--outtype
f32`) on tests/test_families.py's gemma4_text, gemma4_text_moe and gemma4 models.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.qwen35_gguf import _copy_tokenizer, finish

# tensors the converter renames by hand (Gemma4Model.filter_tensors / modify_tensors)
_RENAMED = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale"}
_NOT_TEXT = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


def write_gemma4_gguf(model_dir: Path, out: Path, tokenizer_gguf: Path, q8_0: bool = False) -> Path:
    """`model_dir` (a Gemma4ForCausalLM or Gemma4ForConditionalGeneration checkpoint, float32) as a GGUF
    at `out`: float32 tensors, or with `q8_0` every 2-D weight whose rows are a multiple of 32 wide as
    Q8_0; its tokenizer copied from `tokenizer_gguf` (the default model's: the tiny models share it)."""
    import gguf
    from safetensors.torch import load_file

    raw = json.loads((model_dir / "config.json").read_text())
    cfg = raw.get("text_config", raw)
    layers, shared = cfg["num_hidden_layers"], cfg.get("num_kv_shared_layers", 0)
    types = cfg["layer_types"]
    full = cfg["per_layer_config"][str(types.index("full_attention"))]  # transformers 5 saves the global_* keys so
    full_dim, sliding_dim = full["head_dim"], cfg["head_dim"]
    writer = gguf.GGUFWriter(str(out), "gemma4")
    writer.add_name("Gemma 4 tiny")
    writer.add_block_count(layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    width = cfg["intermediate_size"]
    if cfg.get("use_double_wide_mlp"):
        writer.add_feed_forward_length([width if i < layers - shared else 2 * width for i in range(layers)])
    else:
        writer.add_feed_forward_length(width)
    writer.add_head_count(cfg["num_attention_heads"])
    kv = cfg["num_key_value_heads"]
    full_kv = full.get("num_key_value_heads")
    if full_kv is not None:  # the converter's per-layer array
        writer.add_head_count_kv([kv if t == "sliding_attention" else full_kv for t in types])
    else:
        writer.add_head_count_kv(kv)
    rope = cfg["rope_parameters"]
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_float32("gemma4.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("enable_moe_block"):
        writer.add_expert_count(cfg["num_experts"])
        writer.add_expert_used_count(cfg["top_k_experts"])
    writer.add_key_length(full_dim)
    writer.add_value_length(full_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8_0 else gguf.LlamaFileType.ALL_F32)
    if cfg.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    writer.add_key_length_swa(sliding_dim)
    writer.add_value_length_swa(sliding_dim)
    if cfg.get("enable_moe_block"):
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_rope_dimension_count(full_dim)
    writer.add_rope_dimension_count_swa(int(sliding_dim * rope["sliding_attention"].get("partial_rotary_factor", 1.0)))
    _copy_tokenizer(writer, tokenizer_gguf)

    rotated = int(full_dim * rope["full_attention"]["partial_rotary_factor"] / 2)
    tensors = {"rope_freqs.weight": np.array([1.0] * rotated + [1e30] * (full_dim // 2 - rotated), dtype=np.float32)}
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, layers)
    for name, t in load_file(str(model_dir / "model.safetensors")).items():
        if name.startswith(_NOT_TEXT):
            continue
        name = name.replace("model.language_model.", "model.")
        parts = name.split(".")
        if parts[1] == "layers" and ".".join(parts[3:]) in _RENAMED:
            tensors[f"blk.{parts[2]}.{_RENAMED['.'.join(parts[3:])]}"] = t.float().numpy()
            continue
        if name.endswith("layer_scalar") or ".experts." in name:  # bare tensors: named as a module's weight
            name += ".weight"
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise KeyError(name)
        tensors[gguf_name] = t.float().numpy()
    finish(writer, {name: np.ascontiguousarray(data) for name, data in tensors.items()}, q8_0)
    return out
