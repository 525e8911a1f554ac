"""A GGUF of a SmolLM3, OLMo 2 / OLMo 3, Granite or Ministral 3 / Mistral 3 checkpoint as llama.cpp's
converter writes one (`convert_hf_to_gguf.py`: `SmolLM3Model`, `GraniteModel` and `Ministral3Model`,
subclasses of `LlamaModel`, and `Olmo2Model`), for tests/test_gguf_llama_like.py. Checked by hand against the converter of
llama-cpp-python 0.3.36 (`--outtype f32` and `q8_0`) on the tiny models of those tests: the same keys
and values (but the tokenizer's, copied here from the default model's file), the same tensors, names,
types and bytes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.qwen35_gguf import _copy_tokenizer, add_attention_metadata, finish

ARCH = {"smollm3": "smollm3", "olmo2": "olmo2", "olmo3": "olmo2", "granite": "granite", "ministral3": "mistral3"}
# a Mistral 3 checkpoint's vision tower (not in the file), as saved now and in the older layout
VISION = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


def _permuted(w: np.ndarray, heads: int) -> np.ndarray:
    """LlamaModel.permute: each head's rows from rotate-half order to llama.cpp's interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_like_gguf(model_dir: Path, out: Path, tokenizer_gguf: Path, q8_0: bool = False) -> Path:
    """`model_dir` (float32 safetensors of one of ARCH's model types) as the converter's GGUF at `out`."""
    import gguf
    from safetensors.torch import load_file

    raw = json.loads((model_dir / "config.json").read_text())
    cfg = raw.get("text_config", raw)  # Mistral 3's vision-language checkpoint: its text model alone
    model_type = cfg["model_type"]
    arch = ARCH[model_type]
    layers = cfg["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(model_type)
    # GraniteModel drops head_dim
    add_attention_metadata(writer, {k: v for k, v in cfg.items() if not (arch == "granite" and k == "head_dim")})
    writer.add_feed_forward_length(cfg["intermediate_size"])
    rope = cfg["rope_parameters"]
    full = rope.get("full_attention", rope)  # the converter reads the full layers' parameters
    if full.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        if "attention_factor" in full:
            writer.add_rope_scaling_yarn_attn_factor(full["attention_factor"])
        if "beta_fast" in full:
            writer.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
        if "beta_slow" in full:
            writer.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
    writer.add_rope_freq_base(full["rope_theta"])
    if "sliding_attention" in rope:
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8_0 else gguf.LlamaFileType.ALL_F32)
    if arch != "olmo2":  # LlamaModel's
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    if arch == "granite":
        writer.add_attention_scale(cfg["attention_multiplier"])
        writer.add_embedding_scale(cfg["embedding_multiplier"])
        writer.add_residual_scale(cfg["residual_multiplier"])
        writer.add_logit_scale(cfg["logits_scaling"])
    if arch == "mistral3":
        writer.add_rope_scaling_yarn_log_mul(full["mscale_all_dim"])
        writer.add_attn_temperature_scale(full["llama_4_scaling_beta"])
    if model_type == "olmo3":
        writer.add_sliding_window(cfg["sliding_window"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    _copy_tokenizer(writer, tokenizer_gguf)

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    tensors = {}
    for name, t in load_file(str(model_dir / "model.safetensors")).items():
        if name.startswith(VISION):
            continue
        name = name.removeprefix("language_model.").replace("model.language_model.", "model.")
        data = t.float().numpy()
        if arch != "olmo2" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            data = _permuted(data, heads)
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise KeyError(name)
        tensors[gguf_name] = data
    finish(writer, {name: np.ascontiguousarray(data) for name, data in tensors.items()}, q8_0)
    return out
