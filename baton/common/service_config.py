"""How `baton serve` hands each child process its whole configuration at once: one service's config
object as JSON in one environment variable, instead of a command line rebuilt flag by flag.

A service started with `BATON_SERVICE_CONFIG` set takes its configuration from it and no flags; one
started without it parses its flags as always (`python -m gateway --port 8080` keeps working). The
JSON never holds a secret (the Redis URL, the API key): those stay in their own variables
(REDIS_URL, BATON_API_KEY), which the services read as they always have.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, TypeVar

SERVICE_CONFIG_ENV = "BATON_SERVICE_CONFIG"

Config = TypeVar("Config")


def config_to_json(config: Any, leave_out: tuple[str, ...], encode: Mapping[str, Any] | None = None) -> str:
    """The init fields of dataclass `config` as a JSON object, but for `leave_out` (secrets, and
    what each process must make anew); `encode`: JSON-ready values for fields that are not."""
    values = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)
              if field.init and field.name not in leave_out}
    values.update(encode or {})
    return json.dumps(values, default=str)  # default=str: a Path is its text


def json_object(text: str, what: str) -> dict[str, Any]:
    """`text` parsed as a JSON object, or a ValueError naming `what` (a setting, a flag) and why."""
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(loaded).__name__}")
    return loaded


def config_from_json(cls: type[Config], text: str, **values: Any) -> Config:
    """A `cls` from `config_to_json`'s text plus `values` (what the JSON leaves out). A key `cls`
    does not have, or one it needs and lacks, is a ValueError naming it, as a misspelt flag is an error."""
    loaded = json_object(text, SERVICE_CONFIG_ENV)
    known = {field.name for field in dataclasses.fields(cls) if field.init}  # type: ignore[arg-type]
    unknown = sorted(set(loaded) - known)
    if unknown:
        raise ValueError(f"{SERVICE_CONFIG_ENV}: unknown setting(s) {', '.join(unknown)}")
    try:
        return cls(**{**loaded, **values})
    except TypeError as exc:  # a setting missing (one of an older or newer Baton)
        raise ValueError(f"{SERVICE_CONFIG_ENV}: {exc}") from None
