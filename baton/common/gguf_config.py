"""What transformers' GGUF config reader leaves out, completed from the keys llama.cpp reads.

`AutoConfig.from_pretrained(..., gguf_file=...)` maps a fixed table of metadata keys per architecture;
where the model needs more, the config takes the config class's defaults, which are another model's
numbers. For `qwen3moe` (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B) it reads neither the
experts' width nor whether the top-k routing weights are renormalized: a Qwen3-235B file would get
the 30B's 768-wide experts, and every file `norm_topk_prob=False`, while llama.cpp's graph for the
architecture renormalizes (its `build_moe_ffn(..., norm_w=true)`, as the checkpoints' configs say).
Each completion here is llama.cpp's reading of the same file.
"""

from __future__ import annotations

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
    for name, value in fixes.items():
        setattr(config, name, value)
    return fixes
