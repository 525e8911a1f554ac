"""One embeddings HTTP request as ONE job through the pipeline: a `Generation` whose prefill request
carries every input (`PrefillRequest.inputs`) and whose token events bring the vectors back.

The prefill worker feeds the inputs to its engine a step's budget at a time, round robin with the
other batches and behind the chat prompts (prefill_worker/pooling.py), and publishes each input's
vector in its own event, `index` being the input's place; the job ends when every input has its
vector. Everything else is a Generation's: admission (in the embeddings lane, costing the inputs'
tokens), the send, `event_timeout` between two events, the client leaving (a Cancel drops the
whole batch at the worker), and `close()` releasing the budget. A vector that comes twice (the
batch was redone by the worker that claimed it from a dead one) keeps its first copy.
"""

from __future__ import annotations

import time

from starlette.requests import Request

from baton.common import tracing
from baton.common.finish_reason import FinishReason
from baton.common.protocol import PrefillRequest, TokenEvent
from baton.common.sampling_params import SamplingParams
from gateway.finish import spelled
from gateway.generation import Generation, Step
from gateway.lifecycle import State
from gateway.request_ids import client_request_id
from gateway.services import Services
from gateway.generation_spec import ApiView, GenerationSpec, Prompt


class EmbeddingJob(Generation):
    def __init__(self, svc: Services, inputs: list[list[int]], arrival: float, api_status: int, pooling: str) -> None:
        spec = GenerationSpec(Prompt(input=inputs[0]), SamplingParams(max_tokens=1), ApiView())
        super().__init__(svc, spec, [], spec.sampling, arrival, api_status, pooling=pooling)
        self.inputs = inputs
        self.vectors: list[bytes | None] = [None] * len(inputs)  # raw float32 (protocol.pack_embedding)
        self.num_vectors = 0

    @property
    def cost(self) -> int:
        """What the prefill workers compute: every input's tokens (no decode KV is held)."""
        return sum(map(len, self.inputs))

    @property
    def num_prompt_tokens(self) -> int:
        return self.cost

    def _start_send(self, request: Request) -> PrefillRequest:
        self._transition(State.SENDING)
        return PrefillRequest(
            request_id=self.request_id, gateway_id=self.svc.settings.gateway_id, prompt_token_ids=[],
            sampling=self.sampling, arrival_time=time.time(), client_request_id=client_request_id(request.scope),
            trace_context=tracing.request_parent(), pooling=self.pooling, inputs=self.inputs)

    def _on_sent(self) -> None:
        super()._on_sent()  # (counts prompt_ids' tokens: none)
        self.svc.metrics.prompt_tokens.inc(self.cost)

    def _apply(self, event: TokenEvent) -> Step | None:
        if event.finish_reason is not None and not event.finish_reason.ended_normally:
            self._fail(f"worker_{event.finish_reason}",
                       event.error or f"the worker ended the request ({event.finish_reason})", dropped=True)
        index = event.index
        if not 0 <= index < len(self.inputs) or not event.embedding:
            self._fail("bad_event", f"the workers answered input {index} of {len(self.inputs)} without its embedding")
        if self.vectors[index] is None:
            self.vectors[index] = event.embedding
            self.num_vectors += 1
        if self.num_vectors < len(self.inputs):
            if event.finish_reason is FinishReason.STOP:  # a worker sends a batch's vectors before its end
                missing = self.vectors.index(None)
                self._fail("bad_event", f"the workers ended the batch without the embedding of input {missing}")
            return None
        self.finish_reason = FinishReason.STOP
        # Complete without the worker's last event (a redone batch's first vectors came from the
        # worker that died): the one redoing it may still hold it, and close() cancels it there.
        self._end(State.FINISHED if event.finish_reason is FinishReason.STOP else State.STOPPED)
        self.svc.metrics.success(spelled(FinishReason.STOP, "metrics"))
        self.svc.metrics.e2e.observe(time.monotonic() - self.arrival)
        return Step(finish=FinishReason.STOP)
