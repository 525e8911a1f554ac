"""The token stream reader: one task reads this gateway's stream and routes events by request id.

Workers XADD `TokenEvent`s to `baton:tokens:<gateway-id>`; this task XREADs from its last id
(blocking), decodes each entry and puts it on the queue of the request it belongs to. Events for
requests that are gone (finished, cancelled) are dropped. If Redis goes away the reader retries with
backoff and resumes from the last id it saw, so no event still in the stream is skipped.

If the stream itself is lost (Redis restarted empty or was flushed), the cluster task tells this
router (`stream_lost`), which ends every request it routes for: their events are gone for good.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from baton.common.protocol import PAYLOAD_FIELD, MalformedMessage, TokenBatch, TokenEvent, decode, token_stream
from baton.common.redis_client import REDIS_DOWN, connection_lost

log = logging.getLogger(__name__)

_BLOCK_MS = 1000

_BATCH = 512
_YIELD_EVERY = 32  # entries routed between two turns of the event loop
_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 1.0
# Trim what we have read once in a while so the stream does not grow without bound.
_TRIM_EVERY_S = 5.0


@dataclass(frozen=True)
class StreamLost:
    """Put on a request's queue instead of an event when none of its events can ever arrive."""

    message: str
    error: Any = None  # the ApiError to answer with; None: a 503 (the state is gone, retry)


Routed = TokenEvent | StreamLost


class TokenRouter:
    def __init__(self, client: aioredis.Redis, gateway_id: str) -> None:
        self._redis = client
        self.stream = token_stream(gateway_id)
        self._queues: dict[str, asyncio.Queue[Routed]] = {}
        self._last_id = "0-0"
        self.connected = False
        self.malformed = 0
        self._stopping = False

    def register(self, request_id: str) -> asyncio.Queue[Routed]:
        """Must be called before the prefill request is sent, so no event can arrive unrouted."""
        queue: asyncio.Queue[Routed] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    @property
    def active(self) -> int:
        return len(self._queues)

    def stream_lost(self, message: str) -> int:
        """The token stream vanished with everything in it (a Redis restart or flush): end every
        request routed here now, instead of after event_timeout or with a confusing token gap.
        Returns how many were ended; each one's own close() releases what it holds."""
        for queue in self._queues.values():
            queue.put_nowait(StreamLost(message))
        # The recreated stream starts over: ids from the old one mean nothing in it (and would skip
        # its first entries if the Redis host's clock went back).
        self._last_id = "0-0"
        return len(self._queues)

    async def reset_stream(self) -> None:
        """At startup: events left from an earlier process with our id belong to dead requests."""
        await self._redis.delete(self.stream)
        self._last_id = "0-0"

    def stop(self) -> None:
        """Ask the loop to end. Shutdown also cancels the task, but a cancellation that lands inside
        a Redis call can be turned into a Redis error by the client library and lost; the flag is
        what guarantees the loop ends (within one XREAD block)."""
        self._stopping = True

    async def run(self) -> None:
        backoff = _BACKOFF_MIN_S
        loop = asyncio.get_running_loop()
        last_trim = loop.time()
        while not self._stopping:
            try:
                reply: Any = await self._redis.xread({self.stream: self._last_id}, count=_BATCH, block=_BLOCK_MS)
                if not self.connected:
                    log.info("token stream %s: reading", self.stream)
                self.connected = True
                backoff = _BACKOFF_MIN_S
                for _stream, entries in reply or []:
                    for i, (entry_id, fields) in enumerate(entries):
                        self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                        self._route(fields)
                        if i % _YIELD_EVERY == _YIELD_EVERY - 1:
                            # A full read (512 entries of batched events with logprobs) takes
                            # long enough to stall every response: let them run in between.
                            await asyncio.sleep(0)
                if loop.time() - last_trim > _TRIM_EVERY_S:
                    last_trim = loop.time()
                    # Everything older than what we read is done with (approximate: cheap).
                    await self._redis.xtrim(self.stream, minid=self._last_id, approximate=True)
            except asyncio.CancelledError:
                raise
            except REDIS_DOWN as exc:
                if not connection_lost(exc):
                    raise
                if self.connected:
                    log.warning("token stream %s: redis error (%s); retrying", self.stream, exc)
                self.connected = False
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)

    def _route(self, fields: dict[bytes, bytes]) -> None:
        data = fields.get(PAYLOAD_FIELD)
        if data is None:
            self.malformed += 1
            return
        try:
            message = decode(data)
            if not isinstance(message, (TokenEvent, TokenBatch)):
                raise MalformedMessage(f"expected token events, got {type(message).__name__}")
        except MalformedMessage as exc:
            self.malformed += 1
            log.warning("dropping malformed token event: %s", exc)
            return
        for event in message.events if isinstance(message, TokenBatch) else (message,):
            self.deliver(event)

    def deliver(self, event: TokenEvent) -> None:
        """Hand one event to its request (dropped if the request is gone). The stream reader calls
        it for what it reads; gateway.backend.InMemoryBackend for what a test pushes."""
        queue = self._queues.get(event.request_id)
        if queue is not None:
            queue.put_nowait(event)
