"""What transformers' GGUF config reader leaves out, completed from the keys llama.cpp reads.

`AutoConfig.from_pretrained(..., gguf_file=...)` maps a fixed table of metadata keys per architecture;
where the model needs more, the config takes the config class's defaults, which are another model's
numbers. For `qwen3moe` (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B) it reads neither the
experts' width nor whether the top-k routing weights are renormalized: a Qwen3-235B file would get
the 30B's 768-wide experts, and every file `norm_topk_prob=False`, while llama.cpp's graph for the
architecture renormalizes (its `build_moe_ffn(..., norm_w=true)`, as the checkpoints' configs say).
Each completion here is llama.cpp's reading of the same file.

gpt-oss (`gpt-oss`) transformers cannot read at all: its reader of the rope-scaling keys takes each
field's first part (the length of the key's name) for the value and fails on it, so both the config
and the tokenizer raised. `transformers_safe_reader` hides those keys from it, and the completion
reads them (YaRN as the checkpoint's config has it) with the rest transformers' table has no row
for: the head width, the experts' width, the window and its alternation (llama.cpp's swa pattern 2:
even layers slide, as in every released gpt-oss).

Gemma 4 (`gemma4`: ggml-org's and Unsloth's Gemma 4 files, what Ollama runs) transformers reads only in
part: an "E" model's per-layer arrays (`feed_forward_length`, `attention.head_count_kv`) fail its
config class's validation, and where it reads at all it takes the config class's defaults for the
layer pattern, the sliding layers' head width, the MoE block, KV sharing and the per-layer inputs.
The arrays are hidden from its reader too, and the config is rebuilt from what llama.cpp's converter
writes (`conversion/gemma.py`, `Gemma4Model`): per layer its type, head width and KV heads
(`per_layer_config`), the shared layers and their double-wide MLP, K = V where a full layer has no
`attn_v`, the full layers' partial rotary from `rope_freqs` (the converter's 1e30 marks the
unrotated pairs), the MoE block from the expert keys.
"""

from __future__ import annotations

import logging

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from baton.common.gguf_llama_like import LLAMA_LIKE, as_llama, family_config

CONVERSION = 4  # of the model directories made from GGUF files: bumped when a completion changes


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _tensor(reader: Any, name: str) -> Any:
    return next((t for t in reader.tensors if t.name == name), None)


def complete_config(config: Any, reader: Any) -> tuple[Any, dict[str, Any]]:
    """`config` with what its architecture needs beyond transformers' table, and what was set."""
    arch = _field(reader, "general.architecture")
    fixes: dict[str, Any] = {}
    if arch in LLAMA_LIKE:  # read as llama's by transformers: the family's config made from it
        return family_config(config, lambda key: _field(reader, key), arch,
                             lambda name: _tensor(reader, name) is not None)
    if arch == "gemma4":  # per-layer fields: the config class derives them at construction
        fixes = _gemma4(config, reader)
        return type(config).from_dict({**config.to_dict(), **fixes}), fixes
    if arch == "qwen3moe":
        width = _field(reader, f"{arch}.expert_feed_forward_length")
        # llama.cpp's fallback where the key is absent: the dense width split over the active experts
        fixes["moe_intermediate_size"] = int(width) if width else config.intermediate_size // config.num_experts_per_tok
        fixes["norm_topk_prob"] = True
        fixes["mlp_only_layers"] = []  # every layer a MoE (llama.cpp's graph has no dense layer)
        fixes["decoder_sparse_step"] = 1
    elif arch == "gpt-oss":
        fixes.update(_gpt_oss(config, reader))
    for name, value in fixes.items():
        setattr(config, name, value)
    return config, fixes


def _gpt_oss(config: Any, reader: Any) -> dict[str, Any]:
    arch = "gpt-oss"
    fixes: dict[str, Any] = {}
    if (head_dim := _field(reader, f"{arch}.attention.key_length")) is not None:
        fixes["head_dim"] = int(head_dim)
    width = _field(reader, f"{arch}.expert_feed_forward_length") or _field(reader, f"{arch}.feed_forward_length")
    if width:
        fixes["intermediate_size"] = int(width)
    if (window := _field(reader, f"{arch}.attention.sliding_window")) is not None:
        fixes["sliding_window"] = int(window)
    fixes["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(config.num_hidden_layers)]
    rope: dict[str, Any] = {"rope_type": "default",
                            "rope_theta": float(_field(reader, f"{arch}.rope.freq_base") or 150000.0)}
    if _field(reader, f"{arch}.rope.scaling.type") == "yarn":
        # the checkpoint's YaRN: its `truncate: false` (OpenAI's reference rounds no correction bound)
        rope.update(rope_type="yarn", factor=float(_field(reader, f"{arch}.rope.scaling.factor") or 1.0),
                    original_max_position_embeddings=int(
                        _field(reader, f"{arch}.rope.scaling.original_context_length") or 4096),
                    beta_fast=float(_field(reader, f"{arch}.rope.scaling.yarn_beta_fast") or 32.0),
                    beta_slow=float(_field(reader, f"{arch}.rope.scaling.yarn_beta_slow") or 1.0),
                    truncate=False)
    fixes["rope_parameters"] = rope
    return fixes


def _gemma4(config: Any, reader: Any) -> dict[str, Any]:
    arch = "gemma4"
    layers = int(config.num_hidden_layers)

    def per_layer(key: str, default: Any) -> list[Any]:
        value = _field(reader, f"{arch}.{key}")
        value = default if value is None else value
        return list(value) if isinstance(value, list) else [value] * layers

    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern")
    types = (["sliding_attention" if s else "full_attention" for s in pattern] if isinstance(pattern, list)
             else list(config.layer_types))
    full_dim = int(_field(reader, f"{arch}.attention.key_length") or config.head_dim)
    sliding_dim = int(_field(reader, f"{arch}.attention.key_length_swa") or full_dim)
    kv_heads = [int(h) for h in per_layer("attention.head_count_kv", config.num_key_value_heads)]
    first_sliding = types.index("sliding_attention") if "sliding_attention" in types else 0
    shared = int(_field(reader, f"{arch}.attention.shared_kv_layers") or 0)
    widths = [int(w) for w in per_layer("feed_forward_length", config.intermediate_size)]
    width = widths[0]
    # the converter writes 2x the width on the shared layers where use_double_wide_mlp
    double_wide = any(w != width for w in widths)
    if widths != [width if i < layers - shared else (2 if double_wide else 1) * width for i in range(layers)]:
        raise ValueError(f"gemma4 GGUF: feed_forward_length {widths} is neither one width nor the double-wide "
                         f"MLP of the last {shared} (shared) layers")
    fixes: dict[str, Any] = {
        "layer_types": types, "head_dim": sliding_dim, "num_key_value_heads": kv_heads[first_sliding],
        "intermediate_size": width, "use_double_wide_mlp": double_wide, "num_kv_shared_layers": shared,
        "per_layer_config": {str(i): {"head_dim": full_dim if t == "full_attention" else sliding_dim,
                                      "num_key_value_heads": kv_heads[i]}
                             for i, t in enumerate(types) if t == "full_attention" or kv_heads[i] != kv_heads[first_sliding]},
        "hidden_size_per_layer_input": int(_field(reader, f"{arch}.embedding_length_per_layer_input") or 0),
        "tie_word_embeddings": _tensor(reader, "output.weight") is None,
        # K = V on the full layers: the converter writes no attn_v there (Gemma4TextAttention's v_proj is None)
        "attention_k_eq_v": any(t == "full_attention" and _tensor(reader, f"blk.{i}.attn_v.weight") is None
                                for i, t in enumerate(types[:layers - shared])),
        "final_logit_softcapping": _field(reader, f"{arch}.final_logit_softcapping"),
    }
    if (table := _tensor(reader, "per_layer_token_embd.weight")) is not None:  # [per-layer width x layers, vocab]
        fixes["vocab_size_per_layer_input"] = int(table.shape[-1])
    experts = int(_field(reader, f"{arch}.expert_count") or 0)
    fixes.update(enable_moe_block=experts > 0, num_experts=experts or None,
                 top_k_experts=int(_field(reader, f"{arch}.expert_used_count") or 0) or None,
                 moe_intermediate_size=int(_field(reader, f"{arch}.expert_feed_forward_length") or 0) or None)
    # the full layers' "proportional" rotary: rope_freqs holds 1 for each rotated pair, 1e30 for the rest
    factor = 0.25  # the config class's default
    if (freqs := _tensor(reader, "rope_freqs.weight")) is not None:
        factor = 2.0 * int((freqs.data < 1e29).sum()) / full_dim
    fixes["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default",
                              "rope_theta": float(_field(reader, f"{arch}.rope.freq_base_swa") or 10_000.0)},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": factor,
                           "rope_theta": float(_field(reader, f"{arch}.rope.freq_base") or 1_000_000.0)}}
    return fixes


# the fields transformers' GGUF reader misreads, by architecture prefix (see the module's docstring)
MISREAD_FIELDS = ("gpt-oss.rope.scaling.", "gemma4.feed_forward_length", "gemma4.attention.head_count_kv")


# the tokenizer's arrays a config is not read from (transformers counts the tokens for vocab_size)
TOKENIZER_ARRAYS = ("tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


@contextmanager
def transformers_safe_reader(reader: Any, config_only: bool = False) -> Iterator[None]:
    """While transformers reads a GGUF's config (`config_only`) or its tokenizer: the `gguf.GGUFReader`
    it opens for `reader`'s file is `reader` itself, already parsed (transformers parsed the header
    again for each), holding no field it would misread (`complete_config` reads those from `reader`)
    nor, for the config, the tokenizer's arrays (transformers converts every value of every field:
    seconds for a 262k-token vocabulary's 514k merges)."""
    import copy
    import os

    import gguf

    original = gguf.GGUFReader
    view = copy.copy(reader)
    hidden = MISREAD_FIELDS + (TOKENIZER_ARRAYS if config_only else ())
    view.fields = type(reader.fields)((k, v) for k, v in reader.fields.items() if not k.startswith(hidden))
    arch = _field(reader, "general.architecture")
    if arch in LLAMA_LIKE:  # an architecture transformers does not know, whose keys are llama's
        view.fields = type(reader.fields)(as_llama(view.fields, arch))

    def opened(path: Any, *args: Any, **kwargs: Any) -> Any:
        if os.path.abspath(path) == os.path.abspath(reader.data.filename):
            return view
        return original(path, *args, **kwargs)

    gguf.GGUFReader = opened  # type: ignore[assignment, misc]
    # a Gemma 4 file's layer pattern is a key transformers does not read: it takes its class's default
    # (every 6th layer full), warns that the last layer of a 35-layer E2B is not full and forces it;
    # complete_config sets the file's pattern, so the warning is about a config never used
    gemma4_config = logging.getLogger("transformers.models.gemma4.configuration_gemma4")
    gemma4_config.addFilter(_default_pattern_warning)
    try:
        yield
    finally:
        gguf.GGUFReader = original
        gemma4_config.removeFilter(_default_pattern_warning)


def _default_pattern_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Last layer must use `full_attention`")
