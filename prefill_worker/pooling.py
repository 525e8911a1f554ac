"""The prefill worker's embeddings batches: fed to the engine a step's budget at a time, round robin.

An embeddings HTTP request is ONE stream message (`PrefillRequest.inputs`: every input's token ids),
not one per input: 16 requests of 2048 inputs used to be 32k stream entries that every chat prompt
behind them waited out (issue 38). The engine's queue is FIFO, so handing it all of a batch's inputs
at once would hold every later chat prompt just the same; instead `feed` tops the engine up before
each step with a short step's worth of pooling inputs (`--pooling-step-tokens`), and with only one
while generation prompts are in the engine (the core's `feed` decides), taking one input from each
batch in turn (a small request is not stuck behind a big one). A chat prompt arriving behind a big
batch therefore waits for the short embeddings step that is running, then is computed alone in the
next one; the worker keeps reading its stream meanwhile (a batch holds no seat until its inputs are
in the engine), and every batch it holds gets an input in turn (its vectors keep coming: no gap
reaches the gateway's `event_timeout`).

Each finished input's vector leaves in its own token event (`index`: the input's place); the event
that completes a batch says STOP, and the batch's message is acked with it, in the same MULTI/EXEC.
A worker that dies mid-batch leaves the message pending: a peer claims it and computes the whole
batch again (the gateway keeps the first vector of each index). No I/O here: effects out.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from baton.common import protocol
from baton.common.finish_reason import FinishReason
from baton.common.logs import request_extra
from baton.common.tracing import RequestSpans
from baton.engine.llm_engine import LLMEngine
from baton.engine.outputs import EngineOutput
from baton.engine.pooling import Pooling
from baton.worker.core import Effects
from baton.worker.metrics import WorkerMetrics

logger = logging.getLogger("baton.prefill")


def inputs_of(request: protocol.PrefillRequest) -> list[list[int]]:
    """A pooling request's inputs: its batch, or (an older sender's) its one prompt."""
    return request.inputs or [request.prompt_token_ids]


@dataclass(eq=False)
class Batch:
    message_id: bytes
    request: protocol.PrefillRequest
    inputs: list[list[int]]
    admitted: float  # time.time() when this worker took it (the prefill-time metric)
    next_input: int = 0  # inputs[:next_input] have been given to the engine
    num_done: int = 0
    in_engine: set[int] = field(default_factory=set)  # indices of its inputs the engine holds


class PoolingBatches:
    def __init__(self, engine: LLMEngine, worker_id: str, metrics: WorkerMetrics, spans: RequestSpans) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.metrics = metrics
        self.spans = spans  # tracing: each batch's "prefill" span, from admission to its end
        self.batches: dict[str, Batch] = {}  # by request id
        self.turns: deque[Batch] = deque()  # batches with inputs left to feed, next one first
        self.by_engine_id: dict[str, tuple[Batch, int]] = {}  # engine request id -> (batch, input)
        self.tokens_in_engine = 0  # prompt tokens of the inputs the engine holds

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.batches

    def __len__(self) -> int:
        return len(self.batches)

    @property
    def seqs_in_engine(self) -> int:
        return len(self.by_engine_id)

    def add(self, message_id: bytes, request: protocol.PrefillRequest) -> Effects:
        inputs = inputs_of(request)
        if not inputs or not all(inputs):
            return self._error(message_id, request, "an embeddings batch needs non-empty inputs")
        batch = Batch(message_id, request, inputs, time.time())
        self.batches[request.request_id] = batch
        self.turns.append(batch)
        self.spans.begin(request.request_id, "prefill", request.trace_context, **{
            "baton.worker_id": self.worker_id, "baton.client_request_id": request.client_request_id,
            "baton.prompt_tokens": sum(map(len, inputs)), "baton.inputs": len(inputs)})
        logger.debug("embeddings batch %s: %d inputs, %d tokens", request.request_id, len(inputs),
                     sum(map(len, inputs)), extra=request_extra(request.request_id))
        return Effects()

    def feed(self, max_tokens: int, max_seqs: int) -> Effects:
        """Give the engine inputs, one per batch in turn, while they fit in `max_tokens` prompt
        tokens and `max_seqs` requests (counting those it holds already). When it holds none, one
        input goes in whatever its length (the engine chunks it), so every batch advances."""
        effects = Effects()
        while self.turns:
            batch = self.turns[0]
            index = batch.next_input
            ids = batch.inputs[index]
            if self.by_engine_id and (self.tokens_in_engine + len(ids) > max_tokens
                                      or len(self.by_engine_id) >= max_seqs):
                break  # strict turns: the head waits for room, or a long input would never get in
            self.turns.popleft()
            batch.next_input += 1
            request = batch.request
            engine_id = f"{request.request_id}#{index}"
            try:
                self.engine.add_request(engine_id, ids, request.sampling, arrival_time=request.arrival_time,
                                        pooling=Pooling(request.pooling))
            except (ValueError, TypeError) as exc:
                effects.extend(self._fail(batch, f"input {index}: {exc}"))
                continue
            self.by_engine_id[engine_id] = (batch, index)
            batch.in_engine.add(index)
            self.tokens_in_engine += len(ids)
            if batch.next_input < len(batch.inputs):
                self.turns.append(batch)
        return effects

    def owns(self, engine_id: str) -> bool:
        return engine_id in self.by_engine_id

    def on_output(self, out: EngineOutput, effects: Effects) -> None:
        """One of the batches' inputs finished (or failed) in this step."""
        if not out.finished:
            return
        batch, index = self._forget(out.request_id)
        if out.finish_reason is FinishReason.ERROR or out.embedding is None:
            effects.extend(self._fail(batch, f"input {index}: {out.error or 'no embedding came out'}"))
            return
        self.metrics.prompt_tokens.inc(out.num_prompt_tokens)
        self.metrics.prefix_cache_queries.inc(out.num_prompt_tokens)
        self.metrics.prefix_cache_hits.inc(out.num_cached_tokens)
        batch.num_done += 1
        done = batch.num_done == len(batch.inputs)
        request = batch.request
        effects.add_event(request.gateway_id, protocol.TokenEvent(
            request.request_id, index, [], [], finish_reason=FinishReason.STOP if done else None,
            num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
            worker_id=self.worker_id, embedding=protocol.pack_embedding(out.embedding)))
        if done:
            del self.batches[request.request_id]
            self.spans.end(request.request_id)
            self.metrics.request_prefill_time.observe(time.time() - batch.admitted)
            self.metrics.finished(FinishReason.STOP)
            effects.acks.append(batch.message_id)

    def drop(self, request_id: str) -> Batch | None:
        """Remove a batch (cancelled, its gateway gone): its inputs leave the engine; the caller acks."""
        batch = self.batches.pop(request_id, None)
        if batch is None:
            return None
        self.spans.end(request_id, "dropped")
        if batch in self.turns:
            self.turns.remove(batch)
        engine_ids = [f"{request_id}#{index}" for index in batch.in_engine]
        for engine_id in engine_ids:
            self._forget(engine_id)
        self.engine.abort(engine_ids)
        return batch

    def _forget(self, engine_id: str) -> tuple[Batch, int]:
        batch, index = self.by_engine_id.pop(engine_id)
        batch.in_engine.discard(index)
        self.tokens_in_engine -= len(batch.inputs[index])
        return batch, index

    def _fail(self, batch: Batch, error: str) -> Effects:
        """End a whole batch with an error event and ack it (one failed input fails the request)."""
        self.spans.end(batch.request.request_id, error)
        self.drop(batch.request.request_id)
        return self._error(batch.message_id, batch.request, error)

    def _error(self, message_id: bytes, request: protocol.PrefillRequest, error: str) -> Effects:
        logger.error("embeddings batch %s failed: %s", request.request_id, error, extra=request_extra(request.request_id))
        effects = Effects(acks=[message_id])
        effects.add_event(request.gateway_id, protocol.TokenEvent(
            request.request_id, 0, [], [], finish_reason=FinishReason.ERROR, error=error, worker_id=self.worker_id))
        self.metrics.finished(FinishReason.ERROR)
        return effects
