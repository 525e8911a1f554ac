"""The prefill worker's loop.

Each iteration: apply cancels, take new prompts from `baton:prefill` while the engine has room, run
one engine step (chunks of prompts up to `--max-num-batched-tokens`, so one long prompt never holds
a step past the budget), and for every prompt that finished its prefill: publish its first token
(TTFT), write its full blocks and its partial last block to the store, XADD the handoff to
`baton:decode`, and only then XACK the prefill message — all in one pipelined round trip, in that
order. A prefill worker that dies before the ack leaves the message pending; a live one claims it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict

from baton import protocol
from baton.engine import StepOutput
from baton.kv_transfer import encode_seq_blocks, warm_prefix
from baton.sampling import SamplingParams
from baton.sequence import Sequence
from baton.worker_base import WorkerBase
from baton.worker_runtime import claim_from_dead, dead_letter, read_group

logger = logging.getLogger("baton.prefill")

MAX_DELIVERIES = 3


class PrefillWorker(WorkerBase):
    kind = "prefill"
    stream = protocol.PREFILL_STREAM
    group = protocol.PREFILL_GROUP

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        # request id -> (stream message id, request, admission time)
        self.in_flight: dict[str, tuple[bytes, protocol.PrefillRequest, float]] = {}
        # Hashes known to be in the store (written or fetched here): not sent again.
        self.stored_hashes: OrderedDict[str, None] = OrderedDict()
        self.num_blocks_fetched = 0
        self.num_prefix_hit_tokens = 0
        self.num_finished = 0

    def num_in_flight(self) -> int:
        return len(self.in_flight)

    def state(self) -> dict:
        pool = self.engine.pool
        return {"queue_depth": len(self.engine.scheduler.waiting),
                "num_requests_running": len(self.in_flight),
                "num_kv_blocks_total": pool.num_usable_blocks, "num_kv_blocks_used": pool.num_used_blocks,
                "block_size": pool.block_size, "num_blocks_fetched": self.num_blocks_fetched,
                "num_prefix_hit_tokens": self.num_prefix_hit_tokens, "num_requests_finished": self.num_finished}

    async def iteration(self, accept_new: bool) -> None:
        for request_id in self.cancels.pop_new():
            await self._cancel(request_id)
        if accept_new:
            await self._accept_new()
        if not self.engine.has_unfinished():
            return
        started = time.perf_counter()
        num_batched = sum(s.num_tokens - s.num_computed_tokens for s in self.engine.scheduler.running)
        outputs = await asyncio.to_thread(self.engine.step)
        self.metrics.step_seconds.observe(time.perf_counter() - started)
        self.metrics.iteration_tokens.observe(max(1, num_batched))
        self.metrics.num_requests_running.set(len(self.engine.scheduler.running))
        self.metrics.num_requests_waiting.set(len(self.engine.scheduler.waiting))
        self.metrics.kv_cache_usage_perc.set(self.engine.pool.usage())
        await self._publish(outputs)

    async def _accept_new(self) -> None:
        scheduler = self.engine.scheduler
        room = self.args.max_num_seqs - len(self.in_flight)
        # Keep only a short local queue: the rest stays in the stream for other prefill workers.
        if room <= 0 or len(scheduler.waiting) >= 2:
            return
        block_ms = None if self.engine.has_unfinished() else 100
        messages = [(mid, fields, 1) for mid, fields in await read_group(
            self.redis, protocol.PREFILL_STREAM, protocol.PREFILL_GROUP, self.worker_id, min(room, 4), block_ms)]
        if time.monotonic() - self.last_claim > 1.0:
            self.last_claim = time.monotonic()
            messages += await claim_from_dead(self.redis, protocol.PREFILL_STREAM, protocol.PREFILL_GROUP,
                                              self.worker_id, self.kind, self.args.claim_idle_ms)
        for message_id, fields, deliveries in messages:
            await self._admit(message_id, fields, deliveries)

    async def _admit(self, message_id: bytes, fields: dict, deliveries: int) -> None:
        try:
            request = protocol.decode(fields[protocol.PAYLOAD_FIELD], protocol.PrefillRequest)
        except (protocol.MalformedMessage, KeyError) as exc:
            self.metrics.dead_letters.inc()
            await dead_letter(self.redis, protocol.PREFILL_STREAM, protocol.PREFILL_GROUP, message_id, fields, str(exc))
            return
        if self.cancels.is_cancelled(request.request_id) or request.request_id in self.in_flight:
            await self.redis.xack(protocol.PREFILL_STREAM, protocol.PREFILL_GROUP, message_id)
            return
        if deliveries > MAX_DELIVERIES:
            await self.fail_request(message_id, request.request_id, request.gateway_id,
                                    len(request.prompt_token_ids), 0, f"prefill failed after {deliveries - 1} attempts")
            return
        try:
            params = SamplingParams(**dataclasses.asdict(request.sampling))
            seq = Sequence(request.request_id, request.prompt_token_ids, params, arrival_time=request.arrival_time)
            warm = await warm_prefix(self.engine, self.store, request.prompt_token_ids)
            self.engine.add_request(seq)
        except (ValueError, TypeError) as exc:
            await self.fail_request(message_id, request.request_id, request.gateway_id,
                                    len(request.prompt_token_ids), 0, str(exc))
            return
        self.metrics.blocks_fetched.inc(warm.num_fetched)
        self.num_blocks_fetched += warm.num_fetched
        self.metrics.bytes("fetched", warm.bytes_fetched)
        bs = self.engine.pool.block_size
        hashes = seq.block_hashes(bs, self.engine.model_config.model_id)
        for block_hash in hashes[warm.num_local:warm.num_local + warm.num_fetched]:
            self._remember_stored(block_hash)
        self.in_flight[request.request_id] = (message_id, request, time.time())

    async def _cancel(self, request_id: str) -> None:
        entry = self.in_flight.pop(request_id, None)
        if entry is None:
            return
        self.engine.abort_request(request_id)
        await self.redis.xack(protocol.PREFILL_STREAM, protocol.PREFILL_GROUP, entry[0])
        self.metrics.finished("cancelled")
        logger.info("cancelled request %s", request_id)

    def _remember_stored(self, block_hash: str) -> None:
        self.stored_hashes[block_hash] = None
        self.stored_hashes.move_to_end(block_hash)
        while len(self.stored_hashes) > 100_000:
            self.stored_hashes.popitem(last=False)

    async def _publish(self, outputs: list[StepOutput]) -> None:
        if not outputs:
            return
        # MULTI/EXEC: a worker dying mid-write leaves either everything (first token, blocks,
        # handoff, ack) or nothing, never a handoff without its ack (which would decode twice).
        pipe = self.redis.pipeline(transaction=True)
        acked: list[str] = []
        for out in outputs:
            seq = out.seq
            entry = self.in_flight.pop(seq.seq_id, None)
            if entry is None:
                continue
            message_id, request, admitted = entry
            num_prompt = seq.num_prompt_tokens
            self.metrics.prompt_tokens.inc(num_prompt)
            self.metrics.prefix_cache_queries.inc(num_prompt)
            self.metrics.prefix_cache_hits.inc(seq.num_cached_tokens)
            self.num_prefix_hit_tokens += seq.num_cached_tokens
            self.num_finished += 1
            self.metrics.request_prefill_time.observe(time.time() - admitted)
            event = protocol.TokenEvent(
                seq.seq_id, 0, out.new_token_ids, out.new_logprobs,
                finish_reason=seq.finish_reason if out.finished else None,
                error="the request does not fit in the KV pool" if seq.finish_reason == "error" else None,
                num_prompt_tokens=num_prompt, num_cached_tokens=seq.num_cached_tokens, worker_id=self.worker_id)
            self.queue_event(pipe, request.gateway_id, event)
            if out.finished:  # EOS as the first token, max_tokens=1, or an error: no handoff
                self.metrics.generation_tokens.inc(len(out.new_token_ids))
                self.metrics.finished(seq.finish_reason or "stop")
            else:
                self.metrics.generation_tokens.inc(1)
                full, partial = encode_seq_blocks(self.engine, seq, num_prompt, self.stored_hashes)
                for block_hash, value in full:
                    self.store.queue_put_block(pipe, block_hash, value)
                    self._remember_stored(block_hash)
                    self.metrics.bytes("written", len(value))
                self.metrics.blocks_written.inc(len(full))
                self.metrics.blocks_computed.inc(num_prompt // self.engine.pool.block_size - seq.num_cached_tokens // self.engine.pool.block_size)
                if partial is not None:
                    self.store.queue_put_partial(pipe, seq.seq_id, partial)
                    self.metrics.bytes("written", len(partial))
                sampling = dataclasses.replace(request.sampling, seed=seq.sampling_params.seed)
                handoff = protocol.Handoff(
                    request_id=seq.seq_id, gateway_id=request.gateway_id, prompt_token_ids=seq.prompt_token_ids,
                    output_token_ids=seq.output_token_ids, block_hashes=seq.block_hashes(self.engine.pool.block_size, self.engine.model_config.model_id)[:num_prompt // self.engine.pool.block_size],
                    partial_block_key=seq.seq_id if partial is not None else None, sampling=sampling,
                    arrival_time=request.arrival_time, first_token_time=seq.first_token_time or time.time())
                pipe.xadd(protocol.DECODE_STREAM, {protocol.PAYLOAD_FIELD: protocol.encode(handoff)},
                          maxlen=protocol.STREAM_MAXLEN, approximate=True)
                self.engine.scheduler.finish(seq, "handoff")
            pipe.xack(protocol.PREFILL_STREAM, protocol.PREFILL_GROUP, message_id)
            acked.append(seq.seq_id)
        await pipe.execute()
