"""The decode worker's core: handoffs in, token events and acks out (no I/O; see `worker.py`).

A handoff stays unacked while its request decodes, so a decode worker that dies leaves it pending:
a live one claims it, loads the prompt's blocks again and regenerates; the gateway drops the tokens
it already has (the same tokens: greedy is deterministic and sampling draws are seeded per (seed,
position)). `next_index` keeps a resumed request from sending those tokens again.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from baton.common.finish_reason import FinishReason
from baton.common import protocol
from baton.common.logs import request_extra
from baton.common.tracing import RequestSpans
from baton.engine.kv_types import RemoteKV
from baton.engine.outputs import EngineOutput
from baton.worker.core import Effects, WorkerCore
from kvstore.keys import state_key

logger = logging.getLogger("baton.decode")


@dataclasses.dataclass
class InFlight:
    message_id: bytes
    handoff: protocol.Handoff
    admitted: float
    next_index: int  # output position of the next token the gateway does not have yet


class DecodeCore(WorkerCore[protocol.Handoff]):
    kind = "decode"
    message_type = protocol.Handoff
    max_deliveries = 4

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.in_flight: dict[str, InFlight] = {}
        self.spans = RequestSpans()  # tracing: each request's "decode" span (no-op when off)

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self.in_flight

    def admit(self, message_id: bytes, handoff: protocol.Handoff) -> Effects:
        """Add an opened handoff to the engine; the scheduler loads its blocks when its turn comes
        (what is missing from the store is recomputed here)."""
        num_prompt = len(handoff.prompt_token_ids)
        partial_tokens = num_prompt - len(handoff.block_hashes) * self.engine.block_size
        remote = RemoteKV(tuple(handoff.block_hashes), handoff.partial_block_key,
                          partial_tokens if handoff.partial_block_key else 0)
        try:
            self.engine.add_request(
                handoff.request_id, handoff.prompt_token_ids, handoff.sampling, arrival_time=handoff.arrival_time,
                output_token_ids=handoff.output_token_ids, first_token_time=handoff.first_token_time,
                remote_kv=remote)
        except (ValueError, TypeError) as exc:
            return self.fail(message_id, handoff, str(exc))
        self.metrics.handoff_latency.observe(max(0.0, time.time() - handoff.first_token_time))
        self.in_flight[handoff.request_id] = InFlight(message_id, handoff, time.time(), len(handoff.output_token_ids))
        ids = {"baton.request_id": handoff.request_id, "baton.client_request_id": handoff.client_request_id,
               "baton.worker_id": self.worker_id}
        # From the first token to here: the KV's trip through the store, and the wait for a worker.
        self.spans.record("handoff", handoff.trace_context, handoff.first_token_time, **ids)
        self.spans.begin(handoff.request_id, "decode", handoff.trace_context, **ids,
                         **{"baton.resumed_at_token": len(handoff.output_token_ids)})
        logger.debug("decoding request %s from output position %d", handoff.request_id,
                     len(handoff.output_token_ids), extra=request_extra(handoff.request_id))
        return Effects()

    def drop(self, request_id: str, reason: str) -> Effects:
        """Stop a request (cancelled, or its gateway is gone): free it, ack its handoff."""
        entry = self.in_flight.pop(request_id, None)
        if entry is None:
            return Effects()
        self.engine.abort([request_id])
        self.spans.end(request_id, reason)
        self.metrics.finished(reason)
        logger.info("dropped request %s (%s)", request_id, reason, extra=request_extra(request_id))
        return Effects(acks=[entry.message_id], deletes=self._partial_keys(entry))

    def gateway_of(self, request_id: str) -> str:
        return self.in_flight[request_id].handoff.gateway_id

    def on_step(self, outputs: list[EngineOutput]) -> Effects:
        """This step's token events (grouped by gateway), and the acks of finished requests."""
        effects = Effects()
        for out in outputs:
            entry = self.in_flight.get(out.request_id)
            if entry is None:
                continue
            first_index = out.num_output_tokens - len(out.new_token_ids)
            # After a resume on this worker, tokens the gateway already has are not sent again.
            skip = max(0, entry.next_index - first_index)
            tokens, logprobs = list(out.new_token_ids[skip:]), list(out.new_logprobs[skip:])
            entry.next_index = max(entry.next_index, out.num_output_tokens)
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
            if not tokens and not out.finished:
                continue
            failed = out.finish_reason is FinishReason.ERROR
            effects.add_event(entry.handoff.gateway_id, protocol.TokenEvent(
                out.request_id, first_index + skip, tokens, logprobs, finish_reason=out.finish_reason,
                error=(out.error or "the request failed") if failed else None,
                num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
                worker_id=self.worker_id, top_logprobs=list(out.new_top_logprobs[skip:])))
            if out.finished:
                del self.in_flight[out.request_id]
                self.spans.end(out.request_id, (out.error or "error") if failed else None)
                self.num_finished += 1
                effects.acks.append(entry.message_id)
                effects.deletes += self._partial_keys(entry)
                self.metrics.finished(out.finish_reason or FinishReason.STOP)
                self.metrics.request_decode_time.observe(time.time() - entry.admitted)
        return effects

    def _partial_keys(self, entry: InFlight) -> list[str]:
        """The request's keys to delete once it is done: its partial block, a hybrid's state."""
        key = entry.handoff.partial_block_key
        keys = [key] if key else []
        if self.engine.runtime.has_state_layers:
            keys.append(state_key(entry.handoff.request_id))
        return keys
