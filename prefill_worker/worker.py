"""The prefill worker's I/O shell: its loop around `PrefillCore` and the engine.

Each iteration: apply cancels, take new prompts from `baton:prefill` while the engine has room
(probing the store for their prefix blocks), give the engine the next inputs of the embeddings
batches, a short step's worth and none while it holds prompts (prefill_worker/pooling.py: a batch is
one message and takes no seat until its inputs are fed, so the stream is read past it), hand the
finished KV loads to the engine, run one
engine step (chunks of prompts up to `--max-num-batched-tokens`, so one long prompt never holds a
step past the budget), start the loads that step asked for, and write the step's effects in one
MULTI/EXEC: first tokens, blocks, handoffs to `baton:decode`, and only then the acks. A prefill
worker that dies before the ack leaves the message pending; a live one claims it.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from baton.common import protocol
from baton.common.logs import request_extra
from baton.worker.core import Effects
from baton.worker.runtime import read_group
from baton.worker.shell import WorkerShell
from kvstore.hashing import hash_blocks
from prefill_worker.core import PrefillCore

logger = logging.getLogger("baton.prefill")

# Reads of up to 4 messages in one loop turn while they are all embeddings batches (each read that
# finds a prompt ends the turn): bounds the turn, and reaches a prompt behind 60 batches at once.
_MAX_READS_PER_TURN = 16


class PrefillWorker(WorkerShell):
    kind = "prefill"
    stream = protocol.PREFILL_STREAM
    group = protocol.PREFILL_GROUP

    core_class = PrefillCore

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.core: PrefillCore
        # Prompts read from the stream, not yet admitted: one leaves only once admitted (or failed,
        # with that written), so a Redis error mid-admission loses nothing.
        self.pending: deque[tuple[bytes, dict, int]] = deque()
        step_tokens = getattr(self.args, "pooling_step_tokens", None)
        if step_tokens is not None:
            if step_tokens < 1:
                raise ValueError("--pooling-step-tokens must be >= 1")
            self.core.pooling_step_tokens = step_tokens

    def num_in_flight(self) -> int:
        return len(self.core.in_flight) + len(self.core.pooling)

    def has_work(self) -> bool:
        return self.engine.has_unfinished() or bool(self.core.pooling)

    def state(self) -> dict:
        stats = self.stats
        return {**stats.heartbeat(), "queue_depth": stats.num_requests_waiting,
                "num_requests_running": self.num_in_flight(), "num_free_seqs": stats.num_free_seqs,
                "num_blocks_fetched": self.num_blocks_fetched,
                "num_prefix_hit_tokens": self.core.num_prefix_hit_tokens,
                "num_requests_finished": self.core.num_finished}

    async def iteration(self, accept_new: bool) -> None:
        for request_id in self.cancels.pop_new():
            await self.write(self.core.cancel(request_id))
        await self.gateways.refresh(self.redis)
        for request_id in [r for r in self.core.request_ids() if self.gateways.is_gone(self.core.gateway_of(r))]:
            await self.write(self.core.cancel(request_id, "gateway gone"))
        if accept_new:
            if not self.has_work() and not self.pending:
                # nothing to compute: lend before the read blocks (up to 100 ms) for a prompt, or a
                # generation that starts right after this worker's handoff runs its first ~100 ms of
                # decode steps without the lent cores
                self.cores.idle()
            await self._accept_new()
        # (only a batch whose input the engine refused has effects: its error, already decided)
        await self.write_until_done(self.core.feed())
        self.refresh_stats()
        if not self.engine.has_unfinished():
            self.cores.idle()  # lend this worker's cores until it has a prompt again
            return
        await self.wait_for_loads()
        outputs = await self.step()
        effects = self.core.on_step(outputs)
        await self.write_until_done(effects, transaction=True)

    async def _accept_new(self) -> None:
        """Read prompts while the engine has room. Embeddings batches are read past: one is a
        message that takes no seat until `feed` gives the engine its inputs, and a chat prompt
        queued in the stream behind a run of them must still be reached in this turn."""
        for turn in range(_MAX_READS_PER_TURN):
            self.refresh_stats()  # after this turn's cancels and admissions
            # The embeddings inputs in the engine are this worker's own filler (at most a step's
            # worth, fed behind the prompts): they do not stop it from reading the prompts behind.
            pooling_seqs = self.core.pooling.seqs_in_engine
            room = self.stats.num_free_seqs + pooling_seqs - len(self.pending)
            # Keep only a short local queue: the rest stays in the stream for other prefill workers.
            count = min(room, 4) if self.stats.num_requests_waiting - pooling_seqs < 2 else 0
            read = []
            if count > 0:
                block_ms = None if turn or self.has_work() or self.pending else 100
                read = await read_group(self.redis, self.stream, self.group, self.worker_id, count, block_ms)
                self.pending.extend((message_id, fields, 1) for message_id, fields in read)
            if turn == 0:
                self.pending.extend(await self.claim())
            prompts = await self._admit_pending()
            if count == 0 or len(read) < count or prompts:
                return  # the stream is drained, or there are prompts to compute now

    async def _admit_pending(self) -> int:
        """Open and admit what was read; the number of generation prompts admitted."""
        prompts = 0
        while self.pending:
            message_id, fields, deliveries = self.pending[0]
            request = await self.open(message_id, fields, deliveries)
            if request is not None and self.gateways.is_gone(request.gateway_id):
                # Nobody will read its tokens: a dead gateway's backlog is not prefilled.
                logger.info("request %s: its gateway is gone; dropped unread", request.request_id,
                            extra=request_extra(request.request_id))
                await self.write(Effects(acks=[message_id]))
            elif request is not None and request.pooling:
                # (an embeddings batch loads nothing from the store: mean and cls pool every row)
                await self.write(self.core.admit(message_id, request, []))
            elif request is not None:
                # Which of the prompt's blocks the store holds (computed by any prefill worker):
                # the scheduler loads those its local prefix cache lacks instead of computing them.
                hashes = hash_blocks(request.prompt_token_ids, self.engine.block_size, self.engine.model_id,
                                     cache_salt=request.sampling.cache_salt)
                stored = await self.kv.probe(hashes)
                await self.write(self.core.admit(message_id, request, stored, hashes))
                prompts += 1
            self.pending.popleft()
        return prompts
