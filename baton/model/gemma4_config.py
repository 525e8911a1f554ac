"""Gemma 4's config.json keys read into `ModelConfig` fields (the `gemma4` family spec), as
transformers' Gemma4TextConfig resolves them (transformers/models/gemma4/configuration_gemma4.py).

What Gemma 4 adds to Gemma 3's layout, per layer:
- head dims and KV head counts per layer (`per_layer_config`, as transformers 5 writes it; or, as
  the released configs name it, `global_head_dim` / `num_global_key_value_heads` for every full
  layer, the latter only where `attention_k_eq_v`): `layer_head_dim`, `layer_kv_heads`;
- KV sharing (`num_kv_shared_layers`): the last layers attend the K/V of the last earlier layer
  of their own type and keep no cache of their own: `layer_kv_source`;
- the rotary per layer type: the sliding layers' default one, the full layers' "proportional"
  one (the first `partial_rotary_factor` of each half rotated, the rest left as is);
- the rest in `ModelConfig.gemma4` (K = V on full layers, per-layer inputs, the double-wide MLP
  of shared layers, the MoE block beside the MLP), read by `baton.model.gemma4`.
"""

from __future__ import annotations

from typing import Any

GEMMA4_ROPE_TYPES = ("default", "proportional")
# the config class's defaults (Gemma4TextConfig.__post_init__)
_DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1_000_000.0}}


def layer_types(raw: dict[str, Any], num_layers: int) -> list[str]:
    """Gemma4TextConfig's rule: every 6th layer full when config.json names none; the last always full."""
    types = list(raw.get("layer_types") or
                 ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)])[:num_layers]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"unsupported layer types {unknown} in gemma4 (Baton runs sliding_attention, full_attention)")
    if types:
        types[-1] = "full_attention"  # transformers forces it (with a warning)
    return types


def kv_sources(types: list[str], shared: int) -> list[int]:
    """Per layer, the layer whose K/V it attends: itself, or for the last `shared` layers the last
    unshared layer of its type (Gemma4TextConfig.kv_sharing_modes: the "store" layers)."""
    num_layers = len(types)
    first_shared = num_layers - shared
    if shared <= 0:
        return list(range(num_layers))
    if first_shared <= 0 or set(types[:first_shared]) != set(types):
        raise ValueError("gemma4: the set of layer types producing a cache is different than the set of layer "
                         "types using them (num_kv_shared_layers too large)")
    last = {t: max(i for i in range(first_shared) if types[i] == t) for t in set(types)}
    return [i if i < first_shared else last[types[i]] for i in range(num_layers)]


def _rope(params: dict[str, Any], where: str) -> dict[str, Any]:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in GEMMA4_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r} in gemma4's {where} "
                         f"(Baton runs {', '.join(GEMMA4_ROPE_TYPES)})")
    return {"rope_type": rope_type, "theta": float(params["rope_theta"]),
            "partial_rotary_factor": float(params.get("partial_rotary_factor", 1.0)),
            "factor": float(params.get("factor", 1.0))}


def gemma4_fields(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The `ModelConfig` fields of a gemma4_text config.json (`raw`)."""
    if raw.get("use_bidirectional_attention") == "all":
        raise ValueError("gemma4 with use_bidirectional_attention='all' (a bidirectional encoder) is not "
                         "supported: Baton serves causal decoders")
    if raw.get("attention_bias"):
        raise ValueError("gemma4 with attention_bias is not supported (no released checkpoint has one)")
    types = layer_types(raw, num_layers)
    heads_default = int(raw.get("num_key_value_heads") or raw["num_attention_heads"])
    dim_default = int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"])
    overrides: dict[int, dict[str, Any]] = {}
    if raw.get("per_layer_config") is not None:  # transformers 5's own: overrides by layer index
        overrides = {int(k): dict(v) for k, v in raw["per_layer_config"].items()}
    else:  # Gemma4TextConfig.__post_init__: the released configs' global_* keys, 512 by default
        full: dict[str, Any] = {"head_dim": int(raw.get("global_head_dim", 512))}
        if raw.get("attention_k_eq_v", False) and raw.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = int(raw["num_global_key_value_heads"])
        overrides = {i: full for i, t in enumerate(types) if t == "full_attention"}
    unknown = sorted({k for v in overrides.values() for k in v} - {"head_dim", "num_key_value_heads"})
    if unknown:
        raise ValueError(f"unsupported per_layer_config keys {unknown} in gemma4 (Baton reads head_dim, "
                         "num_key_value_heads)")
    dims = [int(overrides.get(i, {}).get("head_dim", dim_default)) for i in range(num_layers)]
    kv_heads = [int(overrides.get(i, {}).get("num_key_value_heads", heads_default)) for i in range(num_layers)]
    sources = kv_sources(types, int(raw.get("num_kv_shared_layers") or 0))
    for i, src in enumerate(sources):
        if (dims[i], kv_heads[i]) != (dims[src], kv_heads[src]):
            raise ValueError(f"gemma4: layer {i} shares layer {src}'s K/V but not its head shape")
    params = raw.get("rope_parameters") or _DEFAULT_ROPE
    rope = {t: _rope(params.get(t) or _DEFAULT_ROPE[t], t) for t in ("sliding_attention", "full_attention")}
    moe = bool(raw.get("enable_moe_block", False))
    extra = dict(
        k_eq_v=bool(raw.get("attention_k_eq_v", False)),
        # the config class's defaults: per-layer inputs on (0 or null: off)
        per_layer_input=int(raw.get("hidden_size_per_layer_input", 256) or 0),
        per_layer_vocab=int(raw.get("vocab_size_per_layer_input", 262_144) or 0),
        double_wide_mlp=bool(raw.get("use_double_wide_mlp", False)),
        moe=moe, num_experts=int(raw.get("num_experts") or 0) if moe else 0,
        top_k=int(raw.get("top_k_experts") or 0) if moe else 0,
        moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0) if moe else 0,
        rope=rope,
    )
    if extra["per_layer_input"] and extra["per_layer_vocab"] < int(raw["vocab_size"]):
        # transformers indexes the per-layer table with every token id: a larger one would fail mid-step
        raise ValueError(f"gemma4: vocab_size_per_layer_input {extra['per_layer_vocab']} is smaller than vocab_size "
                         f"{raw['vocab_size']}")
    if moe and not (extra["num_experts"] and extra["top_k"] and extra["moe_intermediate_size"]):
        raise ValueError("gemma4's MoE block needs num_experts, top_k_experts and moe_intermediate_size")
    return {
        "sliding_window": int(raw.get("sliding_window", 512)),
        "layer_sliding": [t == "sliding_attention" for t in types],
        "layer_head_dim": dims, "layer_kv_heads": kv_heads, "layer_kv_source": sources,
        # the widest layer's: the uniform form of a block in the store (baton.model.layer_cache)
        "head_dim": max(dims), "num_kv_heads": max(kv_heads),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
        "attention_scale": 1.0,  # Gemma4TextAttention.scaling: q and k are RMS-normed per head
        "final_logit_softcap": raw.get("final_logit_softcapping"),
        "embedding_multiplier": float(raw["hidden_size"]) ** 0.5, "embedding_multiplier_in_dtype": True,
        "rope_theta": rope["full_attention"]["theta"],
        "partial_rotary_factor": rope["full_attention"]["partial_rotary_factor"],
        "rope_theta_local": rope["sliding_attention"]["theta"],
        "gemma4": extra,
    }
