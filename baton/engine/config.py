"""Model configuration read from a Hugging Face `config.json`."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    # Identifies the weights in KV block hashes: the same tokens under another model are other KV.
    model_id: str = ""

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        raw_text = (model_dir / "config.json").read_text()
        raw = json.loads(raw_text)
        arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if raw.get("model_type", "llama") not in ("llama", "mistral", "qwen2") and "Llama" not in arch:
            raise ValueError(f"unsupported architecture {arch} (Baton runs Llama-architecture models)")
        # transformers 5 writes rope settings under rope_parameters; 4.x uses rope_theta/rope_scaling.
        rope = raw.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_scaling = raw.get("rope_scaling")
        if rope and rope.get("rope_type", "default") != "default":
            rope_scaling = rope
        eos = _eos_ids(model_dir, raw)
        heads = raw["num_attention_heads"]
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", raw.get("model_type") == "qwen2"),
            mlp_bias=raw.get("mlp_bias", False),
            eos_token_ids=eos,
            bos_token_id=raw.get("bos_token_id"),
            model_id=f"{model_dir.name}:{hashlib.sha256(raw_text.encode()).hexdigest()[:16]}",
        )


def _eos_ids(model_dir: Path, raw: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    sources = [raw.get("eos_token_id")]
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids
