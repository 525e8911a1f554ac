"""The decode worker's continuous-batching loop.

Each iteration: apply cancels (and drop requests of gateways that died), admit the handoffs read
during the previous step (load their blocks from the store into the local pool), then run one
engine step over every running request in a thread while this loop reads the next handoffs from
`baton:decode`, and hand the step's tokens to the publisher task, which writes them (one XADD per
gateway) and acks the handoffs of finished requests while the next step computes. A handoff stays unacked while its request decodes, so a
decode worker that dies leaves it pending: a live one claims it, reloads the prompt's blocks and
regenerates; the gateway drops the tokens it already has (same tokens: greedy is deterministic and
sampling draws are seeded per (seed, position)).

Pulling only when there is room is the load balancer: a busy worker leaves handoffs in the stream,
where an idle worker of the same group takes them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Coroutine
from typing import Any

import msgpack

from baton import heartbeats, protocol
from baton.engine import StepOutput
from baton.kv_transfer import adopt_blocks, warm_prefix
from baton.sampling import SamplingParams
from baton.sequence import Sequence
from baton.worker_base import WorkerBase
from baton.publisher import EventPublisher, Publication
from baton.worker_runtime import REDIS_ERRORS, claim_from_dead, dead_letter, live_gateways, read_group
from kvstore.redis_backend import partial_key

logger = logging.getLogger("baton.decode")

MAX_DELIVERIES = 4
# How many more requests than its least-loaded peer a decode worker may hold and still pull more.
BALANCE_SLACK = 2


@dataclasses.dataclass
class InFlight:
    message_id: bytes
    handoff: protocol.Handoff
    admitted: float
    next_index: int  # output position of the next token the gateway does not have yet


class DecodeWorker(WorkerBase):
    kind = "decode"
    stream = protocol.DECODE_STREAM
    group = protocol.DECODE_GROUP

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.in_flight: dict[str, InFlight] = {}
        self.last_gateway_check = 0.0
        self.num_preemptions_seen = 0
        self.num_finished = 0
        self.num_blocks_fetched = 0
        self.peer_loads: list[int] = []
        self.last_peer_check = 0.0
        self.pending: deque[tuple[bytes, dict, int]] = deque()  # handoffs read, not yet admitted
        self.publisher = EventPublisher(self.redis, self.stream, self.group)

    def background_tasks(self) -> list[Coroutine[Any, Any, None]]:
        return [self.publisher.run()]

    async def flush(self, timeout: float) -> None:
        if not await self.publisher.flush(timeout):
            logger.error("%d steps of tokens could not be published before exit", self.publisher.backlog)

    def num_in_flight(self) -> int:
        return len(self.in_flight)

    def state(self) -> dict:
        pool = self.engine.pool
        scheduler = self.engine.scheduler
        return {"num_kv_blocks_total": pool.num_usable_blocks, "num_kv_blocks_used": pool.num_used_blocks,
                "block_size": pool.block_size, "num_requests_running": len(scheduler.running),
                "num_requests_waiting": len(scheduler.waiting), "num_preemptions": scheduler.num_preemptions,
                "max_num_seqs": scheduler.config.max_num_seqs, "policy": scheduler.config.policy,
                "num_requests_finished": self.num_finished, "num_blocks_fetched": self.num_blocks_fetched}

    async def iteration(self, accept_new: bool) -> None:
        for request_id in self.cancels.pop_new():
            await self._drop(request_id, "cancelled")
        await self._drop_orphans()
        if accept_new:
            await self._admit_pending()
        self._update_gauges()  # also after cancels, when no step follows
        if not self.engine.has_unfinished():
            if accept_new:
                await self._read_new(block_ms=100)  # idle: wait for work
            return
        started = time.perf_counter()
        num_batched = sum(s.num_tokens - s.num_computed_tokens for s in self.engine.scheduler.running)
        # The step runs in a thread; meanwhile this loop reads the next handoffs (the previous
        # step's tokens are being written by the publisher task). Nothing here touches the engine
        # until the step is done: the handoffs read now are admitted at the next iteration.
        step = asyncio.ensure_future(asyncio.to_thread(self.engine.step))
        read_error: BaseException | None = None
        if accept_new:
            try:
                await self._read_new(block_ms=None)
            except REDIS_ERRORS as exc:
                read_error = exc
        outputs = await step
        self.metrics.step_seconds.observe(time.perf_counter() - started)
        self.metrics.iteration_tokens.observe(max(1, num_batched))
        self._update_gauges()
        self._publish(outputs)
        if read_error is not None:
            raise read_error

    def _update_gauges(self) -> None:
        scheduler = self.engine.scheduler
        self.metrics.num_requests_running.set(len(scheduler.running))
        self.metrics.num_requests_waiting.set(len(scheduler.waiting))
        self.metrics.kv_cache_usage_perc.set(self.engine.pool.usage())
        new = scheduler.num_preemptions - self.num_preemptions_seen
        if new:
            self.metrics.num_preemptions.inc(new)
            self.num_preemptions_seen = scheduler.num_preemptions

    async def _refresh_peer_loads(self) -> None:
        if time.monotonic() - self.last_peer_check < 0.5:
            return
        self.last_peer_check = time.monotonic()
        loads = []
        for _key, value in await heartbeats.live(self.redis, self.kind):
            try:
                state = msgpack.unpackb(value)
            except (ValueError, msgpack.ExtraData):
                continue
            if state.get("worker_id") != self.worker_id:
                loads.append(int(state.get("num_requests_running", 0)) + int(state.get("num_requests_waiting", 0)))
        self.peer_loads = loads

    def _my_turn(self) -> bool:
        """Pull-based balancing: a worker much busier than its least-loaded live peer leaves new
        handoffs in the stream for that peer (an idle worker always takes work)."""
        scheduler = self.engine.scheduler
        my_load = len(scheduler.running) + len(scheduler.waiting)
        return my_load == 0 or not self.peer_loads or my_load <= min(self.peer_loads) + BALANCE_SLACK

    async def _read_new(self, block_ms: int | None) -> None:
        """Take handoffs from the stream while there is room (and claim those of dead peers); they
        are admitted into the engine at the start of the next iteration."""
        scheduler = self.engine.scheduler
        room = scheduler.config.max_num_seqs - len(scheduler.running) - len(scheduler.waiting) - len(self.pending)
        await self._refresh_peer_loads()
        if room > 0 and not scheduler.waiting and self._my_turn():
            for message_id, fields in await read_group(self.redis, self.stream, self.group, self.worker_id,
                                                       min(room, 8), block_ms):
                self.pending.append((message_id, fields, 1))
        if time.monotonic() - self.last_claim > 1.0:
            self.last_claim = time.monotonic()
            self.pending.extend(await claim_from_dead(self.redis, self.stream, self.group, self.worker_id,
                                                      self.kind, self.args.claim_idle_ms))

    async def _admit_pending(self) -> None:
        while self.pending:
            message_id, fields, deliveries = self.pending[0]
            await self._admit(message_id, fields, deliveries)
            self.pending.popleft()

    async def _admit(self, message_id: bytes, fields: dict, deliveries: int) -> None:
        try:
            handoff = protocol.decode(fields[protocol.PAYLOAD_FIELD], protocol.Handoff)
        except (protocol.MalformedMessage, KeyError) as exc:
            self.metrics.dead_letters.inc()
            await dead_letter(self.redis, self.stream, self.group, message_id, fields, str(exc))
            return
        request_id = handoff.request_id
        if self.cancels.is_cancelled(request_id) or request_id in self.in_flight:
            await self.redis.xack(self.stream, self.group, message_id)
            return
        num_prompt = len(handoff.prompt_token_ids)
        if deliveries > MAX_DELIVERIES:
            await self.fail_request(message_id, request_id, handoff.gateway_id, num_prompt,
                                    len(handoff.output_token_ids), f"decode failed after {deliveries - 1} attempts")
            return
        try:
            params = SamplingParams(**dataclasses.asdict(handoff.sampling))
            seq = Sequence(request_id, handoff.prompt_token_ids, params, arrival_time=handoff.arrival_time,
                           output_token_ids=handoff.output_token_ids)
            seq.first_token_time = handoff.first_token_time
            warm = await warm_prefix(self.engine, self.store, handoff.prompt_token_ids)
            partial = await self.store.get_partial(request_id) if handoff.partial_block_key else None
            # If a block is missing (evicted, or this is a retry), the scheduler recomputes it here.
            adopted = adopt_blocks(self.engine, seq, num_prompt, partial)
            self.engine.add_request(seq)
        except (ValueError, TypeError) as exc:
            await self.fail_request(message_id, request_id, handoff.gateway_id, num_prompt,
                                    len(handoff.output_token_ids), str(exc))
            return
        self.metrics.blocks_fetched.inc(warm.num_fetched)
        self.num_blocks_fetched += warm.num_fetched
        self.metrics.bytes("fetched", warm.bytes_fetched + (len(partial) if partial else 0))
        self.metrics.handoff_latency.observe(max(0.0, time.time() - handoff.first_token_time))
        if not adopted:
            logger.info("request %s: KV not fully in the store; recomputing the missing part", request_id)
        self.in_flight[request_id] = InFlight(message_id, handoff, time.time(), len(handoff.output_token_ids))

    async def _drop(self, request_id: str, reason: str) -> None:
        entry = self.in_flight.pop(request_id, None)
        if entry is None:
            return
        self.engine.abort_request(request_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xack(self.stream, self.group, entry.message_id)
        pipe.delete(partial_key(request_id))
        await pipe.execute()
        self.metrics.finished(reason)
        logger.info("dropped request %s (%s)", request_id, reason)

    async def _drop_orphans(self) -> None:
        """Requests whose gateway died have nobody to stream to: free their blocks."""
        if not self.in_flight or time.monotonic() - self.last_gateway_check < 2.0:
            return
        self.last_gateway_check = time.monotonic()
        alive = await live_gateways(self.redis)
        if alive is None:
            return
        for request_id, entry in list(self.in_flight.items()):
            if entry.handoff.gateway_id not in alive:
                await self._drop(request_id, "gateway gone")

    def _publish(self, outputs: list[StepOutput]) -> None:
        """Hand this step's token events to the publisher (one XADD per gateway, written while
        the next step runs). Local bookkeeping changes now; the publisher retries until written."""
        if not outputs:
            return
        publication = Publication()
        for out in outputs:
            seq = out.seq
            entry = self.in_flight.get(seq.seq_id)
            if entry is None:
                continue
            first_index = seq.num_output_tokens - len(out.new_token_ids)
            tokens, logprobs = out.new_token_ids, out.new_logprobs
            # After a resume on this worker, tokens the gateway already has are not sent again.
            skip = max(0, entry.next_index - first_index)
            tokens, logprobs = tokens[skip:], logprobs[skip:]
            entry.next_index = max(entry.next_index, seq.num_output_tokens)
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
            if not tokens and not out.finished:
                continue
            event = protocol.TokenEvent(
                seq.seq_id, first_index + skip, tokens, logprobs,
                finish_reason=seq.finish_reason if out.finished else None,
                error="the request does not fit in this worker's KV pool" if seq.finish_reason == "error" else None,
                num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
                worker_id=self.worker_id)
            publication.add(entry.handoff.gateway_id, event)
            if out.finished:
                del self.in_flight[seq.seq_id]
                self.num_finished += 1
                publication.acks.append(entry.message_id)
                publication.finished_ids.append(seq.seq_id)
                self.metrics.finished(seq.finish_reason or "stop")
                self.metrics.request_decode_time.observe(time.time() - entry.admitted)
        self.publisher.submit(publication)
