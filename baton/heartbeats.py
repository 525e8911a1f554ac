"""Heartbeats: who is alive, found without scanning the key space.

Each process refreshes `baton:heartbeat:<kind>:<id>` (a msgpack map with a TTL: the authority on
liveness) and records the key in the sorted set `baton:heartbeats`, scored by when it expires. A
reader takes the keys whose score is recent from the set and MGETs them: a few round trips however
many KV blocks the store holds, where `SCAN baton:heartbeat:*` walked every key of the database
(the KV store puts thousands there) twice a second from every worker and gateway.

The set is an index only: an expired key reads as None and is skipped, so clock skew between hosts
can only make a reader look at a dead key, never miss a live one (the window below is generous).
"""

from __future__ import annotations

import time
from typing import Any

import msgpack

from baton.protocol import heartbeat_key

REGISTRY = "baton:heartbeats"
# Index entries are read this long after their key's expiry (tolerates clock skew between hosts)
# and removed after PRUNE_AFTER_S.
SKEW_S = 30.0
PRUNE_AFTER_S = 300.0


def queue_beat(pipe: Any, kind: str, worker_id: str, payload: dict[str, Any], ttl_s: float) -> None:
    """Add the commands that publish one heartbeat to a Redis pipeline (sync or async)."""
    key = heartbeat_key(kind, worker_id)
    now = time.time()
    pipe.set(key, msgpack.packb(payload, use_bin_type=True), px=max(1, int(ttl_s * 1000)))
    pipe.zadd(REGISTRY, {key: now + ttl_s})
    pipe.zremrangebyscore(REGISTRY, "-inf", now - PRUNE_AFTER_S)


def queue_withdraw(pipe: Any, kind: str, worker_id: str) -> None:
    key = heartbeat_key(kind, worker_id)
    pipe.delete(key)
    pipe.zrem(REGISTRY, key)


def _of_kind(indexed: list[bytes | str], kind: str | None) -> list[bytes]:
    # the index's keys (bytes or str, by client) that belong to `kind` (or to any kind), as bytes
    prefix = heartbeat_key(kind, "").encode() if kind else b"baton:heartbeat:"
    keys = [k if isinstance(k, bytes) else k.encode() for k in indexed]
    return [k for k in keys if k.startswith(prefix)]


def _present(keys: list[bytes], values: list[Any]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in zip(keys, values) if v is not None]  # None: expired since the index read


async def live(redis: Any, kind: str | None = None) -> list[tuple[bytes, bytes]]:
    """(key, raw value) of every live heartbeat, optionally of one kind (async Redis client)."""
    keys = _of_kind(await redis.zrangebyscore(REGISTRY, time.time() - SKEW_S, "+inf"), kind)
    return _present(keys, await redis.mget(keys)) if keys else []


def live_sync(redis: Any, kind: str | None = None) -> list[tuple[bytes, bytes]]:
    """`live` for a synchronous client (baton serve's readiness checks, tests)."""
    keys = _of_kind(redis.zrangebyscore(REGISTRY, time.time() - SKEW_S, "+inf"), kind)
    return _present(keys, redis.mget(keys)) if keys else []


def worker_id_of(key: bytes | str) -> str:
    name = key.decode() if isinstance(key, bytes) else key
    return name.split(":", 3)[-1]
