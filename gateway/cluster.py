"""What the gateway knows about the cluster, refreshed from heartbeats once a second.

One task: writes this gateway's own heartbeat (so workers can tell when it died), keeps the TTL of
its token stream fresh (so the stream of a dead gateway expires), reads every worker heartbeat,
derives the token budget from the live decode workers' KV capacity and hands it to admission.
It is also the gateway's Redis health probe: while it fails, generation endpoints answer 503.

Its token stream going missing after startup means Redis lost its data (restarted empty, flushed,
or the gateway was cut off past the stream's TTL): the requests in flight can never get their
events, so the router is told to end them all at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import msgpack
import redis.asyncio as aioredis

from baton.common import heartbeats
from baton.common.protocol import create_token_stream, token_stream
from baton.common.urls import redact_url
from gateway.admission import Admission
from gateway.config import Settings
from baton.common.redis_client import REDIS_DOWN, connection_lost
from gateway.router import TokenRouter

log = logging.getLogger(__name__)

# A dead gateway's token stream is deleted this long after its last heartbeat.
TOKEN_STREAM_TTL_S = 60
DOWN_PROBE_INTERVAL_S = 0.2

STATE_LOST = "redis restarted (or was flushed) and lost this request's state; retry it"


class Cluster:
    def __init__(self, client: aioredis.Redis, settings: Settings, admission: Admission,
                 gateway_stats: Callable[[], dict[str, Any]], router: TokenRouter) -> None:
        self._redis = client
        self._settings = settings
        self._admission = admission
        self._gateway_stats = gateway_stats
        self._router = router
        # False until the first tick made the stream: missing at startup is expected, not a loss.
        self._stream_made = False
        self.redis_ok = False
        self.redis_error: str | None = "not connected yet"
        self.workers: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": [], "gateway": []}
        self.started_at = time.time()
        self._stopping = False
        # Each worker's num_tokens_computed at the last read, and when (monotonic) any worker last
        # computed: a request silent for event_timeout while the workers compute is queued, not lost.
        self._computed: dict[str, int] = {}
        self.last_progress: float | None = None

    def stop(self) -> None:
        """Ask the loop to end (see TokenRouter.stop: cancellation alone may be lost in Redis calls)."""
        self._stopping = True

    def mark_down(self, exc: BaseException) -> None:
        """Called by anyone whose Redis call failed: stop admitting until the next good probe."""
        if self.redis_ok:
            log.warning("redis unreachable: %s", exc)
        self.redis_ok = False
        self.redis_error = f"{type(exc).__name__}: {exc}"

    async def run(self) -> None:
        while not self._stopping:
            try:
                await self.tick()
                if not self.redis_ok:
                    log.info("redis reachable at %s", redact_url(self._settings.redis_url))
                self.redis_ok, self.redis_error = True, None
            except asyncio.CancelledError:
                raise
            except REDIS_DOWN as exc:
                if not connection_lost(exc):
                    raise
                self.mark_down(exc)
            # While down, every request is refused: probe again soon, so a failover or restart
            # costs clients the outage itself, not up to a heartbeat interval more.
            interval = self._settings.heartbeat_interval
            await asyncio.sleep(interval if self.redis_ok else min(interval, DOWN_PROBE_INTERVAL_S))

    async def tick(self) -> None:
        s = self._settings
        beat = {"worker_id": s.gateway_id, "kind": "gateway", "time": time.time(),
                "started_at": self.started_at, "model_name": s.model_name, **self._gateway_stats()}
        async with self._redis.pipeline(transaction=False) as pipe:
            heartbeats.queue_beat(pipe, "gateway", s.gateway_id, beat, s.heartbeat_ttl)
            pipe.expire(token_stream(s.gateway_id), TOKEN_STREAM_TTL_S)
            *_, stream_exists = await pipe.execute()
        if not stream_exists:
            if self._stream_made:
                self._stream_lost()
            # Workers write with NOMKSTREAM (a dead gateway's stream must not come back without
            # a TTL), so the gateway makes its own stream: at start, and after a Redis restart.
            await create_token_stream(self._redis, s.gateway_id, TOKEN_STREAM_TTL_S)
            self._stream_made = True
        workers: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": [], "gateway": []}
        for key, value in await heartbeats.live(self._redis):
            parsed = _parse(key, value)
            if parsed is not None:
                workers.setdefault(parsed[0], []).append(parsed[1])
        for group in workers.values():
            group.sort(key=lambda w: str(w.get("worker_id", "")))
        self.workers = workers
        self._note_progress(workers)
        capacities = self.decode_capacities()
        # Our own beat, written above, is among the live ones: at least 1 (more gateways, smaller share).
        self._admission.set_derived_budget(sum(capacities), max(capacities, default=0),
                                           len(workers.get("gateway", [])))

    def _note_progress(self, workers: dict[str, list[dict[str, Any]]]) -> None:
        computed: dict[str, int] = {}
        for w in workers.get("prefill", []) + workers.get("decode", []):
            worker_id, count = str(w.get("worker_id", "")), w.get("num_tokens_computed")
            if not isinstance(count, int):
                continue  # a worker that does not say
            computed[worker_id] = count
            # a step in its thread counts (one chunk of a long prompt can take minutes on a small
            # CPU); a worker first seen sets its baseline: a crash-looping worker is no progress
            if w.get("in_step") is True or count > self._computed.get(worker_id, count):
                self.last_progress = time.monotonic()
        self._computed = computed

    def computed_within(self, seconds: float) -> bool:
        """Whether some worker computed tokens (or was in a step) in the last `seconds`."""
        return self.last_progress is not None and time.monotonic() - self.last_progress <= seconds

    def _stream_lost(self) -> None:
        # Called before the stream is made again, so the router reads the new one from its start.
        ended = self._router.stream_lost(STATE_LOST)
        log.warning("token stream %s vanished (redis restarted or was flushed): ended %d request(s) "
                    "in flight", token_stream(self._settings.gateway_id), ended)

    def decode_capacities(self) -> list[int]:
        """KV capacity of each live decode worker, in tokens (their sum is the token budget)."""
        out = []
        for w in self.workers.get("decode", []):
            if w.get("draining"):  # finishing what it holds, taking nothing new
                continue
            blocks, block_size = w.get("num_kv_blocks_total"), w.get("block_size")
            if isinstance(blocks, int) and isinstance(block_size, int) and blocks > 0 and block_size > 0:
                out.append(blocks * block_size)
        return out


def _parse(key: bytes | str, value: bytes | str | None) -> tuple[str, dict[str, Any]] | None:
    """`baton:heartbeat:<kind>:<id>` + msgpack map -> (kind, map); None for anything malformed."""
    if value is None:  # expired between the index read and MGET
        return None
    name = key.decode() if isinstance(key, bytes) else key
    parts = name.split(":", 3)
    if len(parts) != 4:
        return None
    try:
        data = msgpack.unpackb(value, raw=False)
    except Exception:  # a foreign or corrupt value must not break the probe
        return None
    if not isinstance(data, dict):
        return None
    data.setdefault("worker_id", parts[3])
    return parts[2], data
