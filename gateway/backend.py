"""The seam between a request and the workers (TGI's `Backend` trait): send prefills, send cancels.

Rules of this file:
- `Generation` never builds a transport command: it hands `PrefillRequest`s and `Cancel`s to a
  `Backend`, one batch per round trip (a request's choices go together, and so do the cancels of
  one loop turn: see gateway.services).
- A backend that cannot take a batch raises `BackendUnavailable` with the transport's error as
  `cause`; nothing else is its failure mode to report (callers answer 503 and mark Redis down).
- Events come back through the `TokenRouter` (gateway.router): `RedisBackend`'s are read from this
  gateway's token stream by the router's own task; `InMemoryBackend` delivers them to the router
  directly, so the HTTP layer can be tested without Redis.
- The wire contract (baton.common.protocol) is the same for both: the in-memory backend encodes and
  decodes every message it is given, so a message Redis would refuse fails here too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Protocol

import redis.asyncio as aioredis

from baton.common.protocol import (
    CANCEL_RETENTION_S,
    CANCEL_STREAM,
    PAYLOAD_FIELD,
    PREFILL_STREAM,
    Cancel,
    PrefillRequest,
    TokenEvent,
    decode,
    encode,
)
from baton.common.redis_client import REDIS_FAILURES
from gateway.router import TokenRouter


class BackendUnavailable(Exception):
    """The backend could not take the messages; `cause` is what the transport raised."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class Backend(Protocol):
    async def send_prefill(self, requests: Sequence[PrefillRequest]) -> None:
        """Hand `requests` to the prefill workers, in one round trip."""
        ...

    async def send_cancels(self, cancels: Sequence[Cancel]) -> None:
        """Tell every worker to drop these requests, in one round trip."""
        ...


# KEYS: the cancel stream. ARGV: retention in ms, the payload field, then one payload per cancel.
# Adds them, then trims the cancels older than the retention, measured from the id Redis just gave
# (Redis' clock: a gateway whose clock runs ahead must not trim fresh cancels).
_ADD_CANCELS = """
local id
for i = 3, #ARGV do
  id = redis.call('XADD', KEYS[1], '*', ARGV[2], ARGV[i])
end
local ms = tonumber(string.match(id, '^(%d+)'))
redis.call('XTRIM', KEYS[1], 'MINID', math.max(0, ms - tonumber(ARGV[1])))
return #ARGV - 2
"""


class RedisBackend:
    """The workers' Redis streams: prefills to `{baton}:prefill`, cancels to `{baton}:cancel`.

    Prefill requests are never trimmed (no MAXLEN: one deleted the oldest unread requests of a
    backlog past 10k); the workers trim what they acknowledged. Cancels are a broadcast without a
    consumer group, trimmed by age: a worker's reader blocks on the stream and takes each cancel
    within milliseconds, and a worker that starts reads from the stream's end, so only a reader
    stalled for CANCEL_RETENTION_S could miss one; its loop would have missed its heartbeats (5 s)
    long before, and peers claimed its requests. A missed cancel costs compute, never an answer:
    the gateway drops the tokens of a request it ended.
    """

    def __init__(self, client: aioredis.Redis) -> None:
        self._redis = client

    async def send_prefill(self, requests: Sequence[PrefillRequest]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for request in requests:
            pipe.xadd(PREFILL_STREAM, {PAYLOAD_FIELD: encode(request)})
        try:
            await pipe.execute()
        except REDIS_FAILURES as exc:
            raise BackendUnavailable(exc) from exc

    async def send_cancels(self, cancels: Sequence[Cancel]) -> None:
        if not cancels:
            return
        try:
            await self._redis.eval(_ADD_CANCELS, 1, CANCEL_STREAM, CANCEL_RETENTION_S * 1000, PAYLOAD_FIELD,
                                   *(encode(cancel) for cancel in cancels))
        except REDIS_FAILURES as exc:
            raise BackendUnavailable(exc) from exc


Responder = Callable[[PrefillRequest], Sequence[TokenEvent]]


class InMemoryBackend:
    """A backend for tests: records what was sent; token events reach the router by `push`, or
    by `responder` (events to answer each prefill with, delivered once the send has returned, as
    a worker's would be). Set `down` to an exception to make every send fail with it."""

    def __init__(self, responder: Responder | None = None) -> None:
        self.prefills: list[PrefillRequest] = []
        self.cancels: list[Cancel] = []
        self.responder = responder
        self.down: BaseException | None = None
        self.router: TokenRouter | None = None  # set when the app's services are built
        # (asyncio's primitives bind to the loop that first uses them: this one can be made anywhere)
        self._changed = asyncio.Condition()

    def attach(self, router: TokenRouter) -> None:
        self.router = router

    async def send_prefill(self, requests: Sequence[PrefillRequest]) -> None:
        self._check_up()
        # Through the wire's codec: what could not travel over Redis must not pass here either.
        received = [decode(encode(r), PrefillRequest) for r in requests]
        self.prefills += received
        if self.responder is not None:
            loop = asyncio.get_running_loop()
            for request in received:
                for event in self.responder(request):
                    loop.call_soon(self.push, event)
        await self._notify()

    async def send_cancels(self, cancels: Sequence[Cancel]) -> None:
        self._check_up()
        self.cancels += [decode(encode(c), Cancel) for c in cancels]
        await self._notify()

    def push(self, event: TokenEvent) -> None:
        """Deliver one token event, as the router would after reading it from the stream."""
        assert self.router is not None, "attach() the router first"
        self.router.deliver(decode(encode(event), TokenEvent))

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        """Wait until `predicate()` holds (checked after each send); raises TimeoutError."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(predicate), timeout)

    def _check_up(self) -> None:
        if self.down is not None:
            raise BackendUnavailable(self.down)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
