"""A worker's liveness: `GET /health` on its metrics port, judged by whether its loop turns.

A worker whose process is up but whose loop is stuck (a step that never returns, a deadlock, a
Redis call hanging past every timeout) still answers `/metrics` from prometheus' own thread, and
its heartbeat task may even keep beating. So the loop stamps a monotonic time on every turn (idle
turns included: an idle worker blocks at most a fraction of a second in XREADGROUP, and a Redis
outage's backoff sleeps at most 5 s), and `/health` answers 503 once the stamp is older than the
stall timeout, which a liveness probe turns into a restart. A draining worker (SIGTERM) answers
503 too: it takes nothing new, and an orchestrator must not count it as available.

`GET /live` is the same check without the draining part, for a liveness probe: a worker that
drains is doing its job, and must not be killed for it before its drain ends.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, disable_created_metrics, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family, _SilentHandler
from wsgiref.simple_server import WSGIServer, make_server


class LoopWatch:
    """Written by the worker's loop, read by the metrics server's threads (a float and a bool:
    each read and write is atomic under the GIL, no lock needed)."""

    def __init__(self, stall_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_timeout_s = stall_timeout_s
        self._clock = clock
        self.last_turn = clock()
        self.draining = False

    def turn(self) -> None:
        self.last_turn = self._clock()

    def status(self, liveness_only: bool = False) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) for /health (or /live: `liveness_only`, draining is fine)."""
        stalled = self._clock() - self.last_turn
        if stalled > self.stall_timeout_s:
            return 503, {"status": "stuck", "error": f"loop stuck for {stalled:.0f} s "
                                                     f"(stall timeout {self.stall_timeout_s:g} s)"}
        if self.draining and not liveness_only:
            return 503, {"status": "draining", "error": "draining: finishing its requests, taking no new ones"}
        return 200, {"status": "ok", "last_turn_s": round(stalled, 3)}


def health_and_metrics_app(watch: LoopWatch | None, registry: CollectorRegistry) -> Callable[..., Iterable[bytes]]:
    """WSGI: /health and /live from `watch` (200 when there is none), anything else prometheus' page."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO")
        if path not in ("/health", "/live"):
            return metrics(environ, start_response)
        code, body = watch.status(path == "/live") if watch is not None else (200, {"status": "ok"})
        reason = "OK" if code == 200 else "Service Unavailable"
        start_response(f"{code} {reason}", [("Content-Type", "application/json")])
        return [json.dumps(body).encode()]

    return app


def serve_metrics(port: int | None, host: str = "127.0.0.1", watch: LoopWatch | None = None,
                             registry: CollectorRegistry = REGISTRY) -> WSGIServer | None:
    """Start the metrics + health server in a daemon thread (None when no port is given).

    Loopback by default: the page names the model and the load, for this machine's scraper only
    unless the deployment says otherwise (a container's port is published by its own rules)."""
    if not port:
        return None
    # Counters' `_created` series only clutter the page (as the gateway's: see gateway/__main__.py).
    disable_created_metrics()

    class Server(ThreadingWSGIServer):  # its own class: the address family is a class attribute
        pass

    Server.address_family, addr = _get_best_family(host, port)  # IPv6 hosts too, as prometheus'
    server = make_server(addr, port, health_and_metrics_app(watch, registry), Server, handler_class=_SilentHandler)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics-http").start()
    return server
