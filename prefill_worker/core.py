"""The prefill worker's core: prompts in; first tokens, blocks, handoffs and acks out (no I/O; see
`worker.py`).

A request finishes here by handoff: its engine sequence is `remote_decode`, so the scheduler ends
it after the first token and the engine encodes its prompt's blocks (those the store may not hold
yet, and the partial last block) before freeing them. `on_step` turns that into one set of effects
that the shell writes in one MULTI/EXEC, in this order: first token, blocks, handoff, ack. A worker
dying mid-write leaves either all of it or none, never a handoff without its ack (which would
decode twice) nor one before its blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from baton.finish_reason import FinishReason
from baton import protocol
from baton.logs import request_extra
from baton.tracing import RequestSpans
from baton.engine.llm_engine import StepOutput
from baton.engine.sequence import Sequence
from baton.worker.core import Effects, WorkerCore
from kvstore.connector import RemoteKV
from kvstore.redis_backend import partial_key

logger = logging.getLogger("baton.prefill")


class PrefillCore(WorkerCore[protocol.PrefillRequest]):
    kind = "prefill"
    message_type = protocol.PrefillRequest
    max_deliveries = 3

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # request id -> (stream message id, request, admission time)
        self.in_flight: dict[str, tuple[bytes, protocol.PrefillRequest, float]] = {}
        self.num_prefix_hit_tokens = 0
        self.spans = RequestSpans()  # tracing: each request's "prefill" span (no-op when off)

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self.in_flight

    def admit(self, message_id: bytes, request: protocol.PrefillRequest, stored_hashes: list[str],
              block_hashes: list[str] | None = None) -> Effects:
        """Add an opened request; `stored_hashes` are its prompt's leading block ids that a probe
        found in the store (the scheduler loads those beyond the local prefix cache), and
        `block_hashes` all its full blocks' ids if the caller computed them already."""
        try:
            seq = Sequence(request.request_id, request.prompt_token_ids, request.sampling,
                           arrival_time=request.arrival_time, remote_kv=RemoteKV(stored_hashes) if stored_hashes else None,
                           remote_decode=True, block_hashes=block_hashes)
            self.engine.add_request(seq)
        except (ValueError, TypeError) as exc:
            return self.fail(message_id, request, str(exc))
        self.in_flight[request.request_id] = (message_id, request, time.time())
        self.spans.begin(request.request_id, "prefill", request.trace_context, **{
            "baton.worker_id": self.worker_id, "baton.client_request_id": request.client_request_id,
            "baton.prompt_tokens": len(request.prompt_token_ids), "baton.stored_blocks": len(stored_hashes)})
        logger.debug("prefilling request %s (%d prompt tokens, %d stored blocks)", request.request_id,
                     len(request.prompt_token_ids), len(stored_hashes), extra=request_extra(request.request_id))
        return Effects()

    def cancel(self, request_id: str, reason: str = "cancelled") -> Effects:
        entry = self.in_flight.pop(request_id, None)
        if entry is None:
            return Effects()
        self.engine.abort_request(request_id)
        self.spans.end(request_id, reason)
        self.metrics.finished(FinishReason.CANCELLED)
        logger.info("dropped request %s (%s)", request_id, reason, extra=request_extra(request_id))
        return Effects(acks=[entry[0]])

    def gateway_of(self, request_id: str) -> str:
        return self.in_flight[request_id][1].gateway_id

    def on_step(self, outputs: list[StepOutput]) -> Effects:
        effects = Effects()
        bs = self.engine.block_size
        for out in outputs:
            seq = out.seq
            entry = self.in_flight.pop(seq.seq_id, None)
            if entry is None:
                continue
            message_id, request, admitted = entry
            self.spans.end(seq.seq_id, (seq.error or "error") if seq.finish_reason is FinishReason.ERROR else None)
            num_prompt = seq.num_prompt_tokens
            self.metrics.prompt_tokens.inc(num_prompt)
            self.metrics.prefix_cache_queries.inc(num_prompt)
            self.metrics.prefix_cache_hits.inc(seq.num_cached_tokens)
            self.num_prefix_hit_tokens += seq.num_cached_tokens
            self.num_finished += 1
            self.metrics.request_prefill_time.observe(time.time() - admitted)
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
            handoff = out.kv_save is not None
            effects.add_event(request.gateway_id, protocol.TokenEvent(
                seq.seq_id, 0, out.new_token_ids, out.new_logprobs,
                finish_reason=None if handoff else seq.finish_reason,
                error=(seq.error or "the request does not fit in the KV pool") if seq.finish_reason is FinishReason.ERROR
                else None,
                num_prompt_tokens=num_prompt, num_cached_tokens=seq.num_cached_tokens, worker_id=self.worker_id,
                top_logprobs=out.new_top_logprobs, prompt_logprobs=seq.prompt_logprobs or []))
            if not handoff:  # EOS as the first token, max_tokens=1, or an error: no handoff
                self.metrics.finished(seq.finish_reason or FinishReason.STOP)
            else:
                save = out.kv_save
                assert save is not None
                effects.block_puts += save.full
                effects.block_refreshes += save.refresh
                self.metrics.blocks_written.inc(len(save.full))
                self.metrics.bytes("written", sum(len(v) for _, v in save.full))
                self.metrics.blocks_computed.inc(save.num_full_blocks - seq.num_cached_tokens // bs)
                key = None
                if save.partial is not None:
                    key = partial_key(seq.seq_id)
                    effects.partial_puts.append((key, save.partial))
                    self.metrics.bytes("written", len(save.partial))
                effects.handoffs.append(protocol.Handoff(
                    request_id=seq.seq_id, gateway_id=request.gateway_id, prompt_token_ids=seq.prompt_token_ids,
                    output_token_ids=seq.output_token_ids,
                    block_hashes=seq.block_hashes(bs, self.engine.model_id)[:save.num_full_blocks],
                    # the prompt's logprobs went out with the first token: decode must not recompute them
                    partial_block_key=key, sampling=dataclasses.replace(seq.sampling_params, prompt_logprobs=None),
                    arrival_time=request.arrival_time,
                    first_token_time=seq.first_token_time or time.time(),
                    client_request_id=request.client_request_id, trace_context=request.trace_context))
            effects.acks.append(message_id)
        return effects
