"""The decode worker's token output, written off the step's critical path.

One task owns the writes: the loop hands it each step's `Publication` and goes on to the next step
at once, so the Redis round trip overlaps the next forward pass instead of following it. Each
publication is one pipeline: one XADD per gateway carrying a `TokenBatch` of that step's events,
then the acks (and partial-block deletes) of the requests that finished in it, so a handoff is
acked only after its last tokens are published. Publications go out in step order. A failed write
is retried, same content, with backoff (the gateway drops duplicate tokens by index): a step's
tokens are never lost to one failed `execute()`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field

from redis.asyncio import Redis

from baton import protocol
from baton.worker_runtime import REDIS_ERRORS
from kvstore.redis_backend import partial_key

logger = logging.getLogger("baton.publisher")


@dataclass
class Publication:
    events: dict[str, list[protocol.TokenEvent]] = field(default_factory=dict)  # by gateway id
    acks: list[bytes] = field(default_factory=list)  # handoff messages of finished requests
    finished_ids: list[str] = field(default_factory=list)  # their partial blocks are deleted

    def add(self, gateway_id: str, event: protocol.TokenEvent) -> None:
        self.events.setdefault(gateway_id, []).append(event)

    def __bool__(self) -> bool:
        return bool(self.events or self.acks)


class EventPublisher:
    def __init__(self, redis: Redis, stream: str, group: str) -> None:
        self.redis = redis
        self.stream = stream
        self.group = group
        self.queue: deque[Publication] = deque()
        self.wakeup = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        self.num_retries = 0

    def submit(self, publication: Publication) -> None:
        if not publication:
            return
        self.queue.append(publication)
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
            except REDIS_ERRORS as exc:
                self.num_retries += 1
                logger.warning("publishing tokens failed (%s); retrying in %.2fs (%d steps queued)",
                               exc, backoff, len(self.queue))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.05
            self.queue.popleft()

    async def _write(self, publication: Publication) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for gateway_id, events in publication.events.items():
            pipe.xadd(protocol.token_stream(gateway_id),
                      {protocol.PAYLOAD_FIELD: protocol.encode_token_batch(events)},
                      maxlen=protocol.STREAM_MAXLEN, approximate=True)
        if publication.acks:
            pipe.xack(self.stream, self.group, *publication.acks)
        for request_id in publication.finished_ids:
            pipe.delete(partial_key(request_id))
        await pipe.execute()
