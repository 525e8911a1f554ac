"""One request's life after validation, as a state machine: admission, prefill, token events, teardown.

Both API families use this, through gateway.choices (one `Generation` per choice). Rules:
- Its life is one `State` at a time (gateway.lifecycle), changed only by `_transition`, which
  refuses any move the table does not allow: CREATED -> QUEUED (waiting for admission) -> ADMITTED
  -> SENDING -> SENT -> STREAMING -> one end (FINISHED, STOPPED, FAILED, DROPPED) -> CLOSED. What
  `close()` owes the workers follows from the state alone: a Cancel where they may still hold work.
- `admit()` waits for admission (watching for the client leaving); `send_all()` hands the prefill
  requests to the backend (gateway.backend: this file builds no Redis command); `steps()` turns
  token events into text-bearing steps (deduplicated, resume-checked, detokenized, stop sequences
  applied); `close()` always runs (routes call it in `finally`, gateway.request_scope in any case)
  and releases everything: the budget reservation, the event queue, and the workers' work.
- The request's siblings (n, best_of: their seeds, late sends, ranking) are gateway.siblings'.
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

from baton.common import tracing
from baton.common.finish_reason import FinishReason
from baton.common.protocol import Cancel, PrefillRequest, TokenEvent
from baton.common.sampling_params import SamplingParams
from gateway.admission import Ticket
from gateway.backend import BackendUnavailable
from gateway.detokenizer import IncrementalDetokenizer, StopMatcher
from gateway.parsers.harmony import keeps_markers
from gateway.errors import ApiError, unavailable
from gateway.finish import spelled
from gateway.lifecycle import AT_WORKERS, State, transition
from gateway.request_ids import client_request_id
from gateway.router import Routed, StreamLost
from gateway.services import Services
from gateway.generation_spec import GenerationSpec

log = logging.getLogger(__name__)


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
    """Send the admitted ones of `gens` to the prefill workers in one round trip (a request's
    siblings go together: one connection, not one each); raises ApiError (503) if the backend is
    unreachable. A generation already closed or ended is not sent: it would run unread."""
    ready = [gen for gen in gens if gen.state is State.ADMITTED]
    if not ready:
        return
    svc = ready[0].svc
    messages = [gen._start_send(request) for gen in ready]
    try:
        await svc.backend.send_prefill(messages)
    except BackendUnavailable as exc:
        for gen in ready:
            gen._send_failed()
        svc.cluster.mark_down(exc.cause)
        svc.metrics.reject("redis_unavailable")
        raise unavailable(f"redis is unreachable ({exc.cause}); cannot serve requests",
                          svc.settings.retry_after_s) from None
    except BaseException:
        for gen in ready:
            gen._send_failed()
        raise
    for gen in ready:
        gen._on_sent()


class Generation:
    def __init__(self, svc: Services, spec: GenerationSpec, prompt_ids: list[int], sampling: SamplingParams,
                 arrival: float, api_status: int, choice: int = 0, sibling: int = 0, pooling: str = "") -> None:
        self.svc = svc
        self.spec = spec
        self.prompt_ids = prompt_ids
        self.sampling = sampling  # what goes on the wire: the request's, with this one's length and seed
        # An embeddings job (gateway.embeddings.job): a prefill alone, admitted in the embeddings
        # lane; its events bring pooled vectors instead of tokens.
        self.pooling = pooling
        self.max_new_tokens = 0 if pooling else sampling.max_tokens
        self.request_id = uuid.uuid4().hex
        self.choice = choice  # which of the request's generations this is (OpenAI's choice index)
        self.sibling = sibling  # its place among the generations of the same prompt
        self.state = State.CREATED
        self.prompt_logprobs: list[Any] | None = None  # from the first event, when asked for
        self.num_cached_tokens = 0  # prompt tokens the prefill worker found already computed
        self.first_event = asyncio.Event()  # set once the workers answered (or it ended): siblings wait on it
        self.arrival = arrival  # time.monotonic() when the HTTP request arrived
        self.tokens: list[TokenOut] = []
        self.finish_reason: FinishReason | None = None  # once it ended normally
        self._api_status = api_status
        calling = spec.api.tool_calling
        # harmony's parsers read its special tokens (gateway.parsers.harmony): kept in the text for them
        keep_special = keeps_markers(spec.api.reasoning_parser, calling.auto_parser() if calling is not None else None)
        self._detok = IncrementalDetokenizer(svc.tokenizer, prompt_ids, skip_special_tokens=not keep_special)
        self._stops = StopMatcher(spec.stop)
        self._ticket: Ticket | None = None
        self._queue: asyncio.Queue[Routed] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._last_token_at = 0.0

    def _transition(self, to: State) -> None:
        """The one place the state changes; refuses a move the table does not allow."""
        self.state = transition(self.state, to, self.request_id)

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
        self._transition(State.QUEUED)
        self._ticket = svc.admission.submit(self.cost if cost is None else cost, self._api_status,
                                            pooling=bool(self.pooling))
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
        self._queue = svc.router.register(self.request_id)  # before sending: no event goes unrouted
        self._transition(State.ADMITTED)

    def attach(self) -> None:
        """Ready a generation admitted under a sibling's ticket (see admit)."""
        self._queue = self.svc.router.register(self.request_id)
        self._transition(State.ADMITTED)

    def _start_send(self, request: Request) -> PrefillRequest:
        """The prefill request to send (send_all): ADMITTED -> SENDING."""
        self._transition(State.SENDING)
        return PrefillRequest(
            request_id=self.request_id, gateway_id=self.svc.settings.gateway_id,
            prompt_token_ids=self.prompt_ids, sampling=self.sampling, arrival_time=time.time(),
            client_request_id=client_request_id(request.scope), trace_context=tracing.request_parent(),
            pooling=self.pooling)

    def _send_failed(self) -> None:
        if self.state is State.SENDING:  # nothing reached the workers: admitted, unsent
            self._transition(State.ADMITTED)

    def _on_sent(self) -> None:
        self.svc.metrics.prompt_tokens.inc(len(self.prompt_ids))
        if self.state is State.SENDING:
            self._transition(State.SENT)
        elif self.state is State.CLOSED:  # closed while the send was in flight: it must not run unread
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

    # ---- tokens ----

    async def steps(self) -> AsyncIterator[Step]:
        assert self._queue is not None, "admit() or attach() first"
        timeout = self.svc.settings.event_timeout
        while True:
            try:
                event = await asyncio.wait_for(self._queue.get(), timeout)
            except asyncio.TimeoutError:
                # Silence while the workers compute is a queue (a burst of long prompts on a small
                # CPU: minutes of prefill ahead of this one), not a loss: a message in a stream is
                # never dropped (a dead worker's is claimed; a Redis restart ends it as lost). Only
                # silence with nothing computed anywhere means nothing will come.
                if self.svc.cluster.computed_within(timeout):
                    continue
                self._fail("timeout", f"no token from the workers for {timeout:g}s, and none computed "
                           f"anything meanwhile (event_timeout)")
            if isinstance(event, StreamLost):
                if event.error is not None:  # its own send failed (gateway.siblings)
                    self._fail("send_failed", event.message, event.error)
                self._fail("redis_state_lost", event.message,
                           unavailable(event.message, self.svc.settings.retry_after_s))
            if self.state in (State.SENDING, State.SENT):
                self._transition(State.STREAMING)
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
            # (vLLM's rule: stop strings count from the min_tokens-th token on, as asked)
            released, hit = self._stops.push(self._detok.push(token_id),
                                             armed=len(self.tokens) + 1 >= self.spec.sampling.min_tokens)
            token = TokenOut(index=len(self.tokens), id=token_id, text=released,
                             logprob=logprobs[i] if i < len(logprobs) else None, special=token_id in special,
                             top=tops[i] if i < len(tops) else None)
            self.tokens.append(token)
            step.tokens.append(token)
            if hit:
                step.finish = FinishReason.STOP_SEQUENCE
                break
        worker_ended = step.finish is None and event.finish_reason is not None
        if worker_ended:
            assert event.finish_reason is not None
            if not event.finish_reason.ended_normally:  # ERROR, CANCELLED: the worker dropped it already
                self._fail(f"worker_{event.finish_reason}",
                           event.error or f"the worker ended the request ({event.finish_reason})", dropped=True)
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
            # Ended by the worker, nothing is left there; ended by us, it may still be running.
            self._end(State.FINISHED if worker_ended else State.STOPPED)
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

    def _fail(self, reason: str, message: str, error: ApiError | None = None, dropped: bool = False) -> NoReturn:
        """End in error (FAILED, or DROPPED when the workers hold nothing: `dropped`, or never
        sent) and raise GenerationFailed."""
        self._end(State.DROPPED if dropped or self.state not in AT_WORKERS else State.FAILED)
        self.svc.metrics.failure(reason)
        log.warning("request %s failed: %s", self.request_id, message)
        raise GenerationFailed(message, error)

    def _end(self, to: State) -> None:
        # A generation closed while its steps() were still being read (the response ended first:
        # a sibling failed, the client left) has nothing left to record.
        if self.state is not State.CLOSED:
            self._transition(to)

    # ---- end ----

    def abandon(self, reason: str, message: str) -> None:
        """End the request from our side, outside `steps()` (the client stopped reading); the
        following close() tells the workers to drop it."""
        if self.state not in (State.ADMITTED, *AT_WORKERS):
            return  # already ended (or never admitted): nothing to give up
        self._transition(State.FAILED if self.state in AT_WORKERS else State.DROPPED)
        self.svc.metrics.failure(reason)
        log.warning("request %s abandoned: %s", self.request_id, message)

    def close(self) -> None:
        """Release everything the request holds. Idempotent and synchronous (safe in `finally`)."""
        if self.state is State.CLOSED:
            return
        was = self.state
        self._transition(State.CLOSED)
        self.first_event.set()  # nothing more will come: release any sibling waiting on it
        svc = self.svc
        self.stop_watching()
        svc.router.unregister(self.request_id)
        if self._ticket is not None:
            svc.admission.done(self._ticket)
        # What the workers may still run gets a Cancel, by why we ended it. (SENDING: the send's
        # completion, _on_sent, cancels it.)
        if was in (State.SENT, State.STREAMING):
            svc.metrics.failure("client_disconnected")
            self._send_cancel("client disconnected")
        elif was is State.STOPPED:
            self._send_cancel("stop sequence" if self.finish_reason is FinishReason.STOP_SEQUENCE else "length")
        elif was is State.FAILED:
            self._send_cancel("gateway gave up")

    def _send_cancel(self, reason: str) -> None:
        self.svc.cancel(Cancel(request_id=self.request_id, gateway_id=self.svc.settings.gateway_id, reason=reason))
