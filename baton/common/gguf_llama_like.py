"""GGUFs of the families whose files are a Llama's with a few keys more: SmolLM3, OLMo 2 and OLMo 3,
Granite (3.x and 4.0's dense models), Ministral 3.

transformers' GGUF reader knows none of these architectures (`smollm3`, `olmo2`, `granite`, as
llama.cpp's converter names them): it refused the config and the tokenizer ("GGUF model with
architecture smollm3 is not supported yet"), so `baton serve SmolLM3-3B-Q4_K_M.gguf` failed although
Baton serves each family from safetensors. Their metadata is llama's under another prefix, so
transformers reads the file as `llama` (`as_llama`: the architecture and the key prefix renamed in a
view of the header; the tokenizer is built from the tokenizer keys whatever the architecture), and the
family's config is made from that Llama config and the keys llama.cpp reads for the family
(`family_config`):

- SmolLM3 (`SmolLM3Model(LlamaModel)`): no rotary on every 4th layer, which llama.cpp builds in
  (`n_no_rope_layer_step = 4`; the converter writes nothing for it): `no_rope_layers` from that rule;
- OLMo 2 (`Olmo2Model`): as read; OLMo 3 is the same architecture with `attention.sliding_window`
  and `attention.sliding_window_pattern` (the converter writes them for it alone): `olmo3` with its
  `layer_types`, YaRN on the full layers and the default rotary on the sliding ones (`rope.freq_base_swa`);
- Granite (`GraniteModel(LlamaModel)`): the four multipliers, under llama.cpp's names
  (`attention.scale`, `embedding_scale`, `residual_scale`, `logit_scale`);
- Ministral 3 (`mistral3`, the text model of Mistral's vision-language checkpoints,
  `Ministral3Model(LlamaModel)`): YaRN with its `mscale_all_dim` (`rope.scaling.yarn_log_multiplier`)
  and the queries' scaling by position (`attention.temperature_scale`: `llama_4_scaling_beta`).

The converter permutes q and k rows for llama.cpp's rotary in the LlamaModel subclasses (SmolLM3,
Granite): their tensors are read with transformers' Llama processor, which undoes it
(`tensor_processor_arch`); OLMo 2's are stored as they are. YaRN (OLMo 3's long-context files)
is read as the converter writes it (`rope.scaling.*`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# llama.cpp architecture -> the Hugging Face model_type its files are read as
LLAMA_LIKE = {"smollm3": "smollm3", "olmo2": "olmo2", "granite": "granite", "mistral3": "ministral3",
              "glm4moe": "glm4_moe"}
# the architectures whose q and k rows the converter permutes (LlamaModel's subclasses)
PERMUTED_QK = ("smollm3", "granite", "mistral3")
# the keys every family takes from the Llama config transformers read
COMMON_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
               "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
NO_ROPE_LAYER_STEP = 4  # llama.cpp's SmolLM3: every 4th layer without rotary


# the architectures whose experts are stacked as Qwen3-MoE's (gate, up, down: [E, rows, in] each)
QWEN3_MOE_EXPERTS = ("glm4moe",)
# the MoE keys llama.cpp reads (the converter's names) -> the config's (GLM-4.5's names)
GLM4_MOE_KEYS = {"expert_count": "n_routed_experts", "expert_used_count": "num_experts_per_tok",
                 "expert_feed_forward_length": "moe_intermediate_size", "expert_shared_count": "n_shared_experts",
                 "leading_dense_block_count": "first_k_dense_replace", "expert_group_count": "n_group",
                 "expert_group_used_count": "topk_group"}


def tensor_processor_arch(arch: str) -> str:
    """The architecture whose transformers tensor processor reads `arch`'s tensors."""
    if arch in QWEN3_MOE_EXPERTS:
        return "qwen3moe"
    return "llama" if arch in PERMUTED_QK else arch


def as_llama(fields: dict[str, Any], arch: str) -> dict[str, Any]:
    """A header's fields as a `llama` file's: the architecture and the `arch.` keys renamed."""
    from gguf import GGUFValueType, ReaderField

    name = np.frombuffer(b"llama", dtype=np.uint8)
    renamed: dict[str, Any] = {}
    for key, field in fields.items():
        if key == "general.architecture":
            field = ReaderField(field.offset, key, [np.array([name.size], dtype=np.uint64), name], [1],
                                [GGUFValueType.STRING])
        elif key.startswith(f"{arch}."):
            key = "llama." + key[len(arch) + 1:]
            field = field._replace(name=key)
        renamed[key] = field
    return renamed


def family_config(config: Any, field: Any, arch: str, has_tensor: Any = lambda name: False
                  ) -> tuple[Any, dict[str, Any]]:
    """The family's config from the Llama config transformers read of an `arch` file; `field(key)`
    reads one of its metadata values (None where absent), `has_tensor(name)` whether the file holds a
    tensor. Returns it and what was set beyond llama's."""
    from transformers import AutoConfig

    base = config.to_dict()
    common = {k: base[k] for k in COMMON_KEYS if base.get(k) is not None}
    layers = int(common["num_hidden_layers"])
    fixes: dict[str, Any] = {"rope_parameters": _rope(field, arch)}
    if (head_dim := field(f"{arch}.attention.key_length")) is not None:
        fixes["head_dim"] = int(head_dim)
    model_type = LLAMA_LIKE[arch]
    if arch == "smollm3":
        fixes["no_rope_layers"] = [int((i + 1) % NO_ROPE_LAYER_STEP != 0) for i in range(layers)]
    elif arch == "olmo2" and (window := field(f"{arch}.attention.sliding_window")) is not None:
        model_type = "olmo3"
        pattern = field(f"{arch}.attention.sliding_window_pattern")
        pattern = pattern if isinstance(pattern, list) else [(i + 1) % 4 != 0 for i in range(layers)]
        fixes["sliding_window"] = int(window)
        fixes["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
        # the rope-scaling keys are the full layers' (the converter reads `full_attention`'s); the
        # sliding layers' rotary is the default one, at their own base where the file has one
        theta = field(f"{arch}.rope.freq_base_swa") or field(f"{arch}.rope.freq_base") or 10_000.0
        fixes["rope_parameters"] = {"full_attention": fixes["rope_parameters"],
                                    "sliding_attention": {"rope_type": "default", "rope_theta": float(theta)}}
    elif arch == "granite":
        for ours, theirs in (("attention_multiplier", "attention.scale"), ("embedding_multiplier", "embedding_scale"),
                             ("residual_multiplier", "residual_scale"), ("logits_scaling", "logit_scale")):
            if (value := field(f"{arch}.{theirs}")) is not None:
                fixes[ours] = float(value)
    elif arch == "mistral3" and fixes["rope_parameters"]["rope_type"] == "yarn":
        # the converter writes mscale_all_dim as yarn_log_multiplier and not mscale; Ministral 3's
        # checkpoints have both 1.0 (YaRN's attention factor their ratio, 1); the queries' scaling
        # by position past the original context (llama_4_scaling_beta) is attention.temperature_scale
        log_mul = float(field(f"{arch}.rope.scaling.yarn_log_multiplier") or 1.0)
        fixes["rope_parameters"].update(mscale=log_mul, mscale_all_dim=log_mul)
        if (beta := field(f"{arch}.attention.temperature_scale")) is not None:
            fixes["rope_parameters"]["llama_4_scaling_beta"] = float(beta)
    elif arch == "glm4moe":
        common["num_hidden_layers"] = layers - int(field(f"{arch}.nextn_predict_layers") or 0)
        fixes.update(_glm4_moe(field, has_tensor, fixes))
    made = AutoConfig.for_model(model_type, **common, **fixes)
    return made, {"model_type": model_type, **fixes}


def _glm4_moe(field: Any, has_tensor: Any, fixes: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5/4.6/4.7's MoE (`Glm4MoeModel`): the expert keys, sigmoid routing (the only gating
    llama.cpp's graph takes for it) scaled and renormalized as the file says, the rotary on
    `rope.dimension_count` of each head, q/k/v biases and per-head q/k norms where the file has those
    tensors. Its multi-token-prediction layer (after the last, `nextn_predict_layers`) is not read:
    no layer of the config."""
    arch = "glm4moe"
    out: dict[str, Any] = {"num_nextn_predict_layers": 0}
    for theirs, ours in GLM4_MOE_KEYS.items():
        if (value := field(f"{arch}.{theirs}")) is not None:
            out[ours] = int(value)
    if (gating := field(f"{arch}.expert_gating_func")) is not None and int(gating) != 2:  # 2: sigmoid
        raise ValueError(f"a {arch} GGUF whose expert gating function is {gating} (GLM-4.5 routes by sigmoid, 2)")
    out["routed_scaling_factor"] = float(field(f"{arch}.expert_weights_scale") or 1.0)
    out["norm_topk_prob"] = bool(field(f"{arch}.expert_weights_norm"))
    head_dim = fixes.get("head_dim")
    if (rotary := field(f"{arch}.rope.dimension_count")) is not None and head_dim:
        out["rope_parameters"] = {**fixes["rope_parameters"], "partial_rotary_factor": int(rotary) / int(head_dim)}
    out["attention_bias"] = has_tensor("blk.0.attn_q.bias")
    out["use_qk_norm"] = has_tensor("blk.0.attn_q_norm.weight")
    return out


def _rope(field: Any, arch: str) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(field(f"{arch}.rope.freq_base") or 10_000.0)}
    kind = field(f"{arch}.rope.scaling.type")
    factor = field(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor is not None:
        rope.update(rope_type="linear", factor=float(factor))
    elif kind == "yarn" and factor is not None:
        rope.update(rope_type="yarn", factor=float(factor),
                    original_max_position_embeddings=int(field(f"{arch}.rope.scaling.original_context_length")))
        for ours, theirs in (("attention_factor", "yarn_attn_factor"), ("beta_fast", "yarn_beta_fast"),
                             ("beta_slow", "yarn_beta_slow")):
            if (value := field(f"{arch}.rope.scaling.{theirs}")) is not None:
                rope[ours] = float(value)
    return rope
