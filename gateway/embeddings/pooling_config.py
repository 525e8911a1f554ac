"""How this model's embeddings are pooled and whether they are normalized, and its hidden size.

Rules: a flag (`--pooling`, `--normalize` / `--no-normalize`) wins; else the checkpoint's own
sentence-transformers files say it (`modules.json` lists a `sentence_transformers.models.Pooling`
module whose `config.json` (usually `1_Pooling/config.json`) sets one of `pooling_mode_lasttoken`,
`pooling_mode_mean_tokens`, `pooling_mode_cls_token`, and a `...models.Normalize` module means
normalized); else `last` + normalized, what decoder embedding models (Qwen3-Embedding, e5-mistral)
use. A pooling mode Baton does not run (max, weighted mean...) is an error naming it and saying to
pass --pooling (every embedding request answers it, generation is unaffected), never silently
another pooling. Read once per model directory.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baton.common.protocol import POOLING_NAMES

DEFAULT_POOLING = "last"
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolingConfig:
    pooling: str  # one of POOLING_NAMES
    normalize: bool
    hidden_size: int  # the vector's length (OpenAI's `dimensions` may only shorten it)
    source: str  # where `pooling` came from, for the log: "flag", "checkpoint" or "default"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None


def checkpoint_pooling(model_dir: Path, strict: bool = True) -> tuple[str | None, bool | None]:
    """(pooling, normalize) as the checkpoint's sentence-transformers modules say, None where
    they say nothing (no modules.json, or no such module). `strict`: a pooling mode Baton does not
    run is an error (else it is None: a --pooling flag overrides it anyway)."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None, None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file}: expected a list of modules")
    pooling: str | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")) if isinstance(module, dict) else ""
        if kind.endswith(".Normalize"):
            normalize = True
        elif kind.endswith(".Pooling"):
            config = _read_json(model_dir / str(module.get("path", "1_Pooling")) / "config.json")
            chosen = [name for key, name in _MODES.items() if config.get(key)]
            odd = [key for key in _UNSUPPORTED if config.get(key)]
            if (odd or len(chosen) > 1) and strict:
                raise ValueError(f"{model_dir}: the checkpoint pools with {', '.join(odd + chosen)}; Baton "
                                 f"pools with one of {', '.join(POOLING_NAMES)}: pass --pooling to choose")
            pooling = chosen[0] if len(chosen) == 1 and not odd else None
    return pooling, normalize


def hidden_size(model_dir: Path) -> int:
    config = _read_json(model_dir / "config.json")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    size = text.get("hidden_size") or config.get("hidden_size")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"{model_dir}/config.json has no hidden_size")
    return size


@functools.lru_cache(maxsize=8)
def resolve(model_dir: Path, pooling: str | None = None, normalize: bool | None = None) -> PoolingConfig:
    """The flags' choices (None: not given) completed from the checkpoint, then the defaults."""
    if pooling is not None and pooling not in POOLING_NAMES:
        raise ValueError(f"--pooling must be one of {', '.join(POOLING_NAMES)}, got {pooling!r}")
    from_checkpoint, checkpoint_normalize = checkpoint_pooling(Path(model_dir), strict=pooling is None)
    source = "flag" if pooling is not None else "checkpoint" if from_checkpoint is not None else "default"
    chosen = pooling or from_checkpoint or DEFAULT_POOLING
    if normalize is None:
        normalize = checkpoint_normalize if checkpoint_normalize is not None else True
    return PoolingConfig(chosen, normalize, hidden_size(Path(model_dir)), source)
