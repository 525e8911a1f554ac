"""The prefill worker's core: prompts in; first tokens, blocks, handoffs and acks out (no I/O; see
`worker.py`).

A request finishes here by handoff (an embedding request, `pooling`, here, with its vector): it is added to the engine with `remote_decode`, so the engine
ends it after the first token and encodes its prompt's blocks (those the store may not hold yet,
and the partial last block) into the output's `handoff.save` before freeing them. `on_step` turns that into one set of effects
that the shell writes in one MULTI/EXEC, in this order: first token, blocks, handoff, ack. A worker
dying mid-write leaves either all of it or none, never a handoff without its ack (which would
decode twice) nor one before its blocks.
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
from baton.engine.pooling import Pooling
from baton.worker.core import Effects, WorkerCore

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
            # An embedding request (pooling) is run and pooled here: no handoff, no stored KV loads
            # (the shell probes none for it), its blocks freed as soon as its prompt is computed.
            pooling = Pooling(request.pooling) if request.pooling else None
            self.engine.add_request(
                request.request_id, request.prompt_token_ids, request.sampling, arrival_time=request.arrival_time,
                remote_kv=RemoteKV(tuple(stored_hashes)) if stored_hashes else None, remote_decode=pooling is None,
                block_hashes=block_hashes, pooling=pooling)
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
        self.engine.abort([request_id])
        self.spans.end(request_id, reason)
        self.metrics.finished(FinishReason.CANCELLED)
        logger.info("dropped request %s (%s)", request_id, reason, extra=request_extra(request_id))
        return Effects(acks=[entry[0]])

    def gateway_of(self, request_id: str) -> str:
        return self.in_flight[request_id][1].gateway_id

    def on_step(self, outputs: list[EngineOutput]) -> Effects:
        effects = Effects()
        bs = self.engine.block_size
        for out in outputs:
            entry = self.in_flight.pop(out.request_id, None)
            if entry is None:
                continue
            message_id, request, admitted = entry
            failed = out.finish_reason is FinishReason.ERROR
            self.spans.end(out.request_id, (out.error or "error") if failed else None)
            num_prompt = out.num_prompt_tokens
            self.metrics.prompt_tokens.inc(num_prompt)
            self.metrics.prefix_cache_queries.inc(num_prompt)
            self.metrics.prefix_cache_hits.inc(out.num_cached_tokens)
            self.num_prefix_hit_tokens += out.num_cached_tokens
            self.num_finished += 1
            self.metrics.request_prefill_time.observe(time.time() - admitted)
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
            handoff = out.handoff
            effects.add_event(request.gateway_id, protocol.TokenEvent(
                out.request_id, 0, list(out.new_token_ids), list(out.new_logprobs),
                finish_reason=None if handoff else out.finish_reason,
                error=(out.error or "the request failed") if failed else None,
                num_prompt_tokens=num_prompt, num_cached_tokens=out.num_cached_tokens, worker_id=self.worker_id,
                top_logprobs=list(out.new_top_logprobs), prompt_logprobs=list(out.prompt_logprobs or []),
                embedding=protocol.pack_embedding(out.embedding) if out.embedding is not None else b""))
            if handoff is None:  # EOS as the first token, max_tokens=1, an embedding, an error: no handoff
                self.metrics.finished(out.finish_reason or FinishReason.STOP)
            else:
                save = handoff.save
                effects.block_puts += save.full
                effects.block_refreshes += save.refresh
                self.metrics.blocks_written.inc(len(save.full))
                self.metrics.bytes("written", save.num_bytes)
                self.metrics.blocks_computed.inc(save.num_full_blocks - out.num_cached_tokens // bs)
                if save.partial is not None:
                    effects.partial_puts.append(save.partial)
                effects.handoffs.append(protocol.Handoff(
                    request_id=out.request_id, gateway_id=request.gateway_id,
                    prompt_token_ids=request.prompt_token_ids, output_token_ids=list(handoff.output_token_ids),
                    block_hashes=list(save.block_hashes),
                    # the prompt's logprobs went out with the first token: decode must not recompute them
                    partial_block_key=save.partial[0] if save.partial is not None else None,
                    sampling=dataclasses.replace(request.sampling, prompt_logprobs=None),
                    arrival_time=request.arrival_time, first_token_time=handoff.first_token_time,
                    client_request_id=request.client_request_id, trace_context=request.trace_context))
            effects.acks.append(message_id)
        return effects
