"""Request bodies -> checked fields for a `GenerationSpec` (gateway.generation_spec), or a clear 4xx ApiError.

Nothing a client sends may reach the tokenizer or a worker unchecked: bodies are size-capped and
must be UTF-8 JSON objects without lone surrogates (the tokenizer would crash on them), and every field
has its type and range checked. Unknown fields are ignored as vLLM ignores them (clients send
extras such as `chat_template_kwargs` to every server), but never silently: each name is logged
once and the response lists them in `x-baton-ignored-fields`; with --strict-api they are a 4xx
naming them. Fields we know but cannot honour are always a 4xx naming them. TGI answers validation
errors with 422, the OpenAI API with 400 (what its clients expect).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Awaitable
from typing import Any, TypeVar
from urllib.parse import quote

from starlette.requests import ClientDisconnect, Request

from baton.common.sampling_params import MAX_CACHE_SALT_CHARS
from gateway.config import Settings
from gateway.errors import ApiError, validation_error
from gateway.loop_gate import LoopGate

log = logging.getLogger(__name__)
T = TypeVar("T")
_timeout = getattr(asyncio, "timeout", None)  # Python 3.11+

MAX_SEED = 2**64 - 1
MIN_SEED = -(2**63)

# Bodies larger than this are parsed in a thread, one at a time (see `_parse_json_object`).
INLINE_PARSE_BYTES = 1 << 20

IGNORED_FIELDS_HEADER = "x-baton-ignored-fields"
# Each unknown field name is logged once per process, not once per request (a client sending an
# extra on every request would flood the log); the set is capped, as any client can invent names.
_MAX_LOGGED_NAMES = 1024
_MAX_HEADER_NAMES = 32
_logged_ignored: set[str] = set()


def note_ignored(names: list[str]) -> None:
    """Log each ignored field name the first time any request sends it."""
    for name in names:
        if name in _logged_ignored or len(_logged_ignored) >= _MAX_LOGGED_NAMES:
            continue
        _logged_ignored.add(name)
        log.warning("ignoring unknown request field %r (logged once; --strict-api rejects unknown fields)",
                    name[:100])


def ignored_fields_header(names: list[str]) -> dict[str, str]:
    """The x-baton-ignored-fields header for these names, or none. Names are client text: they are
    percent-encoded (a header must be ASCII without commas, CR or LF) and cut short."""
    if not names:
        return {}
    shown = [quote(name[:64], safe="._-[]") or '""' for name in names[:_MAX_HEADER_NAMES]]
    if len(names) > _MAX_HEADER_NAMES:
        shown.append(f"...{len(names) - _MAX_HEADER_NAMES}-more")
    return {IGNORED_FIELDS_HEADER: ",".join(shown)}


async def read_json_body(request: Request, settings: Settings, status: int) -> dict[str, Any]:
    """Read the body (JSON content type, at most max_body_bytes, within body_read_timeout) and
    parse it as a JSON object."""
    require_json_content_type(request)
    max_bytes = settings.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request body is {declared} bytes; the limit is {max_bytes}",
                       kind="payload_too_large")
    try:
        raw = await within(settings.body_read_timeout, _read_capped(request, max_bytes))
    except asyncio.TimeoutError:
        # Slowloris: a client trickling its body would hold the connection (and a task) forever.
        # The rest of the body is never read, so the connection cannot be reused: close it.
        raise ApiError(408, f"request body not received within {settings.body_read_timeout:g}s "
                            "(body_read_timeout)", kind="timeout", headers={"Connection": "close"}) from None
    if len(raw) <= INLINE_PARSE_BYTES:  # a few ms at most: cheaper than a thread hop
        return _parse_json_object(raw, status)
    # An agent's body of many MB takes ~4 ms/MB to decode, parse and check, all holding the GIL
    # the event loop needs: in a thread the loop gets its turns between those steps (and during
    # the surrogate walk), and one body at a time keeps several big ones from taking turns ahead of
    # it. json.loads itself never lets go of the GIL, so ~2.5 ms/MB of stall remains (80 ms at 32 MiB).
    async with _one_big_body_at_a_time():
        return await asyncio.to_thread(_parse_json_object, raw, status)


def _parse_json_object(raw: bytes, status: int) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise validation_error(f"request body is not valid UTF-8 (byte {exc.start})", status=status) from None
    if not text.strip():
        raise validation_error("request body is empty; expected a JSON object", status=status)
    try:
        data = json.loads(text)
    except RecursionError:
        raise validation_error("malformed JSON: nested too deeply", status=status) from None
    except ValueError as exc:
        raise validation_error(f"malformed JSON: {exc}", status=status) from None
    if not isinstance(data, dict):
        raise validation_error(f"request body must be a JSON object, got {_type_name(data)}", status=status)
    _reject_lone_surrogates(data, status)
    return data


_one_big_body_at_a_time = LoopGate()  # this event loop's gate (gateway.loop_gate)


def require_json_content_type(request: Request) -> None:
    """415 unless the body is declared JSON (`application/json` or `application/*+json`).

    A web page can make a browser POST `text/plain` (or a form) to any origin without a CORS
    preflight; accepting such bodies would let any site drive a local server (CSRF). JSON makes the
    browser ask first, and this server answers no preflight.
    """
    declared = request.headers.get("content-type", "")
    media = declared.split(";", 1)[0].strip().lower()
    kind, _, subtype = media.partition("/")
    if kind == "application" and (subtype == "json" or subtype.endswith("+json")):
        return
    got = f"got {declared!r}" if declared else "none was sent"
    raise ApiError(415, f"Content-Type must be application/json ({got})", kind="unsupported_media_type")


async def _read_capped(request: Request, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:  # chunked bodies have no Content-Length: count as we read
                raise ApiError(413, f"request body exceeds the limit of {max_bytes} bytes",
                               kind="payload_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise validation_error("client disconnected while sending the body", status=400) from None
    return b"".join(chunks)


async def within(seconds: float, awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result, or asyncio.TimeoutError after `seconds`.

    Runs for every stream event: asyncio.timeout (3.11+) only arms a timer, while wait_for also
    makes a task per call before 3.12, so wait_for serves only where there is no asyncio.timeout.
    """
    if _timeout is None:
        return await asyncio.wait_for(awaitable, seconds)
    async with _timeout(seconds):
        return await awaitable


def _reject_lone_surrogates(data: Any, status: int) -> None:
    """JSON may escape half a surrogate pair ("\\ud800"): valid JSON, but not encodable text."""
    stack = [data]
    while stack:  # iterative: a deep body must not blow the Python stack
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise validation_error("request contains an invalid unicode escape (lone surrogate)",
                                       status=status) from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _same_value(value: Any, allowed: Any) -> bool:
    """Equality that keeps booleans apart from numbers (JSON false is not 0) but 0 == 0.0."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return value is allowed
    if isinstance(value, (int, float)) and isinstance(allowed, (int, float)):
        return value == allowed
    return type(value) is type(allowed) and value == allowed


def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


class Fields:
    """Typed, range-checked access to one JSON object's fields; errors name the field."""

    def __init__(self, data: dict[str, Any], status: int, prefix: str = "") -> None:
        self.data = data
        self.status = status
        self.prefix = prefix

    def fail(self, key: str, message: str) -> ApiError:
        return validation_error(f"`{self.prefix}{key}` {message}", param=self.prefix + key, status=self.status)

    def unknown(self, known: set[str], what: str, strict: bool) -> list[str]:
        """The fields not in `known`: a 4xx naming them when strict, else their prefixed names
        (logged once each) for the caller to ignore and report."""
        unknown = sorted(set(self.data) - known)
        if not unknown:
            return []
        if strict:
            names = ", ".join(f"`{self.prefix}{k}`" for k in unknown[:20])
            raise validation_error(f"unknown field(s) in {what}: {names}", param=self.prefix + unknown[0],
                                   status=self.status)
        ignored = [self.prefix + k for k in unknown]
        note_ignored(ignored)
        return ignored

    def get(self, key: str) -> Any:
        return self.data.get(key)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(key, f"must be a boolean, got {_type_name(value)}")
        return value

    def integer(self, key: str, lo: int | None = None, hi: float | None = None) -> int | None:
        # Every integer is bounded: an absurd one must be a 4xx, not an overflow further down.
        hi = (2**31 - 1) if hi is None else hi
        value = self.data.get(key)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            value = int(value)  # some clients serialize 16 as 16.0
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"must be an integer, got {_type_name(value)}")
        if lo is not None and value < lo:
            raise self.fail(key, f"must be >= {lo}, got {value}")
        if hi is not None and value > hi:
            raise self.fail(key, f"must be <= {hi}, got {value}")
        return value

    def number(self, key: str, *, gt: float | None = None, ge: float | None = None,
              le: float | None = None) -> float | None:
        value = self.data.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(key, f"must be a number, got {_type_name(value)}")
        try:
            value = float(value)
        except OverflowError:  # an integer beyond the float range
            raise self.fail(key, "must be a finite number") from None
        if not math.isfinite(value):
            raise self.fail(key, "must be a finite number")
        if gt is not None and not value > gt:
            raise self.fail(key, f"must be > {gt}, got {value}")
        if ge is not None and not value >= ge:
            raise self.fail(key, f"must be >= {ge}, got {value}")
        if le is not None and not value <= le:
            raise self.fail(key, f"must be <= {le}, got {value}")
        return value

    def string(self, key: str) -> str | None:
        value = self.data.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.fail(key, f"must be a string, got {_type_name(value)}")
        return value

    def cache_salt(self, key: str = "cache_salt") -> str | None:
        """vLLM's `cache_salt`: a non-empty string of bounded length, or absent (no salt)."""
        value = self.string(key)
        if value is not None and not value:
            raise self.fail(key, "must be a non-empty string")
        if value is not None and len(value) > MAX_CACHE_SALT_CHARS:
            raise self.fail(key, f"has {len(value)} characters; at most {MAX_CACHE_SALT_CHARS} are allowed")
        return value

    def unsupported_unless(self, key: str, allowed: tuple[Any, ...]) -> None:
        """A known field we cannot honour: accept only its neutral values, else say so."""
        value = self.data.get(key)
        if value is None or any(_same_value(value, a) for a in allowed):
            return
        raise self.fail(key, f"is not supported by this server (got {json.dumps(value)[:60]})")

    def stop_strings(self, key: str, max_count: int, max_len: int, allow_str: bool) -> list[str]:
        value = self.data.get(key)
        if value is None:
            return []
        if isinstance(value, str) and allow_str:
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            kind = "a string or a list of strings" if allow_str else "a list of strings"
            raise self.fail(key, f"must be {kind}")
        if len(value) > max_count:
            raise self.fail(key, f"has {len(value)} stop sequences; at most {max_count} are allowed")
        for s in value:
            if not s:
                raise self.fail(key, "must not contain an empty string")
            if len(s) > max_len:
                raise self.fail(key, f"contains a stop sequence of {len(s)} characters; at most {max_len}")
        return list(dict.fromkeys(value))  # drop duplicates, keep order

    def token_ids(self, key: str, vocab_size: int, max_count: int) -> list[int]:
        value = self.data.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.fail(key, "must be a list of integers")
        if len(value) > max_count:  # before the per-item checks: their cost grows with the list
            raise self.fail(key, f"has {len(value)} token ids; at most {max_count} are allowed")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise self.fail(key, "must be a list of integers")
        bad = [t for t in value if not 0 <= t < vocab_size]
        if bad:
            raise self.fail(key, f"contains token id {bad[0]} outside [0, {vocab_size})")
        return value
