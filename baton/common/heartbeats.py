"""Heartbeats: who is alive, found without scanning the key space and safe from eviction.

Two keys hold them all: the hash `{baton:heartbeats}:data` (field `baton:heartbeat:<kind>:<id>`,
value a msgpack map) and the sorted set `{baton:heartbeats}` (same member, scored by when that
heartbeat expires). Their common hash tag keeps both on one Redis Cluster slot: the scripts below
touch both. Expiry is judged on the Redis server's clock (`TIME` inside the scripts), so clock skew
between hosts cannot make a live process look dead or a dead one alive. Neither key has a TTL: the
store's `maxmemory` policy (`volatile-lru`) evicts only keys with a TTL, the KV blocks, and never a
heartbeat (issue 11: with per-key TTLs, memory pressure evicted heartbeats and peers claimed the
work of live workers). Entries long expired are pruned by every beat.
"""

from __future__ import annotations

from typing import Any

from baton.common.protocol import heartbeat_key

REGISTRY = "{baton:heartbeats}"
DATA = "{baton:heartbeats}:data"
PRUNE_AFTER_S = 300.0

# KEYS: registry, data. ARGV: member, payload, ttl seconds, prune-after seconds.
_BEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
local stale = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[4]))
if #stale > 0 then
  redis.call('HDEL', KEYS[2], unpack(stale))
  redis.call('ZREM', KEYS[1], unpack(stale))
end
return 1
"""

# KEYS: registry, data. ARGV: member prefix. Returns [member, payload, member, payload, ...].
_LIVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local members = redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')
local out = {}
for _, m in ipairs(members) do
  if string.sub(m, 1, #ARGV[1]) == ARGV[1] then
    local v = redis.call('HGET', KEYS[2], m)
    if v then
      table.insert(out, m)
      table.insert(out, v)
    end
  end
end
return out
"""


def _encode(payload: dict[str, Any]) -> bytes:
    import msgpack

    return msgpack.packb(payload, use_bin_type=True)


def queue_beat(pipe: Any, kind: str, worker_id: str, payload: dict[str, Any], ttl_s: float) -> None:
    """Add the commands that publish one heartbeat to a Redis pipeline (sync or async)."""
    pipe.eval(_BEAT, 2, REGISTRY, DATA, heartbeat_key(kind, worker_id), _encode(payload), ttl_s, PRUNE_AFTER_S)


def queue_withdraw(pipe: Any, kind: str, worker_id: str) -> None:
    key = heartbeat_key(kind, worker_id)
    pipe.hdel(DATA, key)
    pipe.zrem(REGISTRY, key)


def _prefix(kind: str | None) -> str:
    return heartbeat_key(kind, "") if kind else "baton:heartbeat:"


def _pairs(flat: list[Any]) -> list[tuple[bytes, bytes]]:
    keys = [k if isinstance(k, bytes) else k.encode() for k in flat[0::2]]
    return list(zip(keys, flat[1::2]))


async def live(redis: Any, kind: str | None = None) -> list[tuple[bytes, bytes]]:
    """(key, raw value) of every live heartbeat, optionally of one kind (async Redis client)."""
    return _pairs(await redis.eval(_LIVE, 2, REGISTRY, DATA, _prefix(kind)))


def live_sync(redis: Any, kind: str | None = None) -> list[tuple[bytes, bytes]]:
    """`live` for a synchronous client (baton serve's readiness checks, tests)."""
    return _pairs(redis.eval(_LIVE, 2, REGISTRY, DATA, _prefix(kind)))


async def live_ids(redis: Any, kind: str) -> set[str]:
    """Ids of the live processes of one kind."""
    return {worker_id_of(key) for key, _ in await live(redis, kind)}


def worker_id_of(key: bytes | str) -> str:
    name = key.decode() if isinstance(key, bytes) else key
    return name.split(":", 3)[-1]
