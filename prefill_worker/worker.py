"""The prefill worker's I/O shell: its loop around `PrefillCore` and the engine.

Each iteration: apply cancels, take new prompts from `baton:prefill` while the engine has room
(probing the store for their prefix blocks), hand the finished KV loads to the engine, run one
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

    def num_in_flight(self) -> int:
        return len(self.core.in_flight)

    def state(self) -> dict:
        stats = self.stats
        return {**stats.heartbeat(), "queue_depth": stats.num_requests_waiting,
                "num_requests_running": len(self.core.in_flight), "num_free_seqs": stats.num_free_seqs,
                "num_blocks_fetched": self.num_blocks_fetched,
                "num_prefix_hit_tokens": self.core.num_prefix_hit_tokens,
                "num_requests_finished": self.core.num_finished}

    async def iteration(self, accept_new: bool) -> None:
        for request_id in self.cancels.pop_new():
            await self.write(self.core.cancel(request_id))
        await self.gateways.refresh(self.redis)
        for request_id in [r for r in self.core.in_flight if self.gateways.is_gone(self.core.gateway_of(r))]:
            await self.write(self.core.cancel(request_id, "gateway gone"))
        if accept_new:
            if not self.engine.has_unfinished() and not self.pending:
                # nothing to compute: lend before the read blocks (up to 100 ms) for a prompt, or a
                # generation that starts right after this worker's handoff runs its first ~100 ms of
                # decode steps without the lent cores
                self.cores.idle()
            await self._accept_new()
        self.refresh_stats()
        if not self.engine.has_unfinished():
            self.cores.idle()  # lend this worker's cores until it has a prompt again
            return
        await self.wait_for_loads()
        outputs = await self.step()
        effects = self.core.on_step(outputs)
        await self.write_until_done(effects, transaction=True)

    async def _accept_new(self) -> None:
        self.refresh_stats()  # after this turn's cancels
        room = self.stats.num_free_seqs - len(self.pending)
        # Keep only a short local queue: the rest stays in the stream for other prefill workers.
        if room > 0 and self.stats.num_requests_waiting < 2:
            block_ms = None if self.engine.has_unfinished() or self.pending else 100
            for message_id, fields in await read_group(self.redis, self.stream, self.group, self.worker_id,
                                                       min(room, 4), block_ms):
                self.pending.append((message_id, fields, 1))
        self.pending.extend(await self.claim())
        while self.pending:
            message_id, fields, deliveries = self.pending[0]
            request = await self.open(message_id, fields, deliveries)
            if request is not None and self.gateways.is_gone(request.gateway_id):
                # Nobody will read its tokens: a dead gateway's backlog is not prefilled.
                logger.info("request %s: its gateway is gone; dropped unread", request.request_id,
                            extra=request_extra(request.request_id))
                await self.write(Effects(acks=[message_id]))
            elif request is not None:
                # Which of the prompt's blocks the store holds (computed by any prefill worker):
                # the scheduler loads those its local prefix cache lacks instead of computing them.
                hashes = hash_blocks(request.prompt_token_ids, self.engine.block_size, self.engine.model_id)
                # (an embedding request loads nothing from the store: mean and cls pool every row)
                stored = await self.kv.probe(hashes) if not request.pooling else []
                await self.write(self.core.admit(message_id, request, stored, hashes))
            self.pending.popleft()
