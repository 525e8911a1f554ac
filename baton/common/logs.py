"""Logging for every Baton process: `--log-format text|json`, and the client's request id on each
line about a request.

One request crosses three processes (gateway, prefill worker, decode worker). The id a client sent
in `x-request-id` (or the one the gateway made up) travels in the messages, and every log line
about that request carries it, so `grep`/a log store can follow it end to end:

- the gateway handles one request per asyncio task, so `bind_client_id` sets a context variable for
  the task's lifetime;
- a worker handles many requests in one loop, so its log calls name the request explicitly with
  `extra=request_extra(request_id)`; the filter looks up the client's id it `remember`ed when the
  message arrived (a bounded map: a worker never learns when a gateway forgets an id).

JSON lines hold `time`, `level`, `logger`, `message`, and `request_id` / `client_request_id` when
known (plus `exc_info` for a traceback): one object per line, what log shippers expect.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from collections import OrderedDict
from typing import Any

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What a client may send as its request id: printable ASCII without spaces (it is echoed in a
# header and written into logs, so no control characters or newlines), at most this long.
MAX_CLIENT_ID_LEN = 128

_client_id: contextvars.ContextVar[str] = contextvars.ContextVar("baton_client_request_id", default="")


def sanitize_client_id(value: str | None) -> str:
    """The client's id if usable as is, else "" (the caller generates one): never rewritten,
    because a client greps its own logs for exactly what it sent."""
    if not value or len(value) > MAX_CLIENT_ID_LEN:
        return ""
    if not all(33 <= ord(ch) <= 126 for ch in value):
        return ""
    return value


def bind_client_id(client_request_id: str) -> None:
    """Tag every later log line of the current task (and tasks it creates) with this id."""
    _client_id.set(client_request_id)


def bound_client_id() -> str:
    """The client's request id bound to the current task ("" outside a request)."""
    return _client_id.get()


class _ClientIds:
    """internal request id -> client's id, the most recent `capacity` of them."""

    def __init__(self, capacity: int = 50_000) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, str] = OrderedDict()

    def remember(self, request_id: str, client_request_id: str) -> None:
        if not client_request_id:
            return
        self._ids[request_id] = client_request_id
        self._ids.move_to_end(request_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def get(self, request_id: str) -> str:
        return self._ids.get(request_id, "")


CLIENT_IDS = _ClientIds()


def remember(request_id: str, client_request_id: str) -> None:
    """A worker saw a message for `request_id`: its log lines name the client's id from now on."""
    CLIENT_IDS.remember(request_id, client_request_id)


def request_extra(request_id: str) -> dict[str, str]:
    """`logger.info(..., extra=request_extra(rid))`: this line is about that request."""
    return {"request_id": request_id}


class RequestIdFilter(logging.Filter):
    """Give every record `request_id` and `client_request_id` ("" when not about one request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = getattr(record, "request_id", "")
        client = getattr(record, "client_request_id", "") or (CLIENT_IDS.get(rid) if rid else "") or _client_id.get()
        record.request_id, record.client_request_id = rid, client
        return True


class TextFormatter(logging.Formatter):
    """The classic line, with `[request <client id>]` appended when the line is about a request."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        client = getattr(record, "client_request_id", "")
        return f"{line} [request {client}]" if client else line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                    + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in ("request_id", "client_request_id"):
            value = getattr(record, name, "")
            if value:
                out[name] = value
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def formatter(fmt: str) -> logging.Formatter:
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    return JsonFormatter() if fmt == "json" else TextFormatter()


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Configure the root logger once for the process (stderr), replacing earlier handlers."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(fmt))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


PROBE_PATHS = frozenset({"/health", "/ready", "/live", "/metrics", "/ping"})


class ProbeAccessFilter(logging.Filter):
    """Drops the access-log lines of probes and scrapes (`PROBE_PATHS`): `baton serve` polls /ready
    twice a second while the workers load, and Kubernetes and Prometheus poll for ever; a line for
    each buried what the log is for (the workers' progress, the requests). Their counts stay in the
    gateway's own metrics."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args  # uvicorn's: (client, method, path, http version, status)
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in PROBE_PATHS
        return True


def uvicorn_log_config(level: str) -> dict[str, Any]:
    """uvicorn's own loggers (startup, errors, access) through the same handler as ours: their
    records propagate to the root logger instead of uvicorn's default text handlers; probes'
    access lines are dropped (`ProbeAccessFilter`)."""
    names = ("uvicorn", "uvicorn.error", "uvicorn.access")
    loggers: dict[str, Any] = {name: {"handlers": [], "level": level.upper(), "propagate": True} for name in names}
    loggers["uvicorn.access"]["filters"] = ["probes"]
    return {"version": 1, "disable_existing_loggers": False,
            "filters": {"probes": {"()": ProbeAccessFilter}}, "loggers": loggers}
