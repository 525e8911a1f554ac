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
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CONVERSION = 2  # of the model directories made from GGUF files: bumped when a completion changes


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def complete_config(config: Any, reader: Any) -> dict[str, Any]:
    """Set on `config` what its architecture needs beyond transformers' table; returns what was set."""
    arch = _field(reader, "general.architecture")
    fixes: dict[str, Any] = {}
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
    return fixes


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


# the fields transformers' GGUF reader misreads, by architecture prefix (see the module's docstring)
MISREAD_FIELDS = ("gpt-oss.rope.scaling.",)


@contextmanager
def transformers_safe_reader() -> Iterator[None]:
    """While transformers reads a GGUF's config and tokenizer: the `gguf.GGUFReader` it opens holds no
    field it would misread (`complete_config` reads those from an untouched reader)."""
    import gguf

    original = gguf.GGUFReader

    class _Reader(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            for key in [k for k in self.fields if k.startswith(MISREAD_FIELDS)]:
                del self.fields[key]

    gguf.GGUFReader = _Reader
    try:
        yield
    finally:
        gguf.GGUFReader = original
