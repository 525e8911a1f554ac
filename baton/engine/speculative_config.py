"""`SpeculativeConfig`: what `--speculative-config` / `LLM(speculative_config=...)` takes, in vLLM's shape.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "num_speculative_tokens": 4}

    {"method": "mtp", "num_speculative_tokens": 1}

Rules: a JSON object (or a dict, or an already built config); `method` is required: "ngram"
(prompt lookup), "draft_model" (a small model with the target's tokenizer, `model` a directory,
.gguf or Hub id that the caller resolves: baton.common.model_files) or "mtp" (the target
checkpoint's own multi-token-prediction layer; vLLM's older names "deepseek_mtp", "glm4_moe_mtp" and
"qwen3_next_mtp" mean it too); "eagle", "eagle3", "medusa" are refused with a "not yet" error naming
the method; `num_speculative_tokens` (k, 1..16) is required (for "mtp" it defaults to 1, the one
layer the checkpoints carry, as in vLLM); the lookup bounds (ngram only) default to max 4 and min 2 (when only one is given, the
other's default is clamped to it), with 1 <= min <= max. Unknown keys, and keys of the other method,
are refused by name, so a typo is not a silent no-op.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baton.common.service_config import json_object

METHODS = ("ngram", "draft_model", "mtp")
MTP_ALIASES = ("deepseek_mtp", "glm4_moe_mtp", "qwen3_next_mtp")  # vLLM's older names of "mtp"
NOT_YET = ("eagle", "eagle3", "medusa", "mlp_speculator")
KNOWN_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None  # draft_model: the draft's directory (resolved by the caller)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(_method_error(self.method))
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model is required for method \"draft_model\" and only for it")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in "
                             f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    def to_dict(self) -> dict[str, Any]:
        if self.method == "mtp":
            return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "draft_model":
            return {"method": self.method, "model": self.model, "num_speculative_tokens": self.num_speculative_tokens}
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_max": self.prompt_lookup_max, "prompt_lookup_min": self.prompt_lookup_min}


def _method_error(method: Any) -> str:
    if method in NOT_YET:
        return (f"speculative_config.method {method!r} is not yet supported by Baton (\"ngram\", prompt "
                "lookup, \"draft_model\" and \"mtp\" run in this version)")
    return f"speculative_config.method must be \"ngram\", \"draft_model\" or \"mtp\", got {method!r}"


def parse_speculative_config(value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A config from JSON text, a dict, or a config (returned as is); None or "" -> None (off).
    Raises ValueError naming the field that is wrong."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        if not value.strip():
            return None
        value = json_object(value, "speculative_config")
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - KNOWN_KEYS)
    if unknown:
        raise ValueError(f"speculative_config has unknown field(s) {unknown}; known: {sorted(KNOWN_KEYS)}")
    if "method" not in value:
        raise ValueError("speculative_config.method is required (\"ngram\", \"draft_model\" or \"mtp\")")
    method = value["method"]
    if method in MTP_ALIASES:
        method = "mtp"
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(_method_error(method))
    if method == "mtp":
        other = sorted(k for k in value if k not in ("method", "num_speculative_tokens"))
        if other:
            raise ValueError(f"speculative_config {other} are not for method \"mtp\" (it drafts with the "
                             "target checkpoint's own MTP layer)")
        return SpeculativeConfig("mtp", value.get("num_speculative_tokens", 1))
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config.num_speculative_tokens is required")
    if method == "draft_model":
        lookup = sorted(k for k in value if k.startswith("prompt_lookup"))
        if lookup:
            raise ValueError(f"speculative_config {lookup} are for method \"ngram\", not \"draft_model\"")
        model = value.get("model")
        if not isinstance(model, str) or not model.strip():
            raise ValueError("speculative_config.model (the draft model: a directory, .gguf or Hub id) is "
                             "required for method \"draft_model\"")
        return SpeculativeConfig("draft_model", value["num_speculative_tokens"], model=model)
    if "model" in value:
        raise ValueError("speculative_config.model is for method \"draft_model\", not \"ngram\"")
    lookup_max, lookup_min = value.get("prompt_lookup_max"), value.get("prompt_lookup_min")
    if lookup_max is None and lookup_min is None:
        lookup_max, lookup_min = 4, 2
    elif lookup_max is None:
        lookup_max = max(lookup_min, 4) if isinstance(lookup_min, int) else lookup_min
    elif lookup_min is None:
        lookup_min = min(lookup_max, 2) if isinstance(lookup_max, int) else lookup_max
    return SpeculativeConfig("ngram", value["num_speculative_tokens"], lookup_max, lookup_min)


def with_draft_dir(config: SpeculativeConfig | None, resolve: Callable[[str], Path]) -> SpeculativeConfig | None:
    """The config with its draft model's name turned into a directory by `resolve` (the caller's
    baton.common.model_files.resolve_model: the engine resolves no names)."""
    if config is None or config.model is None:
        return config
    return dataclasses.replace(config, model=str(resolve(config.model)))
