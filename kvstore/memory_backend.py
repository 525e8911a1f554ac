"""An in-memory stand-in for the part of redis-py's asyncio client that the block store and the
workers' writer use (MGET, pipelines of EXISTS, SET [NX] [EX], EXPIRE, DEL, XADD, XACK): the store,
the connector and the worker cores are unit-tested through the real store and the real writer,
without a Redis server. TTLs are recorded, not enforced."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from kvstore.redis_backend import RedisBlockStore


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class InMemoryRedis:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.ttls: dict[str, int] = {}
        self.streams: dict[str, list[tuple[bytes, dict]]] = {}  # name -> [(entry id, fields)]
        self.acked: dict[tuple[str, str], list[bytes]] = {}  # (stream, group) -> acked ids, in order
        self.num_round_trips = 0
        self._ids = itertools.count(1)

    def pipeline(self, transaction: bool = False) -> InMemoryPipeline:
        return InMemoryPipeline(self)

    async def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        self.num_round_trips += 1
        return [self.values.get(key) for key in keys]

    async def aclose(self) -> None:
        pass

    # ---- commands (what a pipeline applies in order) ----

    def exists(self, key: str) -> int:
        return int(key in self.values)

    def set(self, key: str, value: bytes, ex: int | None = None, nx: bool = False) -> bool:
        if nx and key in self.values:
            return False
        self.values[key] = value
        if ex is not None:
            self.ttls[key] = ex
        return True

    def expire(self, key: str, seconds: int) -> bool:
        if key not in self.values:
            return False
        self.ttls[key] = seconds
        return True

    def delete(self, key: str) -> int:
        self.ttls.pop(key, None)
        return int(self.values.pop(key, None) is not None)

    def xadd(self, name: str, fields: dict, maxlen: int | None = None, approximate: bool = True,
             nomkstream: bool = False) -> bytes | None:
        name = _text(name)
        if nomkstream and name not in self.streams:
            return None
        entry_id = f"{next(self._ids)}-0".encode()
        self.streams.setdefault(name, []).append((entry_id, dict(fields)))
        return entry_id

    def xack(self, name: str, group: str, *ids: bytes) -> int:
        self.acked.setdefault((_text(name), _text(group)), []).extend(ids)
        return len(ids)


class InMemoryPipeline:
    """Commands queued, applied in order on `execute()` (one round trip, as Redis would)."""

    def __init__(self, redis: InMemoryRedis) -> None:
        self._redis = redis
        self._queued: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str) -> Any:
        if name not in ("exists", "set", "expire", "delete", "xadd", "xack"):
            raise AttributeError(f"the in-memory Redis has no pipelined {name!r}")

        def queue(*args: Any, **kwargs: Any) -> InMemoryPipeline:
            self._queued.append((name, args, kwargs))
            return self
        return queue

    async def execute(self) -> list[Any]:
        self._redis.num_round_trips += 1
        queued, self._queued = self._queued, []
        return [getattr(self._redis, name)(*args, **kwargs) for name, args, kwargs in queued]


class InMemoryBlockStore(RedisBlockStore):
    """The block store over an in-memory Redis (`.redis`); `.values` are its keys."""

    def __init__(self, redis: InMemoryRedis | None = None) -> None:
        super().__init__(redis or InMemoryRedis())

    @property
    def values(self) -> dict[str, bytes]:
        return self.redis.values
