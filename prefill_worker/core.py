"""The prefill worker's core: prompts in; first tokens, blocks, handoffs and acks out (no I/O; see
`worker.py`).

A request finishes here by handoff: it is added to the engine with `remote_decode`, so the engine
ends it after the first token and encodes its prompt's blocks (those the store may not hold yet,
and the partial last block) into the output's `handoff.save` before freeing them. `on_step` turns that into one set of effects
that the shell writes in one MULTI/EXEC, in this order: first token, blocks, handoff, ack. A worker
dying mid-write leaves either all of it or none, never a handoff without its ack (which would
decode twice) nor one before its blocks.

An embeddings request (`pooling`) finishes here, with its vectors: a batch of inputs in one message,
fed to the engine before each step (`feed`) behind the generation prompts (prefill_worker/pooling.py).
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
from prefill_worker.pooling import PoolingBatches

logger = logging.getLogger("baton.prefill")


def default_pooling_step_tokens(max_num_batched_tokens: int) -> int:
    return max(1, max_num_batched_tokens // 8)


class PrefillCore(WorkerCore[protocol.PrefillRequest]):
    kind = "prefill"
    message_type = protocol.PrefillRequest
    max_deliveries = 3

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # request id -> (stream message id, request, admission time): the generation prompts
        self.in_flight: dict[str, tuple[bytes, protocol.PrefillRequest, float]] = {}
        # Embeddings input tokens per step (--pooling-step-tokens): a chat prompt that arrives while
        # such a step runs waits for it, so it is kept short (an eighth of the step's budget, 64
        # tokens by default: about a chat prompt's own prefill).
        self.pooling_step_tokens = default_pooling_step_tokens(self.engine.config.max_num_batched_tokens)
        self.num_prefix_hit_tokens = 0
        self.spans = RequestSpans()  # tracing: each request's "prefill" span (no-op when off)
        self.pooling = PoolingBatches(self.engine, self.worker_id, self.metrics, self.spans)  # embeddings batches

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self.in_flight or request_id in self.pooling

    def request_ids(self) -> list[str]:
        """Every request this worker holds: generation prompts and embeddings batches."""
        return [*self.in_flight, *self.pooling.batches]

    def feed(self) -> Effects:
        """Before each step: embeddings inputs into the engine, `pooling_step_tokens` of them, or
        while it holds generation prompts none but the one that keeps the batches moving (the
        prompts go first, alone: a chat prompt waits at most for the short embeddings step that
        was running when it came)."""
        room = 0 if self.in_flight else self.pooling_step_tokens
        return self.pooling.feed(room, self.engine.config.max_num_seqs - len(self.in_flight))

    def admit(self, message_id: bytes, request: protocol.PrefillRequest, stored_hashes: list[str],
              block_hashes: list[str] | None = None) -> Effects:
        """Add an opened request; `stored_hashes` are its prompt's leading block ids that a probe
        found in the store (the scheduler loads those beyond the local prefix cache), and
        `block_hashes` all its full blocks' ids if the caller computed them already."""
        if request.pooling:
            # An embeddings batch: its inputs go to the engine as `feed` finds room, each run and
            # pooled here (no handoff, no stored KV loads), its blocks freed once it is computed.
            return self.pooling.add(message_id, request)
        try:
            self.engine.add_request(
                request.request_id, request.prompt_token_ids, request.sampling, arrival_time=request.arrival_time,
                remote_kv=RemoteKV(tuple(stored_hashes)) if stored_hashes else None, remote_decode=True,
                block_hashes=block_hashes)
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
        batch = self.pooling.drop(request_id)
        if batch is not None:
            self.metrics.finished(FinishReason.CANCELLED)
            logger.info("dropped embeddings batch %s (%s)", request_id, reason, extra=request_extra(request_id))
            return Effects(acks=[batch.message_id])
        entry = self.in_flight.pop(request_id, None)
        if entry is None:
            return Effects()
        self.engine.abort([request_id])
        self.spans.end(request_id, reason)
        self.metrics.finished(FinishReason.CANCELLED)
        logger.info("dropped request %s (%s)", request_id, reason, extra=request_extra(request_id))
        return Effects(acks=[entry[0]])

    def gateway_of(self, request_id: str) -> str:
        batch = self.pooling.batches.get(request_id)
        return batch.request.gateway_id if batch is not None else self.in_flight[request_id][1].gateway_id

    def on_step(self, outputs: list[EngineOutput]) -> Effects:
        effects = Effects()
        bs = self.engine.block_size
        for out in outputs:
            if self.pooling.owns(out.request_id):
                self.pooling.on_output(out, effects)
                continue
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
                top_logprobs=list(out.new_top_logprobs), prompt_logprobs=list(out.prompt_logprobs or [])))
            if handoff is None:  # EOS as the first token, max_tokens=1, an error: no handoff
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
                if save.state is not None:  # a hybrid's state: keyed by request, written (and deleted) like the partial
                    effects.partial_puts.append(save.state)
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
