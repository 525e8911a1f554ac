"""The model authors' default sampling parameters, from the model's generation_config.json.

vLLM's `--generation-config` rule, followed here: with `auto` (the default) the keys
`temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty` that the model's
generation_config.json sets become the defaults of every generation request, whatever its
`do_sample` says (vLLM's `get_diff_sampling_param` ignores it: an OpenAI request always samples);
with `vllm` the file is not read and the APIs' own neutral defaults apply. A request's own value
always wins, field by field: only the fields it leaves unset take the model's value.

A value a request could not send (top_p 0, a negative temperature, a string) is a start-up error
naming the file, the key and `--generation-config vllm`: serving every request with a silently
different sampling would be worse than refusing to start. Read once per model directory and mode.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.config import Settings

log = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
GENERATION_CONFIG_MODES = ("auto", "vllm")  # vLLM's flag values (a directory path is not supported)
# What a request that sets nothing gets without a model default (OpenAI's and vLLM's defaults).
NEUTRAL: dict[str, float | int] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                   "repetition_penalty": 1.0}


@dataclass(frozen=True)
class SamplingDefaults:
    """The model's defaults; None where its generation_config.json sets none."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1: off (the file's 0 means off too)
    min_p: float | None = None
    repetition_penalty: float | None = None

    def as_dict(self) -> dict[str, float | int]:
        """The defaults the model sets (what /info reports and the start-up line names)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def fill(self, **asked: float | int | None) -> dict[str, float | int]:
        """Every sampling key: the request's value where it set one (not None), else the model's,
        else the neutral one. top_k <= 0 (0 or -1) means off, as -1."""
        unknown = set(asked) - set(NEUTRAL)
        if unknown:
            raise TypeError(f"not a sampling default: {', '.join(sorted(unknown))}")
        out: dict[str, float | int] = {}
        for key, neutral in NEUTRAL.items():
            value = asked.get(key)
            if value is None:
                value = getattr(self, key)
            out[key] = neutral if value is None else value
        if out["top_k"] <= 0:
            out["top_k"] = -1
        return out

    def describe(self) -> str:
        return " ".join(f"{key}={value:g}" for key, value in self.as_dict().items())


def read_generation_config(model_dir: Path) -> SamplingDefaults:
    """The sampling defaults `model_dir`/generation_config.json sets (none when there is no file);
    ValueError naming the problem when it cannot be read or holds a value no request could send."""
    path = Path(model_dir) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return SamplingDefaults()
    hint = f"fix {path}, or pass --generation-config vllm to ignore the model's sampling defaults"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc} ({hint})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object ({hint})")
    values: dict[str, float | int] = {}
    for key in NEUTRAL:
        value = raw.get(key)
        if value is None:  # absent or null: no default (vLLM skips nulls too)
            continue
        problem = _problem(key, value)
        if problem:
            raise ValueError(f"{path}: `{key}` {problem}, got {json.dumps(value)[:60]} ({hint})")
        values[key] = _normalized(key, value)
    return SamplingDefaults(**values)


def _problem(key: str, value: object) -> str | None:
    """Why `value` cannot be `key`'s default (the ranges SamplingParams accepts), or None."""
    if key == "top_k":
        is_int = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not is_int or value < -1:
            return "must be an integer >= -1 (-1 or 0: off)"
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "must be a finite number"
    if key == "temperature" and value < 0:
        return "must be >= 0 (0: greedy)"
    if key == "top_p" and not 0 < value <= 1:
        return "must be in (0, 1]"
    if key == "min_p" and not 0 <= value <= 1:
        return "must be in [0, 1]"
    if key == "repetition_penalty" and value <= 0:
        return "must be > 0"
    return None


def _normalized(key: str, value: float | int) -> float | int:
    if key == "top_k":
        return int(value) if value > 0 else -1
    return float(value)


@functools.lru_cache(maxsize=8)
def load(model_dir: Path, mode: str = "auto") -> SamplingDefaults:
    """The defaults requests get under `--generation-config mode`: none with `vllm`."""
    if mode not in GENERATION_CONFIG_MODES:
        raise ValueError(f"--generation-config must be one of {', '.join(GENERATION_CONFIG_MODES)}, got {mode!r}")
    if mode == "vllm":
        return SamplingDefaults()
    return read_generation_config(model_dir)


def for_settings(settings: Settings) -> SamplingDefaults:
    """The defaults of the gateway these settings run."""
    return load(Path(settings.model_dir), settings.generation_config)


def announce(settings: Settings) -> SamplingDefaults:
    """Load the defaults at start-up (a bad file stops the gateway here, not at its first request)
    and say in one log line which apply."""
    defaults = for_settings(settings)
    if defaults.as_dict():
        log.info("sampling defaults from %s: %s (a request's own values win; --generation-config vllm "
                 "ignores them)", GENERATION_CONFIG_FILE, defaults.describe())
    elif settings.generation_config == "vllm":
        log.info("sampling defaults: the APIs' own (--generation-config vllm: the model's %s is not read)",
                 GENERATION_CONFIG_FILE)
    else:
        log.info("sampling defaults: the APIs' own (the model's %s sets none)", GENERATION_CONFIG_FILE)
    return defaults
