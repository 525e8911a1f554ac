"""One request's life after validation: admission, prefill message, token events, teardown.

Both API families use this, through gateway.choices (one per choice): `admit()` waits for admission
(watching for the client leaving) and `send_all()` sends the prefill requests; `steps()` turns token events into text-bearing steps (deduplicated,
detokenized, stop sequences applied); `close()` always runs (routes call it in `finally`) and
releases everything: the budget reservation, the event queue, and, unless the workers already
finished the request themselves, it broadcasts a Cancel so they stop spending compute on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

from starlette.requests import Request

from baton import tracing
from baton.protocol import (
    PAYLOAD_FIELD,
    PREFILL_STREAM,
    STREAM_MAXLEN,
    Cancel,
    PrefillRequest,
    TokenEvent,
    encode,
)
from baton.finish_reason import FinishReason
from baton.redis_client import REDIS_FAILURES
from baton.sampling_params import SamplingParams
from gateway.admission import Ticket
from gateway.detokenizer import IncrementalDetokenizer, StopMatcher
from gateway.errors import ApiError, unavailable
from gateway.finish import spelled
from gateway.request_ids import client_request_id
from gateway.router import Routed, StreamLost
from gateway.services import Services
from gateway.validation import GenerationSpec

log = logging.getLogger(__name__)


SEED_SPAN = 2**64  # the wire carries seeds in [-2**63, 2**64 - 1] (msgpack's integers)


def sibling_seed(seed: int, sibling: int) -> int:
    """Choice `sibling`'s seed: `seed + sibling`, wrapped as a uint64 adds, so a seed near 2**64
    still travels (msgpack cannot carry 2**64) and stays distinct from its siblings'."""
    derived = seed + sibling
    return derived - SEED_SPAN if derived >= SEED_SPAN else derived


class ClientGone(Exception):
    """The client disconnected before its request was admitted; nothing can be answered."""


class GenerationFailed(Exception):
    """An admitted request ended in error (worker error, lost events, timeout).

    `error` is how to answer it: a 500 `generation` error unless the cause says otherwise (a 503
    when Redis lost the request's state: retrying it is the right thing for the client to do).
    """

    def __init__(self, message: str, error: ApiError | None = None) -> None:
        super().__init__(message)
        self.error = error or ApiError(500, message, kind="generation")


@dataclass
class TokenOut:
    index: int
    id: int
    text: str  # the text this token released (may be "" while a character is incomplete)
    logprob: float | None
    special: bool
    top: list[list[float]] | None = None  # [[token id, logprob], ...] when the request asked for them


@dataclass
class Step:
    """What one token event contributed. `finish`: None, or STOP, LENGTH or STOP_SEQUENCE."""

    tokens: list[TokenOut] = field(default_factory=list)
    finish: FinishReason | None = None
    tail: str = ""  # final text released by a step that carries no token

    @property
    def text(self) -> str:
        """All text this step released."""
        return "".join(t.text for t in self.tokens) + self.tail


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the request body must be fully read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def send_all(gens: list[Generation], request: Request) -> None:
    """Send admitted generations to the prefill stream in one round trip (a request's siblings go
    together: one connection, not one each); raises ApiError (503) if Redis fails."""
    messages = [(gen, gen._prefill_message(request)) for gen in gens]
    messages = [(gen, m) for gen, m in messages if m is not None]
    if not messages:
        return
    svc = gens[0].svc
    pipe = svc.redis.pipeline(transaction=False)
    for _, message in messages:
        pipe.xadd(PREFILL_STREAM, {PAYLOAD_FIELD: encode(message)}, maxlen=STREAM_MAXLEN, approximate=True)
    try:
        await pipe.execute()
    except REDIS_FAILURES as exc:
        svc.cluster.mark_down(exc)
        svc.metrics.reject("redis_unavailable")
        raise unavailable(f"redis is unreachable ({exc}); cannot serve requests",
                          svc.settings.retry_after_s) from None
    for gen, _ in messages:
        gen._on_sent()


class Generation:
    def __init__(self, svc: Services, spec: GenerationSpec, prompt_ids: list[int],
                 max_new_tokens: int, arrival: float, api_status: int, choice: int = 0, sibling: int = 0) -> None:
        self.svc = svc
        self.spec = spec
        self.prompt_ids = prompt_ids
        self.max_new_tokens = max_new_tokens
        self.request_id = uuid.uuid4().hex
        self.choice = choice  # which of the request's generations this is (OpenAI's choice index)
        # Choice i of a seeded request draws with seed + i: reproducible, and unlike its siblings.
        self.seed = None if spec.seed is None else sibling_seed(spec.seed, sibling)
        self.sibling = sibling  # its place among the generations of the same prompt
        self.prompt_logprobs: list[Any] | None = None  # from the first event, when asked for
        self.num_cached_tokens = 0  # prompt tokens the prefill worker found already computed
        self.first_event = asyncio.Event()  # set once the workers answered (or it ended)
        self.arrival = arrival  # time.monotonic() when the HTTP request arrived
        self.tokens: list[TokenOut] = []
        self.finish_reason: FinishReason | None = None  # once it ended normally
        self._api_status = api_status
        self._detok = IncrementalDetokenizer(svc.tokenizer, prompt_ids)
        self._stops = StopMatcher(spec.stop)
        self._ticket: Ticket | None = None
        self._queue: asyncio.Queue[Routed] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._sent = False  # the prefill request reached Redis
        self._worker_finished = False  # a worker reported the end itself: no Cancel needed
        self._failed = False
        self._closed = False
        self._last_token_at = 0.0

    @property
    def text(self) -> str:
        """All text generated so far (cut before the stop sequence, if one matched)."""
        return self._stops.text

    @property
    def total_logprob(self) -> float:
        """The generated tokens' summed logprob: how best_of ranks its candidates."""
        return sum(t.logprob for t in self.tokens if t.logprob is not None)

    @property
    def cost(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens

    # ---- start ----

    async def admit(self, watcher: asyncio.Task[None], cost: int | None = None) -> None:
        """Wait for admission of `cost` tokens (default: this generation's), or for `watcher` (the
        client's disconnect, cancelled by close()) to fire first; raises ApiError (429/503) or
        ClientGone. The generations of one request are admitted as one: the first holds the ticket
        for all (`cost`), the others `attach()`."""
        svc = self.svc
        self._watcher = watcher
        if not svc.cluster.redis_ok:
            svc.metrics.reject("redis_unavailable")
            raise unavailable(f"redis is unreachable ({svc.cluster.redis_error}); cannot serve requests",
                              svc.settings.retry_after_s)
        self._ticket = svc.admission.submit(self.cost if cost is None else cost, self._api_status)
        decision = self._ticket.decision
        waiters: set[asyncio.Future[Any]] = {decision, watcher}
        await asyncio.wait(waiters, timeout=svc.settings.max_queue_wait, return_when=asyncio.FIRST_COMPLETED)
        if watcher.done():
            # Gone while waiting: dropped here, before it costs any worker anything.
            svc.metrics.reject("client_disconnected")
            raise ClientGone()
        if not decision.done():
            svc.metrics.reject("queue_timeout")
            raise unavailable(
                f"request waited {svc.settings.max_queue_wait:g}s for token budget "
                f"(max_queue_wait) without being admitted; the server is saturated, retry later",
                svc.settings.retry_after_s)
        error = decision.result()
        if isinstance(error, ApiError):
            raise error
        self._queue = svc.router.register(self.request_id)

    def attach(self) -> None:
        """Ready a generation admitted under a sibling's ticket (see admit)."""
        self._queue = self.svc.router.register(self.request_id)

    def _prefill_message(self, request: Request) -> PrefillRequest | None:
        """What to send, or None when there is nothing to (closed: a sibling sent late, after the
        response ended, would run unread)."""
        assert self._queue is not None, "admit() first"
        if self._closed:
            return None
        svc = self.svc
        return PrefillRequest(
            request_id=self.request_id, gateway_id=svc.settings.gateway_id,
            prompt_token_ids=self.prompt_ids, sampling=self._sampling(), arrival_time=time.time(),
            client_request_id=client_request_id(request.scope), trace_context=tracing.request_parent())

    def _on_sent(self) -> None:
        self._sent = True
        self.svc.metrics.prompt_tokens.inc(len(self.prompt_ids))
        if self._closed:  # closed while the XADD was in flight: it must not run unread
            self._send_cancel("client disconnected")

    def lost(self, message: str, error: ApiError | None = None) -> None:
        """This generation can never get an event (its send failed): its steps() raise `error`
        (default: a 503, retryable)."""
        if self._queue is not None:
            self._queue.put_nowait(StreamLost(message, error))

    def stop_watching(self) -> None:
        """Streaming responses watch for disconnects themselves; stop reading `receive` here."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    @property
    def client_gone(self) -> asyncio.Task[None] | None:
        return self._watcher

    def _sampling(self) -> SamplingParams:
        s = self.spec
        return SamplingParams(
            max_tokens=self.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            repetition_penalty=s.repetition_penalty, seed=self.seed, stop_token_ids=list(s.stop_token_ids),
            ignore_eos=s.ignore_eos, presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
            min_p=s.min_p, logit_bias=[list(pair) for pair in s.logit_bias], logprobs=s.logprobs,
            prompt_logprobs=s.prompt_logprobs, structured=s.structured,
            min_tokens=min(s.min_tokens, self.max_new_tokens))

    # ---- tokens ----

    async def steps(self) -> AsyncIterator[Step]:
        assert self._queue is not None, "admit() or attach() first"
        timeout = self.svc.settings.event_timeout
        while True:
            try:
                event = await asyncio.wait_for(self._queue.get(), timeout)
            except asyncio.TimeoutError:
                self._fail("timeout", f"no token from the workers for {timeout:g}s (event_timeout)")
            if isinstance(event, StreamLost):
                if event.error is not None:  # its own send failed (gateway.choices)
                    self._fail("send_failed", event.message, event.error)
                self._fail("redis_state_lost", event.message,
                           unavailable(event.message, self.svc.settings.retry_after_s))
            self.first_event.set()
            step = self._apply(event)
            if step is None:
                continue
            yield step
            if step.finish is not None:
                return

    def _apply(self, event: TokenEvent) -> Step | None:
        expected = len(self.tokens)
        if event.index > expected:
            self._fail("stream_gap", f"token stream gap: expected token {expected}, got {event.index}")
        skip = expected - event.index  # tokens we already have (a redelivered event)
        have = [t.id for t in self.tokens[event.index:event.index + min(skip, len(event.token_ids))]]
        if event.token_ids[:len(have)] != have:
            # A worker that took over after another died regenerated these positions and got other
            # tokens (different numerics, e.g. another dtype): continuing would splice two texts.
            at = event.index + next(i for i, (a, b) in enumerate(zip(event.token_ids, have)) if a != b)
            self._fail("resume_mismatch", f"the worker that resumed this request produced different tokens "
                       f"than were already sent (from token {at}); check that all decode workers use the "
                       f"same dtype and device kind")
        ids = event.token_ids[skip:]
        logprobs = event.logprobs[skip:]
        tops = event.top_logprobs[skip:]
        if event.index == 0:
            self.num_cached_tokens = event.num_cached_tokens
            if event.prompt_logprobs and self.prompt_logprobs is None:
                self.prompt_logprobs = event.prompt_logprobs
        if not ids and event.finish_reason is None:
            return None  # a pure duplicate
        self._observe_timing(len(ids))
        step = Step()
        special = self.svc.tokenizer.special_ids
        for i, token_id in enumerate(ids):
            if len(self.tokens) >= self.max_new_tokens:
                step.finish = FinishReason.LENGTH  # more than we asked for: stop here (and cancel)
                break
            # (vLLM's rule: stop strings count from the min_tokens-th token on)
            released, hit = self._stops.push(self._detok.push(token_id),
                                             armed=len(self.tokens) + 1 >= self.spec.min_tokens)
            token = TokenOut(index=len(self.tokens), id=token_id, text=released,
                             logprob=logprobs[i] if i < len(logprobs) else None, special=token_id in special,
                             top=tops[i] if i < len(tops) else None)
            self.tokens.append(token)
            step.tokens.append(token)
            if hit:
                step.finish = FinishReason.STOP_SEQUENCE
                break
        if step.finish is None and event.finish_reason is not None:
            if not event.finish_reason.ended_normally:  # ERROR, CANCELLED
                self._worker_finished = True  # the worker dropped it already
                self._fail(f"worker_{event.finish_reason}",
                           event.error or f"the worker ended the request ({event.finish_reason})")
            self._worker_finished = True
            step.finish = event.finish_reason  # STOP or LENGTH
        elif step.finish is None and len(self.tokens) >= self.max_new_tokens:
            step.finish = FinishReason.LENGTH
        if step.finish in (FinishReason.STOP, FinishReason.LENGTH):
            released, hit = self._stops.push(self._detok.flush())
            tail = released if hit else released + self._stops.flush()
            if hit:
                step.finish = FinishReason.STOP_SEQUENCE
            if step.tokens:
                step.tokens[-1].text += tail
            else:
                step.tail = tail
        if step.finish is not None:
            self.finish_reason = step.finish
            self.svc.metrics.success(spelled(step.finish, "metrics"))
            self.svc.metrics.e2e.observe(time.monotonic() - self.arrival)
        self.svc.metrics.generation_tokens.inc(len(step.tokens))
        return step

    def _observe_timing(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        m = self.svc.metrics
        if not self.tokens:
            m.ttft.observe(now - self.arrival)
            n -= 1
        elif self._last_token_at:
            gap = (now - self._last_token_at) / n  # an event may carry several tokens
            for _ in range(n):
                m.itl.observe(gap)
        self._last_token_at = now

    def _fail(self, reason: str, message: str, error: ApiError | None = None) -> NoReturn:
        self._failed = True
        self.svc.metrics.failure(reason)
        log.warning("request %s failed: %s", self.request_id, message)
        raise GenerationFailed(message, error)

    # ---- end ----

    def abandon(self, reason: str, message: str) -> None:
        """End the request from our side, outside `steps()` (the client stopped reading); the
        following close() tells the workers to drop it."""
        if self._failed or self.finish_reason is not None:
            return
        self._failed = True
        self.svc.metrics.failure(reason)
        log.warning("request %s abandoned: %s", self.request_id, message)

    def close(self) -> None:
        """Release everything the request holds. Idempotent and synchronous (safe in `finally`)."""
        if self._closed:
            return
        self._closed = True
        self.first_event.set()  # nothing more will come: release any sibling waiting on it
        svc = self.svc
        self.stop_watching()
        svc.router.unregister(self.request_id)
        if self._ticket is not None:
            svc.admission.done(self._ticket)
        if self.finish_reason is None and not self._failed and self._sent:
            svc.metrics.failure("client_disconnected")
        if self._sent and not self._worker_finished:
            # Ended by us (client gone, stop sequence, error): tell every worker to drop it.
            reason = "stop sequence" if self.finish_reason is FinishReason.STOP_SEQUENCE else (
                "length" if self.finish_reason is FinishReason.LENGTH else "client disconnected" if not self._failed
                else "gateway gave up")
            self._send_cancel(reason)

    def _send_cancel(self, reason: str) -> None:
        self.svc.cancel(Cancel(request_id=self.request_id, gateway_id=self.svc.settings.gateway_id, reason=reason))
