"""The pure part of a worker: it takes messages and engine outputs and returns `Effects`, what to
write; the writer (`baton.worker.writer`) turns effects into Redis commands, and the shell
(`baton.worker.shell`) reads the streams, runs the engine's steps and the KV loads, and writes the
effects. No I/O and no Redis here: the worker cores are unit-tested with the real writer against
kvstore's in-memory Redis.

What both kinds share lives here once: the opening of a stream message (decode it or dead-letter
it, drop it if cancelled or already in flight, fail it past the delivery cap) and the error event.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from baton.common.finish_reason import FinishReason
from baton.common import protocol
from baton.common.logs import remember, request_extra
from baton.engine.llm_engine import LLMEngine
from baton.worker.metrics import WorkerMetrics

logger = logging.getLogger("baton.worker")

M = TypeVar("M", protocol.PrefillRequest, protocol.Handoff)


@dataclass
class Effects:
    """What to write, in this order (baton/worker/writer.py): a handoff is never visible before its
    blocks and its first token, and a message is acked only after what it produced is written."""

    dead_letters: list[tuple[bytes, dict, str]] = field(default_factory=list)  # (message id, fields, error)
    events: dict[str, list[protocol.TokenEvent]] = field(default_factory=dict)  # by gateway id
    block_puts: list[tuple[str, bytes]] = field(default_factory=list)  # full blocks by id (SET NX)
    block_refreshes: list[str] = field(default_factory=list)  # ids of blocks in use: TTL refreshed
    partial_puts: list[tuple[str, bytes]] = field(default_factory=list)  # (store key, value)
    handoffs: list[protocol.Handoff] = field(default_factory=list)
    acks: list[bytes] = field(default_factory=list)
    deletes: list[str] = field(default_factory=list)  # store keys no longer needed

    def add_event(self, gateway_id: str, event: protocol.TokenEvent) -> None:
        self.events.setdefault(gateway_id, []).append(event)

    def extend(self, other: Effects) -> None:
        self.dead_letters += other.dead_letters
        for gateway_id, events in other.events.items():
            self.events.setdefault(gateway_id, []).extend(events)
        self.block_puts += other.block_puts
        self.block_refreshes += other.block_refreshes
        self.partial_puts += other.partial_puts
        self.handoffs += other.handoffs
        self.acks += other.acks
        self.deletes += other.deletes

    def __bool__(self) -> bool:
        return bool(self.dead_letters or self.events or self.block_puts or self.block_refreshes
                    or self.partial_puts or self.handoffs or self.acks or self.deletes)

    @property
    def has_data(self) -> bool:
        return bool(self.block_puts or self.block_refreshes or self.partial_puts or self.events)

    @property
    def has_stream_ops(self) -> bool:
        return bool(self.dead_letters or self.handoffs or self.acks)


class Opening(enum.Enum):
    ADMIT = "admit"  # new work: the kind's core takes it
    SKIP = "skip"  # cancelled, or already in flight here: ack, nothing else
    DEAD_LETTER = "dead_letter"  # undecodable: parked with the reason, acked
    FAIL = "fail"  # delivered too often (it crashed workers): an error event, acked


@dataclass
class Opened(Generic[M]):
    outcome: Opening
    message: M | None = None
    error: str = ""


class WorkerCore(Generic[M]):
    """State both kinds keep: the engine, the requests in flight, the error path."""

    kind = "worker"
    message_type: type = protocol.PrefillRequest
    max_deliveries = 3

    def __init__(self, engine: LLMEngine, worker_id: str, metrics: WorkerMetrics) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.metrics = metrics
        self.num_finished = 0

    def is_in_flight(self, request_id: str) -> bool:
        raise NotImplementedError

    def open(self, fields: dict, deliveries: int, cancelled: set[str] | dict[str, float]) -> Opened[M]:
        """Decide what a stream message is, before it costs anything."""
        try:
            message = protocol.decode(fields[protocol.PAYLOAD_FIELD], self.message_type)
        except (protocol.MalformedMessage, KeyError) as exc:
            return Opened(Opening.DEAD_LETTER, error=str(exc))
        remember(message.request_id, message.client_request_id)  # from now on its log lines name it
        if message.request_id in cancelled or self.is_in_flight(message.request_id):
            return Opened(Opening.SKIP, message)
        if deliveries > self.max_deliveries:
            return Opened(Opening.FAIL, message, f"{self.kind} failed after {deliveries - 1} attempts")
        return Opened(Opening.ADMIT, message)

    def opening_effects(self, message_id: bytes, fields: dict, opened: Opened[M]) -> Effects:
        """The effects of a message that is not admitted."""
        effects = Effects()
        if opened.outcome is Opening.DEAD_LETTER:
            logger.error("dead-lettering message %s: %s", message_id, opened.error)
            self.metrics.dead_letters.inc()
            effects.dead_letters.append((message_id, fields, opened.error))
        elif opened.outcome is Opening.SKIP:
            effects.acks.append(message_id)
        elif opened.outcome is Opening.FAIL:
            assert opened.message is not None
            effects.extend(self.fail(message_id, opened.message, opened.error))
        return effects

    def fail(self, message_id: bytes, message: M, error: str) -> Effects:
        """End a request with an error event (never silence) and ack its message."""
        logger.error("request %s failed: %s", message.request_id, error, extra=request_extra(message.request_id))
        index = len(message.output_token_ids) if isinstance(message, protocol.Handoff) else 0
        effects = Effects(acks=[message_id])
        effects.add_event(message.gateway_id, protocol.TokenEvent(
            message.request_id, index, [], [], finish_reason=FinishReason.ERROR, error=error,
            num_prompt_tokens=len(message.prompt_token_ids), worker_id=self.worker_id))
        self.metrics.finished(FinishReason.ERROR)
        return effects
