"""An in-memory block store with the Redis backend's read API: for the connector's and the worker
core's unit tests, which then run without a Redis server."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.redis_backend import block_key, partial_key


class InMemoryBlockStore:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.num_gets = 0  # round trips, as the Redis backend would make them

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return [key in self.values for key in keys]

    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        self.num_gets += 1
        return [self.values.get(key) for key in keys]

    def put_block(self, block_hash: str, value: bytes) -> None:
        self.values.setdefault(block_key(block_hash), value)  # SET NX: the first write wins

    def put_partial(self, request_id: str, value: bytes) -> str:
        self.values[partial_key(request_id)] = value
        return partial_key(request_id)
