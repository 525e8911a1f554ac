"""Model configuration read from a Hugging Face `config.json`, through the family's spec.

Rules: `from_dir` is the only place that reads config.json keys; everything the model needs is a
plain field here, already resolved (the spec's scheme applied to the checkpoint's numbers: per-layer
window and rotary flags, the attention scale, the multipliers), so the model never looks at a
model_type. Every field has the default that makes a plain Llama, so a `ModelConfig(...)` built by
hand (tests) is a Llama.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from baton.model.families import ACTIVATIONS, ROPE_TYPES, TEXT_ONLY, FamilySpec, family_spec
from baton.model.gemma4_config import gemma4_fields


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # rope_type and its parameters; None = default
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k and v
    mlp_bias: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    # Identifies the weights in KV block hashes: the same tokens under another model are other KV.
    model_id: str = ""
    # --- what the family spec adds (see baton.model.families) ---
    model_type: str = "llama"
    norm_kind: str = "rms"  # rms | gemma ((1 + w) weights)
    norm_placement: str = "pre"  # pre | sandwich | post
    qk_norm: str = "none"  # none | head | full | l2 (weightless, rotary layers only: Llama 4)
    o_bias: bool = False
    hidden_act: str = "silu"  # silu | gelu_pytorch_tanh
    partial_rotary_factor: float = 1.0  # rotary on the first head_dim * factor dims (Phi-4-mini)
    # sliding layers' own rotary parameters (Gemma 3's local base); None: the global ones
    rope_theta_local: float | None = None
    rope_scaling_local: dict[str, Any] | None = None
    sliding_window: int | None = None  # tokens a window layer attends, itself included
    layer_sliding: list[bool] = field(default_factory=list)  # per layer; empty = no window layer
    layer_rope: list[bool] = field(default_factory=list)  # per layer; empty = rotary everywhere
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    embedding_multiplier: float = 1.0
    embedding_multiplier_in_dtype: bool = False  # Gemma rounds sqrt(hidden) to the model dtype first
    residual_multiplier: float = 1.0
    attention_scale: float | None = None  # None: head_dim ** -0.5
    logits_scaling: float = 1.0  # logits are divided by it (Granite)
    # queries times 1 + beta * log(1 + floor(position / period)) after the rotary (Ministral 3); 0: none
    query_scale_beta: float = 0.0
    query_scale_period: int = 0
    # Llama 4's attention temperature on the no-rotary layers: queries times 1 + scale *
    # log1p(floor((position + 1) / floor)); scale 0: none
    attn_temperature_scale: float = 0.0
    attn_temperature_floor: float = 1.0
    # the window layers attend their own `sliding_window`-aligned chunk of positions, not the last
    # `sliding_window` (Llama 4's chunked attention)
    chunked_window: bool = False
    # the checkpoint's rotary pairs (2i, 2i + 1): its q/k rows are permuted at load (baton.model.loader)
    rope_interleaved: bool = False
    # MoE (num_experts == 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    layer_moe: list[bool] = field(default_factory=list)  # per layer: sparse MLP (Qwen3-MoE mlp_only_layers)
    router: str = "softmax_topk"  # softmax_topk | sigmoid_grouped (see families.Router)
    n_group: int = 1  # sigmoid_grouped: expert groups, the best topk_group of them eligible
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # sigmoid_grouped: the routed experts' weights times it
    num_shared_experts: int = 0  # experts every token runs (one MLP of num * moe_intermediate_size)
    # experts' form (see families.ExpertForm): "gpt_oss" adds biases and the clamped SwiGLU
    expert_form: str = "plain"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    attention_sinks: bool = False  # a learned per-head logit in each attention softmax (gpt-oss)
    mtp_layers: int = 0  # multi-token-prediction layers the checkpoint holds after the last (not run)
    # the vision-language model_type this text model was read out of (`families.TEXT_ONLY`); "": none
    text_only_of: str = ""
    # hybrids (Qwen3-Next, Qwen3.5; baton.model.hybrid): per layer, whether it is a Gated DeltaNet
    # state layer (empty: none is); its sizes and checkpoint layout (`deltanet_dims`)
    layer_deltanet: list[bool] = field(default_factory=list)
    deltanet: dict[str, Any] = field(default_factory=dict)
    shared_expert_intermediate_size: int = 0  # Qwen3-Next: one shared expert behind a sigmoid gate
    # multi-head latent attention (DeepSeek V3; baton.model.mla), kv_lora_rank 0: none. The cache
    # keeps one row per token of the latent c_kv and the shared rotary key, as one KV head of
    # head_dim = kv_lora_rank + qk_rope_head_dim (num_kv_heads 1); q_lora_rank 0: a direct q_proj
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # per-layer attention shapes (Gemma 4, its cache packed by baton.model.layer_cache; empty:
    # head_dim / num_kv_heads everywhere, which are then the widest layer's, the uniform form of a
    # block in the store); layer_kv_source[i]: the layer whose K/V layer i attends (itself, or an
    # earlier one whose cache it shares: it keeps none of its own)
    layer_head_dim: list[int] = field(default_factory=list)
    layer_kv_heads: list[int] = field(default_factory=list)
    layer_kv_source: list[int] = field(default_factory=list)
    gemma4: dict[str, Any] = field(default_factory=dict)  # what else Gemma 4 adds (baton.model.gemma4_config)

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window is not None and bool(self.layer_sliding) and self.layer_sliding[layer]

    def uses_rope(self, layer: int) -> bool:
        return not self.layer_rope or self.layer_rope[layer]

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and (not self.layer_moe or self.layer_moe[layer])

    @property
    def has_state_layers(self) -> bool:
        """Whether some layer keeps a fixed-size state per request instead of KV per token."""
        return any(self.layer_deltanet)

    @property
    def attention_layers(self) -> list[int]:
        """The layers that keep KV in the paged cache, in order (every layer but a hybrid's state layers)."""
        return [i for i in range(self.num_layers) if not (self.layer_deltanet and self.layer_deltanet[i])
                and not (self.layer_kv_source and self.layer_kv_source[i] != i)]

    def native_unsupported(self) -> list[str]:
        """What this model has that the native bf16 kernels (fused norms, fused decode, the layer
        plan) do not do; empty: the native fast path may run."""
        reasons = []
        checks = {
            "gemma norms": self.norm_kind != "rms", f"{self.norm_placement}-norms": self.norm_placement != "pre",
            "q/k norm": self.qk_norm != "none", f"{self.hidden_act} MLP": self.hidden_act != "silu",
            "partial rotary": self.partial_rotary_factor != 1.0,
            "local rotary": self.rope_theta_local is not None or self.rope_scaling_local is not None,
            "sliding window": any(self.is_sliding(i) for i in range(self.num_layers)),
            "no-rope layers": not all(self.uses_rope(i) for i in range(self.num_layers)),
            "soft-capping": self.attn_logit_softcap is not None or self.final_logit_softcap is not None,
            "multipliers": (self.embedding_multiplier, self.residual_multiplier, self.logits_scaling) != (1.0,) * 3,
            "attention scale": self.attention_scale is not None and self.attention_scale != self.head_dim**-0.5,
            "position-scaled queries": self.query_scale_beta != 0.0,
            "MoE": self.num_experts > 0,
            "state layers": self.has_state_layers,
            "attention sinks": self.attention_sinks,
            "chunked attention": self.chunked_window,
            "attention temperature": self.attn_temperature_scale != 0.0,
            "multi-head latent attention": self.kv_lora_rank > 0,
            "Gemma 4 layers": bool(self.gemma4),
        }
        reasons += [name for name, hit in checks.items() if hit]
        return reasons

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        raw_text = (model_dir / "config.json").read_text()
        raw = json.loads(raw_text)
        model_type = raw.get("model_type")
        if model_type is None and "Llama" in (raw.get("architectures") or ["LlamaForCausalLM"])[0]:
            model_type = "llama"  # very old Llama configs carry no model_type
        outer: dict[str, Any] = {}  # a vision-language checkpoint's own config, around its text model's
        text_only = TEXT_ONLY.get(str(model_type))
        if text_only is not None:
            outer = raw
            raw = {**dict(text_only.text_defaults), **(raw.get("text_config") or {})}
            for key in text_only.ignored_text_keys:
                raw.pop(key, None)
            model_type = raw.get("model_type") or text_only.text_model_type
        spec = family_spec(str(model_type))
        heads = raw["num_attention_heads"]
        num_layers = raw["num_hidden_layers"]
        hidden = raw["hidden_size"]
        head_dim = raw.get("head_dim") or hidden // heads
        fields: dict[str, Any] = dict(
            # all-MoE configs (Qwen3.5-MoE) name no dense intermediate_size: the expert's then
            vocab_size=raw["vocab_size"], hidden_size=hidden,
            intermediate_size=raw.get("intermediate_size") or raw.get("moe_intermediate_size", 0),
            num_layers=num_layers, num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim, rms_norm_eps=raw.get("rms_norm_eps", 1e-6 if spec.norm == "gemma" else 1e-5),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            # a text-only form's head is settled by its checkpoint (`loader.load_model`)
            # untied by default but in Gemma (the hybrids' (1 + w) norms are Gemma's, their head is not)
            tie_word_embeddings=raw.get("tie_word_embeddings", outer.get("tie_word_embeddings",
                                                                         spec.norm == "gemma" and not spec.deltanet)),
            eos_token_ids=_eos_ids(model_dir, outer, raw),
            bos_token_id=raw.get("bos_token_id", outer.get("bos_token_id")),
            text_only_of=outer.get("model_type", ""),
            model_id=f"{model_dir.name}:{hashlib.sha256(raw_text.encode()).hexdigest()[:16]}",
            model_type=spec.model_type, norm_kind=spec.norm, norm_placement=spec.placement, qk_norm=spec.qk_norm,
        )
        if spec.qk_norm == "config_head":
            fields["qk_norm"] = "head" if raw.get("use_qk_norm") else "none"
        elif spec.qk_norm == "l2_config":  # Llama4TextConfig's use_qk_norm is on by default
            fields["qk_norm"] = "l2" if raw.get("use_qk_norm", True) else "none"
        if spec.dense_intermediate_key and raw.get(spec.dense_intermediate_key):
            fields["intermediate_size"] = int(raw[spec.dense_intermediate_key])
        fields["rope_interleaved"] = spec.rope_interleaved
        bias = bool(raw.get("attention_bias", False))
        fields["attention_bias"] = {"none": False, "qkv": True, "config": bias, "config_qkv": bias}[spec.bias]
        fields["o_bias"] = spec.bias == "config" and bias
        fields["mlp_bias"] = spec.mlp_bias and bool(raw.get("mlp_bias", False))
        act = raw.get(spec.activation_key) or raw.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r} for {model_type} (Baton runs {', '.join(ACTIVATIONS)})")
        fields["hidden_act"] = act
        if not spec.gemma4:  # its rotary per layer type is its own (gemma4_fields)
            fields.update(_rope_fields(raw, spec))
        fields.update(_window_fields(raw, spec, num_layers))
        if spec.no_rope_layers:
            fields["layer_rope"] = _rope_layers(raw, num_layers)
        if spec.window == "chunked":
            fields.update(_chunk_fields(raw, fields.get("layer_rope") or [True] * num_layers))
        if spec.softcap:
            fields["attn_logit_softcap"] = raw.get("attn_logit_softcapping")
            fields["final_logit_softcap"] = raw.get("final_logit_softcapping")
        if spec.embed_scale == "sqrt_hidden":
            fields["embedding_multiplier"] = hidden**0.5
            fields["embedding_multiplier_in_dtype"] = True
        elif spec.embed_scale == "embedding_multiplier":
            fields["embedding_multiplier"] = float(raw.get("embedding_multiplier", 1.0))
        if spec.multipliers:
            fields["residual_multiplier"] = float(raw.get("residual_multiplier", 1.0))
            fields["attention_scale"] = float(raw.get("attention_multiplier", head_dim**-0.5))
            fields["logits_scaling"] = float(raw.get("logits_scaling", 1.0))
        if spec.query_pre_attn_scalar:
            fields["attention_scale"] = float(raw.get("query_pre_attn_scalar", head_dim)) ** -0.5
        if spec.router != "none":
            fields.update(_moe_fields(raw, spec, num_layers))
        fields["attention_sinks"] = spec.attention_sinks
        if spec.deltanet:
            fields.update(_deltanet_fields(raw, spec, num_layers))
        if spec.short_conv:
            fields.update(_short_conv_fields(raw, num_layers))
        if spec.mamba2:
            fields.update(_mamba2_fields(raw, num_layers))
        if spec.mtp_layers_key:
            fields["mtp_layers"] = int(raw.get(spec.mtp_layers_key) or 0)
        if spec.gemma4:
            fields.update(gemma4_fields(raw, num_layers))
        if spec.mla:
            fields.update(_mla_fields(raw, fields["rope_scaling"]))
        if spec.query_scale == "llama4":
            fields.update(_llama4_query_scale(raw, fields))
        elif spec.query_scale == "temperature" and raw.get("attn_temperature_tuning", True):
            # Llama4TextConfig's defaults
            fields["attn_temperature_scale"] = float(raw.get("attn_scale", 0.1))
            fields["attn_temperature_floor"] = float(raw.get("floor_scale", 8192))
        return cls(**fields)


def _rope_dict(rope: dict[str, Any] | None, theta: float, where: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from one rope parameter dict; scaling None for the default rotary."""
    rope = dict(rope or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("su", "yarn") and "short_factor" in rope:
        rope_type = "longrope"  # Phi-3's old names (transformers' Phi3Config does the same)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r} in {where} (Baton runs {', '.join(ROPE_TYPES)})")
    theta = float(rope.get("rope_theta", theta))
    rope["rope_type"] = rope_type
    return theta, (None if rope_type == "default" else rope)


def _rope_fields(raw: dict[str, Any], spec: FamilySpec) -> dict[str, Any]:
    # transformers 5 writes rope settings under rope_parameters (per layer type for Gemma 3);
    # 4.x uses rope_theta / rope_scaling (and rope_local_base_freq for Gemma 3's local layers).
    params = raw.get("rope_parameters") or {}
    theta = float(raw.get("rope_theta", spec.rope_theta))
    out: dict[str, Any] = {}
    per_type = "full_attention" in params or "sliding_attention" in params
    global_params = params.get("full_attention", {}) if per_type else params
    if not global_params and raw.get("rope_scaling"):
        global_params = raw["rope_scaling"]
    out["rope_theta"], scaling = _rope_dict(global_params, theta, "rope_parameters")
    partial = float(raw.get("partial_rotary_factor",
                            (global_params or {}).get("partial_rotary_factor", spec.partial_rotary_factor)))
    out["partial_rotary_factor"] = partial
    if scaling is not None:
        # parameters the rope functions read from the top level of the config
        scaling.setdefault("original_max_position_embeddings",
                           raw.get("original_max_position_embeddings", raw.get("max_position_embeddings", 2048)))
    out["rope_scaling"] = scaling
    if spec.local_rope:
        local = params.get("sliding_attention") if per_type else None
        # 4.x configs: Gemma 3 names the local base, OLMo 3's sliding layers use rope_theta unscaled
        local_theta = float(raw.get("rope_local_base_freq", spec.local_rope_theta or theta))
        out["rope_theta_local"], out["rope_scaling_local"] = _rope_dict(local, local_theta, "sliding_attention")
    return out


def _window_fields(raw: dict[str, Any], spec: FamilySpec, num_layers: int) -> dict[str, Any]:
    window = raw.get("sliding_window")
    if spec.window == "none" or window is None:
        return {}
    if "use_sliding_window" in raw and not raw["use_sliding_window"]:
        return {}  # Qwen2/3 and SmolLM3 carry a window that is off
    if spec.window == "all":
        return {"sliding_window": int(window), "layer_sliding": [True] * num_layers}
    types = raw.get("layer_types")
    if types is None:
        if spec.full_every:
            pattern = int(raw.get("sliding_window_pattern", spec.full_every))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        else:  # Qwen2's rule: layers from max_window_layers on use the window
            start = raw.get("max_window_layers", num_layers)
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]
    return {"sliding_window": int(window), "layer_sliding": [t == "sliding_attention" for t in types[:num_layers]]}


def _rope_layers(raw: dict[str, Any], num_layers: int) -> list[bool]:
    # 1 = rotary, 0 = none; the config classes' default (SmolLM3, Llama 4): every
    # `no_rope_layer_interval`-th layer without
    if raw.get("no_rope_layers"):  # Llama 4 ships an empty list for the default
        return [bool(v) for v in raw["no_rope_layers"]]
    interval = int(raw.get("no_rope_layer_interval", 4))
    return [(i + 1) % interval != 0 for i in range(num_layers)]


def _chunk_fields(raw: dict[str, Any], layer_rope: list[bool]) -> dict[str, Any]:
    # Llama4TextConfig: the rotary layers are "chunked_attention" when attention_chunk_size is set
    chunk = raw.get("attention_chunk_size")
    if chunk is None:
        return {}
    types = raw.get("layer_types") or ["chunked_attention" if rope else "full_attention" for rope in layer_rope]
    return {"sliding_window": int(chunk), "chunked_window": True,
            "layer_sliding": [t == "chunked_attention" for t in types[:len(layer_rope)]]}


def _moe_fields(raw: dict[str, Any], spec: FamilySpec, num_layers: int) -> dict[str, Any]:
    experts = raw.get("num_local_experts", raw.get("num_experts", raw.get("n_routed_experts", 0)))
    out: dict[str, Any] = {
        "num_experts": int(experts), "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
        "norm_topk_prob": spec.renormalize_topk == "always" or bool(raw.get("norm_topk_prob", False)),
        "router": spec.router, "num_shared_experts": int(raw.get("n_shared_experts") or spec.shared_experts),
        "expert_form": spec.expert_form,
    }
    if spec.expert_form == "gpt_oss":
        out.update(expert_form="gpt_oss", swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
                   swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)))
    if spec.router == "sigmoid_grouped":
        out.update(n_group=int(raw.get("n_group") or 1), topk_group=int(raw.get("topk_group") or 1),
                   routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)))
    if "decoder_sparse_step" in raw or "mlp_only_layers" in raw:  # Qwen3-MoE: some layers dense
        step = int(raw.get("decoder_sparse_step", 1))
        dense = set(raw.get("mlp_only_layers") or [])
        out["layer_moe"] = [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]
    elif "first_k_dense_replace" in raw:  # GLM-4.5: the first k layers dense
        out["layer_moe"] = [i >= int(raw["first_k_dense_replace"]) for i in range(num_layers)]
    elif "moe_layers" in raw or "interleave_moe_layer_step" in raw:  # Llama 4 (Llama4TextConfig's rule)
        step = int(raw.get("interleave_moe_layer_step") or 1)
        sparse = set(raw["moe_layers"] if raw.get("moe_layers") is not None else range(step - 1, num_layers, step))
        out["layer_moe"] = [i in sparse for i in range(num_layers)]
    return out


def _mla_fields(raw: dict[str, Any], rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    # transformers' DeepseekV3Config / DeepseekV3Attention: the cache holds the latent and the
    # rotary key (one "KV head"); the softmax scale is qk_head_dim ** -0.5, times YaRN's
    # mscale(factor, mscale_all_dim) squared where the rotary is scaled (yarn_apply_mscale)
    latent, rope = int(raw.get("kv_lora_rank", 512)), int(raw.get("qk_rope_head_dim", 64))
    nope = int(raw.get("qk_nope_head_dim", 128))
    scale = (nope + rope) ** -0.5
    mscale_all_dim = (rope_scaling or {}).get("mscale_all_dim")
    factor = float((rope_scaling or {}).get("factor") or 1.0)
    if mscale_all_dim and factor > 1:
        mscale = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return {"kv_lora_rank": latent, "q_lora_rank": int(raw.get("q_lora_rank") or 0), "qk_nope_head_dim": nope,
            "qk_rope_head_dim": rope, "v_head_dim": int(raw.get("v_head_dim", 128)),
            "num_kv_heads": 1, "head_dim": latent + rope, "attention_scale": scale,
            # DeepSeek's rotary pairs (2i, 2i + 1) unless the config says not (the loader reorders)
            "rope_interleaved": bool(raw.get("rope_interleave", True))}


def _short_conv_fields(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    # transformers' Lfm2Config / Lfm2MLP: without `layer_types`, the layers in `full_attn_idxs`
    # (all, when absent) are attention, the rest short convs; the MLP's width is derived from
    # `block_ff_dim` (older configs) or `intermediate_size` when `block_auto_adjust_ff_dim`
    types = raw.get("layer_types")
    if types is None:
        full = raw.get("full_attn_idxs")
        full = set(range(num_layers) if full is None else full)
        types = ["full_attention" if i in full else "conv" for i in range(num_layers)]
    unknown = sorted(set(types) - {"full_attention", "conv"})
    if unknown:
        raise ValueError(f"unsupported layer types {unknown} in lfm2 (Baton runs full_attention, conv)")
    intermediate = int(raw.get("block_ff_dim", raw.get("intermediate_size", 12288)))
    if raw.get("block_auto_adjust_ff_dim", True):
        intermediate = int(2 * intermediate / 3)
        multiplier = raw.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = int(raw.get("block_multiple_of", 256))
            intermediate = multiple * ((int(multiplier * intermediate) + multiple - 1) // multiple)
    # the state layers ride in the Gated DeltaNet's fields (`layer_deltanet`: which layers keep a
    # state; `deltanet`: the sizes, `layout` naming the kind: baton.model.short_conv.state_dims)
    return {"layer_deltanet": [t == "conv" for t in types[:num_layers]],
            "deltanet": dict(hidden_size=int(raw["hidden_size"]), conv_kernel=int(raw.get("conv_L_cache", 3)),
                             bias=bool(raw.get("conv_bias", False)), layout="short_conv"),
            "intermediate_size": intermediate, "rms_norm_eps": float(raw.get("norm_eps", 1e-5)),
            "tie_word_embeddings": bool(raw.get("tie_word_embeddings", raw.get("tie_embedding", True)))}


def _mamba2_fields(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    # transformers' GraniteMoeHybridConfig: `layer_types` (or the older `layers_block_type`) with
    # its legacy names ("mamba", "attention"), every layer Mamba-2 when absent; the defaults are the
    # config class's
    types = raw.get("layer_types") or raw.get("layers_block_type") or ["linear_attention"] * num_layers
    types = [{"mamba": "linear_attention", "attention": "full_attention"}.get(t, t) for t in types]
    unknown = sorted(set(types) - {"full_attention", "linear_attention"})
    if unknown:
        raise ValueError(f"unsupported layer types {unknown} in granitemoehybrid (Baton runs mamba, attention)")
    hidden, heads = int(raw["hidden_size"]), int(raw.get("mamba_n_heads", 128))
    head_dim = raw.get("mamba_d_head", "auto")
    head_dim = int(raw.get("mamba_expand", 2)) * hidden // heads if head_dim == "auto" else int(head_dim)
    # transformers 5 writes the infinite limit as {"__float__": "Infinity"} (JSON has no inf)
    dt_min, dt_max = [float(v["__float__"]) if isinstance(v, dict) else float(v)
                      for v in raw.get("time_step_limit") or (0.0, float("inf"))]
    # the state layers ride in the Gated DeltaNet's fields (`layout` names the kind:
    # baton.model.short_conv.state_dims)
    dims = dict(hidden_size=hidden, num_heads=heads, head_dim=head_dim, n_groups=int(raw.get("mamba_n_groups", 1)),
                state_size=int(raw.get("mamba_d_state", 256)), conv_kernel=int(raw.get("mamba_d_conv", 4)),
                chunk_size=int(raw.get("mamba_chunk_size", 256)), conv_bias=bool(raw.get("mamba_conv_bias", True)),
                proj_bias=bool(raw.get("mamba_proj_bias", False)), eps=float(raw.get("rms_norm_eps", 1e-6)),
                dt_min=dt_min, dt_max=dt_max, layout="mamba2")
    out: dict[str, Any] = {
        "layer_deltanet": [t == "linear_attention" for t in types[:num_layers]], "deltanet": dims,
        # every layer's dense MLP is the shared MLP (`shared_intermediate_size`); `intermediate_size`
        # sizes the routed experts
        "intermediate_size": int(raw.get("shared_intermediate_size", 1024)),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "attention_scale": float(raw.get("attention_multiplier", 1.0)),
    }
    if raw.get("position_embedding_type") != "rope":  # the config class's default: no rotary
        out["layer_rope"] = [False] * num_layers
    return out


def _deltanet_fields(raw: dict[str, Any], spec: FamilySpec, num_layers: int) -> dict[str, Any]:
    # transformers' Qwen3NextConfig / Qwen3_5TextConfig: every `full_attention_interval`-th layer is
    # full attention when config.json names no `layer_types`
    types = raw.get("layer_types")
    if types is None:
        interval = int(raw.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    unknown = sorted({t for t in types} - {"full_attention", "linear_attention"})
    if unknown:
        raise ValueError(f"unsupported layer types {unknown} in {spec.model_type} (Baton runs full_attention, "
                         "linear_attention)")
    # the defaults: the config classes' (Qwen3-Next-80B-A3B's sizes)
    dims = dict(num_k_heads=int(raw.get("linear_num_key_heads", 16)),
                num_v_heads=int(raw.get("linear_num_value_heads", 32)),
                head_k_dim=int(raw.get("linear_key_head_dim", 128)),
                head_v_dim=int(raw.get("linear_value_head_dim", 128)),
                conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)), layout=spec.deltanet)
    out: dict[str, Any] = {"layer_deltanet": [t == "linear_attention" for t in types[:num_layers]], "deltanet": dims}
    if raw.get("shared_expert_intermediate_size"):
        out["shared_expert_intermediate_size"] = int(raw["shared_expert_intermediate_size"])
    return out


def _llama4_query_scale(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    beta = params.get("llama_4_scaling_beta")
    if not beta:
        return {}
    period = params.get("original_max_position_embeddings") or (fields["rope_scaling"] or {}).get(
        "original_max_position_embeddings", fields["max_position_embeddings"])
    return {"query_scale_beta": float(beta), "query_scale_period": int(period)}


def _eos_ids(model_dir: Path, *configs: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    sources = [config.get("eos_token_id") for config in configs]
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids
