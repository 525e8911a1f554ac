"""Iteration-level scheduler (Orca, vLLM): it re-forms the batch every step.

`schedule()` decides what runs this step and returns a plain `SchedulerOutput`; the engine runs the
model and then calls `update()` with the sampled tokens. Running requests are served first (decode
tokens and unfinished prefill chunks), then waiting requests are admitted in strict FIFO order while
`max_num_seqs`, the step's token budget `max_num_batched_tokens` and the KV pool allow. A prompt
longer than the remaining budget is split across steps (chunked prefill, Sarathi-Serve).

Policies when the pool runs out:
- `max-utilization`: admit greedily; when a running request cannot get a block, preempt the newest
  running request (free its blocks, re-queue it at the head; it resumes from its cached prefix).
- `no-evict`: admit a request only if blocks for `prompt + max_tokens` can be reserved beyond what
  running requests may still claim, so no request is ever preempted.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from baton.block_manager import BlockManager, blocks_for
from baton.sequence import Sequence, SequenceStatus

logger = logging.getLogger("baton.scheduler")

POLICIES = ("max-utilization", "no-evict")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    policy: str = "max-utilization"
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"scheduler policy must be one of {POLICIES}, got {self.policy!r}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")


@dataclass
class SchedulerOutput:
    # (request, tokens to compute this step), decode-only requests first
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is the newest
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        limit = self.config.max_model_len
        if seq.num_tokens >= limit:
            raise ValueError(f"request {seq.seq_id} has {seq.num_tokens} tokens; the model holds {limit}")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq_id: str) -> Sequence | None:
        """Remove a request wherever it is and free its blocks; returns it, or None if unknown."""
        for seq in self.running:
            if seq.seq_id == seq_id:
                self.running.remove(seq)
                self._finish(seq, "cancelled")
                return seq
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                self._finish(seq, "cancelled")
                return seq
        return None

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while bm.allocate_slots(seq, num_new) is None:
                victim = self._pick_victim(seq)
                victim_index = self.running.index(victim)
                budget += sum(n for s, n in out.scheduled if s is victim)
                self._preempt(victim, out, reason=f"KV pool exhausted while growing {seq.seq_id}")
                if victim_index < index:
                    index -= 1
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                budget -= num_new
                index += 1
        if not out.preempted:
            self._admit_waiting(out, budget)
        # Decode tokens (one per request) first: the model batches them in one padded attention.
        out.scheduled.sort(key=lambda item: item[1] != 1)
        for seq, _ in out.scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.time()
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            computed = bm.get_computed_blocks(seq)
            remaining = seq.num_tokens - seq.num_computed_tokens - len(computed) * bm.block_size
            num_new = min(remaining, budget)
            # Blocks for the whole remaining prompt are taken now, even when only its first chunk
            # runs this step: a request admitted for a chunk and then starved of blocks for the
            # next one would preempt itself, be re-admitted, and redo that chunk again (thrash).
            to_take = bm.num_blocks_to_take(seq, remaining, computed)
            if not self._head_fits(seq, computed, to_take):
                # Blocks that queued requests hold (a decode worker loads a handoff's KV on
                # arrival) must not starve the head: release them; they come back from the prefix
                # cache, or are recomputed, when those requests' turn comes.
                if self._release_queued_blocks():
                    continue  # look again with the freed blocks (released at most once: terminates)
                break  # strict FIFO: the head waits for room, nobody overtakes it
            if bm.allocate_slots(seq, remaining, computed) is None:
                break
            bm.record_prefix_lookup(seq, computed)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.output_len_at_admission = seq.num_output_tokens
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new

    def _head_fits(self, seq: Sequence, computed: list[int], to_take: int) -> bool:
        pool = self.block_manager.pool
        if self.config.policy == "no-evict":
            # Reserve the request's whole future; running requests keep their reservations.
            worst = self._max_blocks(seq) - len(seq.block_table) - len(computed)
            worst += sum(1 for b in computed if pool.ref_counts[b] == 0)
            return worst <= pool.num_free_blocks - self._reserved_blocks()
        return to_take <= pool.num_free_blocks - self._watermark()

    def spare_blocks(self) -> int:
        """Free blocks that nothing running may still claim: what a newcomer may take now."""
        pool = self.block_manager.pool
        if self.config.policy == "no-evict":
            return pool.num_free_blocks - self._reserved_blocks()
        return pool.num_free_blocks - self._watermark()

    def _release_queued_blocks(self) -> bool:
        """Free the blocks of queued requests behind the head; True if any were freed."""
        released = False
        for queued in list(self.waiting)[1:]:
            if queued.block_table:
                self.block_manager.free(queued)
                released = True
        return released

    def _watermark(self) -> int:
        # Keep a block per running request free when admitting (max-utilization), so admitting one
        # more does not force a preemption on the very next decode step.
        return min(len(self.running), self.block_manager.pool.num_usable_blocks // 10)

    def _max_blocks(self, seq: Sequence) -> int:
        total = min(seq.num_prompt_tokens + seq.sampling_params.max_tokens, self.config.max_model_len)
        return blocks_for(total, self.block_manager.block_size)

    def _reserved_blocks(self) -> int:
        return sum(max(0, self._max_blocks(s) - len(s.block_table)) for s in self.running)

    def _pick_victim(self, growing: Sequence) -> Sequence:
        """The newest running request, skipping ones that have not advanced since their admission
        (preempting those again would thrash), unless nothing else is left."""
        for seq in reversed(self.running):
            if seq is growing or seq.num_output_tokens > seq.output_len_at_admission:
                return seq
        return self.running[-1]

    def _preempt(self, seq: Sequence, out: SchedulerOutput, reason: str) -> None:
        self.running.remove(seq)
        out.scheduled = [(s, n) for s, n in out.scheduled if s is not seq]
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)  # resumes before any newer request is admitted
        out.preempted.append(seq)
        logger.warning("preempted request %s (%d tokens, preemption #%d): %s",
                       seq.seq_id, seq.num_tokens, seq.num_preemptions, reason)

    def finish(self, seq: Sequence, reason: str) -> None:
        self.running.remove(seq)
        self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
