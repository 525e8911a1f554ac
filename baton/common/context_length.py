"""A model's context length, read from its config.json the way vLLM derives `max_model_len`.

The gateway (its prompt limits) and the engine (its scheduler's limit) both take their default from
here, so the two agree without either loading the model. The text model's config is read from a
vision-language checkpoint (`text_config`). Of the length keys a config may carry the smallest
wins; RoPE scaling that stretches the positions (linear, dynamic, YaRN) multiplies it by its
factor (YaRN from its `original_max_position_embeddings`), while `llama3` and `longrope` configs
already state the stretched length in `max_position_embeddings`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("baton.common.context_length")

# the keys configs use for the longest sequence (vLLM's list, in its order)
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
               "max_sequence_length", "max_seq_length", "seq_len")
_STRETCHING = ("linear", "dynamic", "yarn")


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def context_length_of(config: dict[str, Any]) -> int | None:
    """The context length a parsed config.json declares, or None when it declares none."""
    text = _text_config(config)
    lengths = [text[key] for key in LENGTH_KEYS if isinstance(text.get(key), int) and text[key] > 0]
    if not lengths:
        return None
    length = min(lengths)
    rope = text.get("rope_scaling") or text.get("rope_parameters")
    if isinstance(rope, dict):
        kind = rope.get("rope_type", rope.get("type"))
        factor = rope.get("factor")
        if kind in _STRETCHING and isinstance(factor, (int, float)) and factor > 1:
            if kind == "yarn" and isinstance(rope.get("original_max_position_embeddings"), int):
                length = rope["original_max_position_embeddings"]
            length = int(length * factor)
    return length


def model_context_length(model_dir: str | Path) -> int | None:
    """`context_length_of` the directory's config.json; None when it has none or cannot be read."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        logger.debug("no context length from %s: %s", path, exc)
        return None
    return context_length_of(config) if isinstance(config, dict) else None
