"""The live dashboard: `GET /dashboard` (one self-contained HTML page) and `GET /dashboard/data`.

The page (gateway/static/dashboard.html: inline CSS and JS, hand-drawn SVG charts, nothing fetched
from outside, so it works on a machine with no internet) polls /dashboard/data once a second.

The data comes from the `Monitor`, one background task of the gateway. Once a second it appends a
point to a ring buffer (the last two minutes): tokens/s, requests/s, rejections/s and preemptions/s
(each over the last 5 s), TTFT and ITL p50/p99 over the last minute (exact percentiles over the
recent samples the metrics keep), requests running and waiting, token budget in use, mean KV usage
of the decode workers, backlog of the work streams. Every two seconds
it samples the backlog of the work streams (XLEN, and from XINFO GROUPS the pending count and the
lag of the consumer group: one pipelined round trip) into the `baton:stream_*` gauges. Everything
else it reads is already in memory (admission state, worker heartbeats refreshed by the cluster
task), so serving the page costs no Redis call at all.

With an API key configured, both endpoints require it (gateway.auth), as the key's header or, from a
browser, the session cookie that the login form sets (gateway.dashboard_login, POST /dashboard/login).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from baton.common.protocol import DECODE_GROUP, DECODE_STREAM, PREFILL_GROUP, PREFILL_STREAM
from baton.common.redis_client import REDIS_FAILURES
from gateway.admission import Admission
from gateway.cluster import Cluster
from gateway.config import Settings
from gateway.dashboard_login import LOGIN_PATH, login
from gateway.metrics import GatewayMetrics, percentiles

log = logging.getLogger(__name__)

PAGE_PATH = Path(__file__).with_name("static") / "dashboard.html"
STREAMS = {"prefill": (PREFILL_STREAM, PREFILL_GROUP), "decode": (DECODE_STREAM, DECODE_GROUP)}
SERIES = ("tokens_per_s", "requests_per_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "running",
          "waiting", "budget_in_use", "budget_total", "rejections_per_s", "preemptions_per_s",
          "kv_usage", "prefill_backlog", "decode_backlog")
HEALTHY_AGE_S = 3.0  # heartbeats come every second; older than this is "stale"
LOST_KEEP_S = 60.0  # a worker whose heartbeat expired is listed as "lost" this long
LAG_SCAN_CAP = 10_000  # where Redis gives no group lag, count undelivered entries up to this many


class Monitor:
    """Samples the gateway's state into a ring buffer for the dashboard (see the module doc)."""

    def __init__(self, settings: Settings, metrics: GatewayMetrics, admission: Admission, cluster: Cluster,
                 client: aioredis.Redis, interval: float = 1.0, stream_interval: float = 2.0,
                 history: int = 120, window_s: float = 60.0, rate_window_s: float = 5.0) -> None:
        self._settings = settings
        self._metrics = metrics
        self._admission = admission
        self._cluster = cluster
        self._redis = client
        self.interval = interval
        self.stream_interval = stream_interval
        self.window_s = window_s
        self.rate_window_s = rate_window_s
        self.points: deque[dict[str, Any]] = deque(maxlen=history)
        # (monotonic time, generated tokens, finished requests, rejections, preemptions) per tick:
        # the rates are over the window these cover.
        self._totals: deque[tuple[float, float, int, int, int]] = deque(
            maxlen=max(2, int(round(rate_window_s / interval)) + 1))
        self._preemptions_seen: dict[str, int] = {}
        self._preemptions_total = 0
        self._last_seen: dict[tuple[str, str], tuple[float, dict[str, Any]]] = {}
        self._last_stream_sample = 0.0
        self._stopping = False
        self._errors = 0

    def stop(self) -> None:
        self._stopping = True

    async def run(self) -> None:
        while not self._stopping:
            try:
                if time.monotonic() - self._last_stream_sample >= self.stream_interval:
                    self._last_stream_sample = time.monotonic()
                    await self.sample_streams()
            except asyncio.CancelledError:
                raise
            except REDIS_FAILURES as exc:
                log.debug("stream sample failed: %s", exc)  # the cluster task reports Redis health
            try:
                self.tick()
            except Exception:  # the dashboard must never take the gateway down
                self._errors += 1
                if self._errors <= 3:
                    log.exception("dashboard monitor tick failed")
            await asyncio.sleep(self.interval)

    # ---- streams ----

    async def sample_streams(self) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            for stream, _group in STREAMS.values():
                pipe.xlen(stream)
                pipe.xinfo_groups(stream)
            results = await pipe.execute(raise_on_error=False)
        for i, (name, (stream, group)) in enumerate(STREAMS.items()):
            length, groups = results[2 * i], results[2 * i + 1]
            if isinstance(length, BaseException):
                raise length
            info = None
            if not isinstance(groups, BaseException):  # no such stream yet: nothing pending
                for g in groups:
                    g = {_text(k): v for k, v in g.items()}
                    if _text(g.get("name")) == group:
                        info = g
            pending = int(info["pending"]) if info is not None else 0
            lag: int | None
            if info is None:
                lag = int(length)  # no group yet: nothing of the stream was delivered
            elif info.get("lag") is not None:
                lag = int(info["lag"])
            else:  # Redis < 7 has no lag, and 7 cannot always tell: count what follows the last delivered id
                last = _text(info.get("last-delivered-id")) or "0-0"
                lag = len(await self._redis.xrange(stream, min="(" + last, max="+", count=LAG_SCAN_CAP))
            self._metrics.set_stream(name, int(length), pending, lag)

    # ---- the ring buffer ----

    def tick(self) -> None:
        now, mono = time.time(), time.monotonic()
        m = self._metrics
        self._remember_workers(now)  # so a worker that dies between two page loads is listed as lost
        decode = self._cluster.workers.get("decode", [])
        for w in decode:  # preemption counts are per worker and restart at 0 with it: sum the increases
            wid, count = str(w.get("worker_id")), _int(w.get("num_preemptions"))
            before = self._preemptions_seen.get(wid)
            if before is not None and count >= before:
                self._preemptions_total += count - before
            self._preemptions_seen[wid] = count
        finished = sum(m.successes_by_reason.values()) + sum(m.failures_by_reason.values())
        rejected = sum(m.rejections_by_reason.values())
        self._totals.append((mono, m.generation_tokens.total, finished, rejected, self._preemptions_total))
        first, last = self._totals[0], self._totals[-1]
        dt = last[0] - first[0]

        def rate(i: int) -> float:  # over the last rate_window_s (fewer seconds right after start)
            return max(0.0, (last[i] - first[i]) / dt) if dt > 0 else 0.0

        since = mono - self.window_s
        ttft = percentiles(m.ttft.recent(since), (0.5, 0.99))
        itl = percentiles(m.itl.recent(since), (0.5, 0.99))
        snap = self._admission.snapshot()
        usages = [u for u in (_usage(w) for w in decode) if u is not None]
        streams = m.streams
        self.points.append({
            "t": round(now, 3),
            "tokens_per_s": rate(1),
            "requests_per_s": rate(2),
            "ttft_p50": ttft[0], "ttft_p99": ttft[1],
            "itl_p50": itl[0], "itl_p99": itl[1],
            "running": snap["requests"]["running"],
            "waiting": snap["requests"]["waiting"],
            "budget_in_use": snap["token_budget"]["in_use"],
            "budget_total": snap["token_budget"]["total"],
            "rejections_per_s": rate(3),
            "preemptions_per_s": rate(4),
            "kv_usage": sum(usages) / len(usages) if usages else None,
            "prefill_backlog": _backlog(streams.get("prefill")),
            "decode_backlog": _backlog(streams.get("decode")),
        })

    def _remember_workers(self, now: float) -> set[tuple[str, str]]:
        """Note every live heartbeat (kind, id); returns those live now."""
        current = set()
        for kind in ("gateway", "prefill", "decode"):
            for w in self._cluster.workers.get(kind, []):
                key = (kind, str(w.get("worker_id")))
                current.add(key)
                beat = w.get("time")
                self._last_seen[key] = (beat if isinstance(beat, (int, float)) else now, w)
        return current

    def workers(self, now: float) -> list[dict[str, Any]]:
        """Every worker and gateway with a heartbeat, plus those whose heartbeat vanished recently."""
        rows = []
        current = self._remember_workers(now)
        for key, (beat, w) in list(self._last_seen.items()):
            age = max(0.0, now - beat)
            if key not in current:
                if age > LOST_KEEP_S:
                    del self._last_seen[key]
                    continue
                status = "lost"
            else:
                status = "ok" if age <= HEALTHY_AGE_S else "stale"
            rows.append(_worker_row(key[0], key[1], age, status, w, self._settings.gateway_id))
        order = {"gateway": 0, "prefill": 1, "decode": 2}
        rows.sort(key=lambda r: (order.get(r["kind"], 3), r["worker_id"]))
        return rows

    def data(self) -> dict[str, Any]:
        now = time.time()
        m = self._metrics
        points = list(self.points)
        snap = self._admission.snapshot()
        last = points[-1] if points else {}
        decode = self._cluster.workers.get("decode", [])
        return {
            "time": now,
            "model": self._settings.model_name,
            "gateway_id": self._settings.gateway_id,
            "interval_s": self.interval,
            "window_s": self.window_s,
            "history_s": (self.points.maxlen or 0) * self.interval,
            "rate_window_s": self.rate_window_s,
            "redis": {"ok": self._cluster.redis_ok, "error": self._cluster.redis_error},
            "now": {
                "running": snap["requests"]["running"],
                "waiting": snap["requests"]["waiting"],
                "budget_in_use": snap["token_budget"]["in_use"],
                "budget_total": snap["token_budget"]["total"],
                "tokens_per_s": last.get("tokens_per_s", 0.0),
                "requests_per_s": last.get("requests_per_s", 0.0),
                "rejections_per_s": last.get("rejections_per_s", 0.0),
                "ttft_p50": last.get("ttft_p50"), "ttft_p99": last.get("ttft_p99"),
                "itl_p50": last.get("itl_p50"), "itl_p99": last.get("itl_p99"),
                "generated_tokens": m.generation_tokens.total,
                "prompt_tokens": m.prompt_tokens.total,
                "preemptions": sum(_int(w.get("num_preemptions")) for w in decode),
                "rejections": sum(m.rejections_by_reason.values()),
                "rejections_by_reason": dict(m.rejections_by_reason),
                "finished_by_reason": dict(m.successes_by_reason),
                "failed_by_reason": dict(m.failures_by_reason),
                "streams": {k: dict(v) for k, v in m.streams.items()},
            },
            "series": {"t": [p["t"] for p in points], **{k: [_round(p.get(k)) for p in points] for k in SERIES}},
            "workers": self.workers(now),
        }


def _worker_row(kind: str, worker_id: str, age: float, status: str, w: dict[str, Any],
                own_gateway: str) -> dict[str, Any]:
    row: dict[str, Any] = {"kind": kind, "worker_id": worker_id, "age_s": round(age, 2), "status": status,
                           "running": _opt_int(w.get("num_requests_running")),
                           "waiting": _opt_int(w.get("num_requests_waiting", w.get("queue_depth")))}
    if kind == "gateway":
        row["self"] = worker_id == own_gateway
    else:
        row.update({"kv_used": _opt_int(w.get("num_kv_blocks_used")),
                    "kv_total": _opt_int(w.get("num_kv_blocks_total")),
                    "kv_usage": _usage(w), "finished": _opt_int(w.get("num_requests_finished"))})
    if kind == "decode":
        row.update({"preemptions": _opt_int(w.get("num_preemptions")),
                    "max_num_seqs": _opt_int(w.get("max_num_seqs")), "policy": w.get("policy")})
    if kind == "prefill":
        row["prefix_hit_tokens"] = _opt_int(w.get("num_prefix_hit_tokens"))
    return row


def _usage(w: dict[str, Any]) -> float | None:
    used, total = w.get("num_kv_blocks_used"), w.get("num_kv_blocks_total")
    if isinstance(used, int) and isinstance(total, int) and total > 0:
        return used / total
    return None


def _backlog(s: dict[str, int | None] | None) -> int | None:
    """Work not finished by the stream's group: not yet delivered + delivered and not acked."""
    if not s or s.get("pending") is None or s.get("lag") is None:
        return None
    return int(s["pending"] or 0) + int(s["lag"] or 0)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _opt_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _round(value: Any) -> Any:
    return round(value, 6) if isinstance(value, float) else value


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value) if value is not None else ""


# ---- routes ----

_page_cache: bytes | None = None


def page() -> bytes:
    global _page_cache
    if _page_cache is None:
        _page_cache = PAGE_PATH.read_bytes()
    return _page_cache


async def dashboard(request: Request) -> Response:
    return HTMLResponse(page(), headers={"Cache-Control": "no-cache"})


async def dashboard_data(request: Request) -> Response:
    monitor: Monitor = request.app.state.monitor
    return JSONResponse(monitor.data(), headers={"Cache-Control": "no-store"})


routes = [
    Route("/dashboard", dashboard, methods=["GET"]),
    Route("/dashboard/data", dashboard_data, methods=["GET"]),
    Route(LOGIN_PATH, login, methods=["POST"]),
]
