"""Admission control: the token budget and the FIFO wait queue, owned by one asyncio task.

TGI router discipline. A request costs `input_tokens + max_new_tokens` of the cluster's token
budget from admission until it ends. Request handlers never touch the budget: they send commands
(`submit`, `done`) through an inbox, and a single task applies them in order, so there is no
check-then-act race between handlers and no lock. Every submitted ticket gets exactly one `done`
(handlers call it in `finally`), whatever happened: admitted or not, finished, failed, timed out,
cancelled. That single rule is what makes a leaked reservation impossible.

The budget is the cluster's, shared by every gateway: with N live gateways (their heartbeats) each
admits against 1/N of it, so N gateways together never admit more than the cluster holds, with no
Redis round trip per request and nothing to leak when a gateway dies (its share returns to the
others at their next heartbeat read). A load balancer that spreads requests evenly uses the whole
budget; a request larger than one share can never be admitted by one gateway and is refused.

Embeddings requests (`pooling` tickets) hold no decode KV: they are admitted in a lane of their own,
costing their inputs' tokens (what the prefill workers compute) against `max_embedding_tokens` (per
gateway), with their own FIFO and concurrency count. A flood of them never takes the decode budget
or a place in the queue that chat requests wait in; past the lane's room they wait (at most as many
tokens again), then get 429 at once (issue 38: 16 requests of 2048 inputs timed chats out).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, Union

from baton.common import tracing
from baton.common.logs import bound_client_id
from gateway.config import Settings
from gateway.errors import ApiError, overloaded, validation_error
from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)


class TicketState(enum.Enum):
    """A ticket's life, written only by the admission task: NEW -> (WAITING ->) RUNNING -> DONE, or
    NEW/WAITING -> DONE (refused, or given up before admission)."""

    NEW = "new"
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"


_TRANSITIONS = {
    TicketState.NEW: {TicketState.WAITING, TicketState.RUNNING, TicketState.DONE},
    TicketState.WAITING: {TicketState.RUNNING, TicketState.DONE},
    TicketState.RUNNING: {TicketState.DONE},
    TicketState.DONE: set(),
}


@dataclass(eq=False)
class Ticket:
    """One request's claim on the budget. `decision` resolves to None (admitted) or an ApiError."""

    cost: int
    status: int  # HTTP status for "can never fit" (the API's validation status)
    decision: asyncio.Future[ApiError | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    submitted_at: float = field(default_factory=time.monotonic)
    state: TicketState = TicketState.NEW  # written only by the admission task (`move`)
    # Tracing (baton/common/tracing.py; None when off): the request's span at the gateway, from submit to
    # done, and its child for the wait for budget.
    span: Any = None
    admission_span: Any = None
    rejected: str = ""  # why it was answered with an error before admission, if it was
    pooling: bool = False  # an embeddings request: admitted in the embeddings lane
    # Sends the Done message to the admission task (set by `Admission.submit`).
    on_release: Callable[[Ticket], None] | None = field(default=None, repr=False)
    released: bool = False  # the holder's side: release() was called

    def move(self, to: TicketState) -> None:
        assert to in _TRANSITIONS[self.state], f"ticket {self.state.name} -> {to.name}"
        self.state = to

    def release(self) -> None:
        """Give the budget back, or leave the queue: once, whoever calls it first (every exit path
        of a request may; the later calls do nothing)."""
        if self.released:
            return
        self.released = True
        if self.on_release is not None:
            self.on_release(self)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


# The admission task's inbox: typed messages, applied in order by their one owner.
@dataclass(frozen=True)
class Submit:
    ticket: Ticket


@dataclass(frozen=True)
class Done:
    ticket: Ticket


@dataclass(frozen=True)
class BudgetUpdate:
    total_tokens: int  # the live decode workers' KV capacity
    largest_worker_tokens: int
    gateways: int  # live gateways sharing it (this one included)


Command = Union[Submit, Done, BudgetUpdate]


class Admission:
    def __init__(self, settings: Settings, metrics: GatewayMetrics) -> None:
        self._settings = settings
        self._metrics = metrics
        self._inbox: asyncio.Queue[Command] = asyncio.Queue()
        self._waiting: deque[Ticket] = deque()
        self._running = 0
        self._in_use = 0
        self._derived_total = 0  # from decode heartbeats; used when no fixed budget is set
        self._derived_largest = 0  # the biggest single decode worker's capacity, in tokens
        self._gateways = 1  # live gateways sharing the budget (this one included)
        # the embeddings lane: its FIFO, requests admitted and their input tokens
        self._pool_waiting: deque[Ticket] = deque()
        self._pool_running = 0
        self._pool_in_use = 0

    # ---- the handler-facing API: messages only ----

    def submit(self, cost: int, status: int, pooling: bool = False) -> Ticket:
        """A ticket for `cost` tokens, queued for admission; release it on every exit path (it is a
        context manager: `with admission.submit(...) as ticket:`). `pooling`: an embeddings
        request, admitted in its own lane."""
        ticket = Ticket(cost=cost, status=status, on_release=self._release, pooling=pooling)
        if tracing.enabled():
            ticket.span = tracing.start_span("request", attributes={
                "baton.gateway_id": self._settings.gateway_id, "baton.cost_tokens": cost,
                "baton.client_request_id": bound_client_id()})
            ticket.admission_span = tracing.start_span("admission", ticket.span)
            # The caller's task sends the request's messages: they carry this span as their parent.
            tracing.set_request_parent(tracing.traceparent(ticket.span))
        self._inbox.put_nowait(Submit(ticket))
        return ticket

    def done(self, ticket: Ticket) -> None:
        ticket.release()

    def _release(self, ticket: Ticket) -> None:
        self._inbox.put_nowait(Done(ticket))

    def set_derived_budget(self, total_tokens: int, largest_worker_tokens: int, gateways: int = 1) -> None:
        """What the heartbeats say: the decode workers' KV capacity (in all, and the largest one's)
        and how many live gateways share it."""
        self._inbox.put_nowait(BudgetUpdate(total_tokens, largest_worker_tokens, max(1, gateways)))

    # ---- read-only views (safe: same event loop, the task is the only writer) ----

    @property
    def cluster_total(self) -> int:
        """The whole cluster's budget: the fixed one, or the live decode workers' KV capacity."""
        fixed = self._settings.max_batch_total_tokens
        return fixed if fixed is not None else self._derived_total

    @property
    def total(self) -> int:
        """This gateway's share of the cluster's budget, what it admits against."""
        return self.cluster_total // self._gateways

    @property
    def largest_request(self) -> int:
        """The biggest cost that can ever be admitted (0: unknown yet).

        With a derived budget a request must fit in ONE decode worker's KV pool, not in the sum;
        and in this gateway's share.
        """
        fixed = self._settings.max_batch_total_tokens
        largest = fixed if fixed is not None else self._derived_largest
        return min(largest, self.total)

    def snapshot(self) -> dict[str, Any]:
        return {
            "token_budget": {
                "total": self.total,
                "in_use": self._in_use,
                "max_request_tokens": self.largest_request,
                "source": "fixed" if self._settings.max_batch_total_tokens is not None else "decode_heartbeats",
                "cluster_total": self.cluster_total,
                "gateways": self._gateways,
            },
            "requests": {"running": self._running, "waiting": len(self._waiting)},
            "embeddings": {"tokens_total": self._settings.max_embedding_tokens, "tokens_in_use": self._pool_in_use,
                           "running": self._pool_running, "waiting": len(self._pool_waiting)},
        }

    # ---- the owner task ----

    async def run(self) -> None:
        while True:
            self._apply(await self._inbox.get())
            while not self._inbox.empty():  # drain a burst before trying to admit
                self._apply(self._inbox.get_nowait())
            self._admit_waiting()
            self._publish()

    def _apply(self, command: Command) -> None:
        if isinstance(command, Submit):
            self._on_submit(command.ticket)
        elif isinstance(command, Done):
            self._on_done(command.ticket)
        else:
            if 0 < command.largest_worker_tokens < self._settings.max_total_tokens and \
                    command.largest_worker_tokens != self._derived_largest:
                # said at once, not at the first long request: the fix is a flag at start-up
                log.warning("the largest decode worker holds %d tokens of KV, less than the context (%d): "
                            "requests longer than that are refused; give the decode workers more "
                            "(--kv-cache-memory) or lower --max-model-len", command.largest_worker_tokens,
                            self._settings.max_total_tokens)
            self._derived_total, self._derived_largest = command.total_tokens, command.largest_worker_tokens
            self._gateways = command.gateways

    def _on_submit(self, t: Ticket) -> None:
        if t.pooling:
            self._on_submit_pooling(t)
            return
        s = self._settings
        if self._running + len(self._waiting) >= s.max_concurrent_requests:
            self._reject(t, "concurrency", overloaded(
                f"server overloaded: {s.max_concurrent_requests} requests already in flight "
                f"(max_concurrent_requests={s.max_concurrent_requests}); retry later", s.retry_after_s))
            return
        total, largest = self.total, self.largest_request
        if largest > 0 and t.cost > largest:
            # Would wait forever: even an idle cluster cannot hold it.
            where = ("the token budget (max_batch_total_tokens)" if s.max_batch_total_tokens is not None
                     else "the KV capacity of the largest decode worker")
            if largest == total and self._gateways > 1:
                where = (f"this gateway's share of the cluster's token budget (1/{self._gateways} of "
                         f"{self.cluster_total}: {self._gateways} gateways share it)")
            self._reject(t, "exceeds_budget", validation_error(
                f"request needs {t.cost} tokens (input + max new tokens) but {where} is {largest}; "
                f"send a shorter prompt or fewer max new tokens", status=t.status))
            return
        if not self._waiting and t.cost <= total - self._in_use:
            self._grant(t)
            return
        if len(self._waiting) >= s.max_queue_size:
            self._reject(t, "queue_full", overloaded(
                f"server overloaded: admission queue is full ({s.max_queue_size} waiting, "
                f"max_queue_size={s.max_queue_size}); retry later", s.retry_after_s))
            return
        t.move(TicketState.WAITING)
        self._waiting.append(t)

    def _on_submit_pooling(self, t: Ticket) -> None:
        """The embeddings lane: the same rules as the decode budget's, against its own room."""
        s = self._settings
        total = s.max_embedding_tokens
        if self._pool_running + len(self._pool_waiting) >= s.max_concurrent_requests:
            self._reject(t, "concurrency", overloaded(
                f"server overloaded: {s.max_concurrent_requests} embeddings requests already in flight "
                f"(max_concurrent_requests={s.max_concurrent_requests}); retry later", s.retry_after_s))
        elif t.cost > total:
            self._reject(t, "exceeds_budget", validation_error(
                f"the inputs have {t.cost} tokens in all; an embeddings request may have at most "
                f"max_embedding_tokens={total}: send fewer or shorter inputs", status=t.status))
        elif not self._pool_waiting and t.cost <= total - self._pool_in_use:
            self._grant(t)
        elif sum(w.cost for w in self._pool_waiting) + t.cost > total:
            # Embeddings queued past this would only wait out max_queue_wait: say so at once.
            self._reject(t, "queue_full", overloaded(
                f"server overloaded: the embeddings requests waiting for room already hold "
                f"max_embedding_tokens={total} tokens; retry later", s.retry_after_s))
        else:
            t.move(TicketState.WAITING)
            self._pool_waiting.append(t)

    def _on_done(self, t: Ticket) -> None:
        if t.state is TicketState.DONE:
            return  # a second done(): the first released it
        if t.state is TicketState.WAITING:
            # gave up (timeout, client gone) before admission
            (self._pool_waiting if t.pooling else self._waiting).remove(t)
            tracing.end_span(t.admission_span, "gave up waiting for token budget")
            t.rejected = "gave up waiting"
        elif t.state is TicketState.RUNNING and t.pooling:
            self._pool_running -= 1
            self._pool_in_use -= t.cost
        elif t.state is TicketState.RUNNING:
            self._running -= 1
            self._in_use -= t.cost
        tracing.end_span(t.span, t.rejected or None)
        t.move(TicketState.DONE)
        if not t.decision.done():
            t.decision.cancel()

    def _admit_waiting(self) -> None:
        # Strict FIFO: if the head does not fit, nobody behind it may pass, even a request small
        # enough to fit. Letting small requests jump ahead would starve big ones forever under load
        # (head-of-line blocking is the price of that fairness guarantee, as in TGI's router).
        total = self.total
        while self._waiting and self._waiting[0].cost <= total - self._in_use:
            self._grant(self._waiting.popleft())
        pool_total = self._settings.max_embedding_tokens
        while self._pool_waiting and self._pool_waiting[0].cost <= pool_total - self._pool_in_use:
            self._grant(self._pool_waiting.popleft())

    def _grant(self, t: Ticket) -> None:
        t.move(TicketState.RUNNING)
        if t.pooling:
            self._pool_running += 1
            self._pool_in_use += t.cost
        else:
            self._running += 1
            self._in_use += t.cost
        self._metrics.queue_time.observe(time.monotonic() - t.submitted_at)
        tracing.end_span(t.admission_span)
        if not t.decision.done():
            t.decision.set_result(None)

    def _reject(self, t: Ticket, reason: str, error: ApiError) -> None:
        self._metrics.reject(reason)
        t.rejected = reason
        tracing.end_span(t.admission_span, reason)
        if not t.decision.done():
            t.decision.set_result(error)

    def _publish(self) -> None:
        m = self._metrics
        m.num_requests_running.set(self._running + self._pool_running)
        m.num_requests_waiting.set(len(self._waiting) + len(self._pool_waiting))
        m.token_budget_in_use.set(self._in_use)
        m.token_budget_total.set(self.total)
