"""Every command-line flag can also come from the environment, as TGI and llama.cpp's server allow:
`--max-queue-wait 5` is `BATON_MAX_QUEUE_WAIT=5`. A flag on the command line wins over its variable;
a variable wins over the built-in default. Booleans take 1/true/yes/on or 0/false/no/off; flags
taking several values take them separated by commas or spaces. A bad value is a usage error that
names the variable (exit status 2, like a bad flag).

A few variables predate this rule and keep working: `REDIS_URL` (the common name for it) and the
ones each parser reads itself (e.g. `BATON_API_KEY`, which stays out of command lines).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

PREFIX = "BATON_"
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def env_name(action: argparse.Action) -> str | None:
    """`--max-queue-wait` -> BATON_MAX_QUEUE_WAIT (None for flags without a long name, and help)."""
    longs = [o for o in action.option_strings if o.startswith("--")]
    if not longs or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return None
    return PREFIX + longs[0][2:].upper().replace("-", "_")


def apply_env(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Make each flag's default its BATON_* variable when that is set (and not empty)."""
    environ = os.environ if environ is None else environ
    for action in parser._actions:
        name = env_name(action)
        raw = environ.get(name, "").strip() if name else ""
        if not name or not raw:
            continue
        try:
            action.default = _convert(action, raw)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            parser.error(f"{name}={raw!r}: {exc}")
        action.required = False
        if action.help and action.help is not argparse.SUPPRESS:
            action.help += f" [set by {name}]"


def _convert(action: argparse.Action, raw: str) -> Any:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        lowered = raw.lower()
        if lowered not in TRUE + FALSE:
            raise ValueError(f"expected one of {', '.join(TRUE + FALSE)}")
        value = lowered in TRUE
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        values = [_one(action, part) for part in raw.replace(",", " ").split()]
        if isinstance(action.nargs, int) and len(values) != action.nargs:
            raise ValueError(f"expected {action.nargs} values, got {len(values)}")
        return values
    return _one(action, raw)


def _one(action: argparse.Action, raw: str) -> Any:
    value = action.type(raw) if callable(action.type) else raw
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"expected one of {', '.join(map(str, action.choices))}")
    return value
