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

from tests.qwen35_gguf import _copy_tokenizer, _stacked_experts, add_attention_metadata, finish

ARCH = {"smollm3": "smollm3", "olmo2": "olmo2", "olmo3": "olmo2", "granite": "granite", "ministral3": "mistral3",
        "glm4_moe": "glm4moe"}
# the tiny GLM's end of turn and of message (its vocabulary the default model's: <|im_start|>, <|endoftext|>)
GLM_EOT, GLM_EOM = 1, 0
# GLM-4.5's MoE keys as Glm4MoeModel writes them (gguf's writer method: the config's key)
GLM4_MOE_KEYS = {"add_expert_count": "n_routed_experts", "add_expert_used_count": "num_experts_per_tok",
                 "add_expert_group_count": "n_group", "add_expert_group_used_count": "topk_group",
                 "add_expert_feed_forward_length": "moe_intermediate_size",
                 "add_expert_shared_count": "n_shared_experts", "add_leading_dense_block_count": "first_k_dense_replace",
                 "add_expert_weights_scale": "routed_scaling_factor", "add_expert_weights_norm": "norm_topk_prob",
                 "add_nextn_predict_layers": "num_nextn_predict_layers"}
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
    # GLM-4.5's multi-token-prediction layers follow the last one, counted in block_count
    layers = cfg["num_hidden_layers"] + (cfg.get("num_nextn_predict_layers", 0) if arch == "glm4moe" else 0)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(model_type)
    # GraniteModel drops head_dim
    add_attention_metadata(writer, {**{k: v for k, v in cfg.items() if not (arch == "granite" and k == "head_dim")},
                                    "num_hidden_layers": layers})
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
    if arch == "glm4moe":
        writer.add_rope_dimension_count(int(cfg["head_dim"] * full.get("partial_rotary_factor", 0.5)))
        for method, key in GLM4_MOE_KEYS.items():
            if key in cfg:
                getattr(writer, method)(cfg[key])
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    elif arch != "olmo2":  # LlamaModel's
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
    if arch == "glm4moe":  # `_set_vocab_glm`: a turn ends at <|user|>, a tool call at <|observation|>
        writer.add_eot_token_id(GLM_EOT)
        writer.add_eom_token_id(GLM_EOM)

    name_map = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), layers)
    tensors = {}
    checkpoint = load_file(str(model_dir / "model.safetensors"))
    if arch == "glm4moe":
        checkpoint = _stacked_experts(checkpoint)
    for name, t in checkpoint.items():
        if name.startswith(VISION):
            continue
        name = name.removeprefix("language_model.").replace("model.language_model.", "model.")
        data = t.float().numpy()
        if arch not in ("olmo2", "glm4moe") and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            data = _permuted(data, heads)
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers 5's stack [E, 2I, H] (an MTP layer's here)
            block = name.split(".")[2]
            tensors[f"blk.{block}.ffn_gate_exps.weight"], tensors[f"blk.{block}.ffn_up_exps.weight"] = np.split(data, 2, 1)
            continue
        if name.endswith("mlp.experts.down_proj"):
            tensors[f"blk.{name.split('.')[2]}.ffn_down_exps.weight"] = data
            continue
        if name.startswith("blk."):  # the experts, stacked
            gguf_name = name
        elif name.endswith("e_score_correction_bias"):  # the router's bias, a module of its own in gguf's table
            gguf_name = f"{name_map.get_name(name.removesuffix('_bias'))}.bias"
        else:
            gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise KeyError(name)
        tensors[gguf_name] = data
    # the converter keeps a router's weights in float32 (FFN_GATE_INP)
    finish(writer, {name: np.ascontiguousarray(data) for name, data in tensors.items()}, q8_0,
           keep_f32=lambda name: name.endswith("ffn_gate_inp.weight"))
    return out
