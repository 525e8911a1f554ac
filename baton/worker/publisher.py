"""The decode worker's token output, written off the step's critical path.

One task owns the writes: the loop hands it each step's `Effects` and goes on to the next step at
once, so the Redis round trip overlaps the next forward pass instead of following it. Each step's
effects are one pipeline: one XADD per gateway carrying a `TokenBatch` of that step's events, then
the acks (and partial-block deletes) of the requests that finished in it, so a handoff is acked
only after its last tokens are published (on a Redis Cluster: the XADDs, then the acks, then the
deletes, as separate round trips; baton/worker/writer.py). Effects go out in step order. A failed write
is retried, same content, with backoff (the gateway drops duplicate tokens by index): a step's
tokens are never lost to one failed `execute()`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from redis.asyncio import Redis

from baton.worker.core import Effects
from baton.common.redis_client import REDIS_RETRYABLE
from baton.worker.writer import write_effects
from kvstore.redis_backend import RedisBlockStore

logger = logging.getLogger("baton.worker.publisher")


class EventPublisher:
    def __init__(self, redis: Redis, stream: str, group: str, store: RedisBlockStore | None = None) -> None:
        self.redis = redis
        self.store = store
        self.stream = stream
        self.group = group
        self.queue: deque[Effects] = deque()
        self.wakeup = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        self.num_retries = 0

    def submit(self, effects: Effects) -> None:
        if not effects:
            return
        self.queue.append(effects)
        self.idle.clear()
        self.wakeup.set()

    @property
    def backlog(self) -> int:
        return len(self.queue)

    async def flush(self, timeout: float) -> bool:
        """Wait until everything submitted is written (True), or `timeout` seconds (False)."""
        try:
            await asyncio.wait_for(self.idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def run(self) -> None:
        backoff = 0.05
        while True:
            if not self.queue:
                self.idle.set()
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            publication = self.queue[0]
            try:
                await self._write(publication)
            except REDIS_RETRYABLE as exc:
                self.num_retries += 1
                logger.warning("publishing tokens failed (%s); retrying in %.2fs (%d steps queued)",
                               exc, backoff, len(self.queue))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.05
            self.queue.popleft()

    async def _write(self, effects: Effects) -> None:
        await write_effects(self.redis, effects, self.stream, self.group, store=self.store)
