"""The decode worker's I/O shell: its continuous-batching loop around `DecodeCore` and the engine.

Each iteration: apply cancels (and drop requests of gateways that died), admit the handoffs read
during the previous step, hand the finished KV loads to the engine, then run one engine step over
every running request in a thread while this loop reads the next handoffs from `baton:decode`, start
the KV loads that step's schedule asked for, and hand the step's effects (tokens, acks) to the
publisher task, which writes them (one XADD per gateway) while the next step computes.

Capacity is pulled, not pushed: a worker reads handoffs only while its engine has free sequence
slots and it is not much busier than its least-loaded live peer, so a busy worker leaves handoffs
in the stream, where an idle worker of the same group takes them (docs/design-decisions.md, "one
capacity ledger").
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Coroutine
from typing import Any

import msgpack

from baton.common import heartbeats, protocol
from baton.worker.publisher import EventPublisher
from baton.worker.runtime import read_group
from baton.worker.shell import WorkerShell
from decode_worker.core import DecodeCore

logger = logging.getLogger("baton.decode")

# How many more requests than its least-loaded peer a decode worker may hold and still pull more.
BALANCE_SLACK = 2


class DecodeWorker(WorkerShell):
    kind = "decode"
    stream = protocol.DECODE_STREAM
    group = protocol.DECODE_GROUP

    core_class = DecodeCore

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.core: DecodeCore
        self.peer_loads: list[int] = []
        self.last_peer_check = 0.0
        self.pending: deque[tuple[bytes, dict, int]] = deque()  # handoffs read, not yet admitted
        self.publisher = EventPublisher(self.redis, self.stream, self.group, self.store)

    def background_tasks(self) -> list[Coroutine[Any, Any, None]]:
        return [self.publisher.run()]

    async def flush(self, timeout: float) -> None:
        if not await self.publisher.flush(timeout):
            logger.error("%d steps of tokens could not be published before exit", self.publisher.backlog)

    def num_in_flight(self) -> int:
        return len(self.core.in_flight)

    def refresh_stats(self) -> None:
        super().refresh_stats()
        stats = self.stats  # speculative decoding's counts (all 0 when it is off)
        self.metrics.spec_decode(stats.spec_num_drafts, stats.spec_num_draft_tokens,
                                 stats.spec_num_accepted_tokens, stats.spec_accepted_per_pos)

    def state(self) -> dict:
        stats = self.stats
        return {**stats.heartbeat(), "num_requests_running": stats.num_requests_running + stats.num_requests_loading_kv,
                "num_free_seqs": stats.num_free_seqs - len(self.pending),
                "num_requests_finished": self.core.num_finished, "num_blocks_fetched": self.num_blocks_fetched}

    async def iteration(self, accept_new: bool) -> None:
        for request_id in self.cancels.pop_new():
            self.publisher.submit(self.core.drop(request_id, "cancelled"))
        await self._drop_orphans()
        if accept_new:
            await self._admit_pending()
        self.refresh_stats()  # after the cancels and admissions, also when no step follows
        if not self.engine.has_unfinished():
            if accept_new:
                await self._read_new(block_ms=100)  # idle: wait for work
            return
        await self.wait_for_loads()
        # Nothing here touches the engine while the step runs: the handoffs read meanwhile are
        # admitted at the next iteration.
        outputs = await self.step(self._read_new(block_ms=None) if accept_new else None)
        self.publisher.submit(self.core.on_step(outputs))

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
            if state.get("worker_id") != self.worker_id and not state.get("draining"):
                loads.append(int(state.get("num_requests_running", 0)) + int(state.get("num_requests_waiting", 0)))
        self.peer_loads = loads

    def _my_turn(self) -> bool:
        """Pull-based balancing: a worker much busier than its least-loaded live peer leaves new
        handoffs in the stream for that peer (an idle worker always takes work)."""
        my_load = self.stats.num_unfinished + len(self.pending)
        return my_load == 0 or not self.peer_loads or my_load <= min(self.peer_loads) + BALANCE_SLACK

    async def _read_new(self, block_ms: int | None) -> None:
        """Take handoffs from the stream while there is room (and claim those of dead peers); they
        are admitted into the engine at the start of the next iteration."""
        # The engine's free sequence slots are the only capacity count here: the same number the
        # heartbeat advertises and the gateway's budget is built from.
        room = self.stats.num_free_seqs - len(self.pending)
        await self._refresh_peer_loads()
        # A queue inside the engine means its KV pool is full: leave new handoffs to the peers.
        if room > 0 and not self.stats.num_requests_waiting and self._my_turn():
            for message_id, fields in await read_group(self.redis, self.stream, self.group, self.worker_id,
                                                       min(room, 8), block_ms):
                self.pending.append((message_id, fields, 1))
        self.pending.extend(await self.claim())

    async def _admit_pending(self) -> None:
        while self.pending:
            message_id, fields, deliveries = self.pending[0]
            handoff = await self.open(message_id, fields, deliveries)
            if handoff is not None:
                await self.write(self.core.admit(message_id, handoff))
            self.pending.popleft()

    async def _drop_orphans(self) -> None:
        """Requests whose gateway is gone have nobody to stream to: free their blocks."""
        if not self.core.in_flight:
            return
        await self.gateways.refresh(self.redis)
        orphans = [rid for rid in self.core.in_flight if self.gateways.is_gone(self.core.gateway_of(rid))]
        if orphans:
            logger.warning("no gateway heartbeat for %.0fs: dropping %d requests", self.gateways.grace_s, len(orphans))
        for request_id in orphans:
            self.publisher.submit(self.core.drop(request_id, "gateway gone"))
