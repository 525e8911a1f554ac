"""Iteration-level scheduler (Orca, vLLM): it re-forms the batch every step.

`schedule()` decides what runs this step and returns a plain `SchedulerOutput`; the engine runs the
model and then calls `update_from_output()` with the sampled tokens, which advances the counts,
caches full blocks, checks stops, and finishes and frees requests. The scheduler owns every request's
whole life and is the only party that allocates or frees its blocks.

Running requests are served first (decode tokens and unfinished prefill chunks), then waiting
requests are admitted in strict FIFO order while `max_num_seqs`, the step's token budget
`max_num_batched_tokens` and the KV pool allow. A prompt longer than the remaining budget is split
across steps (chunked prefill, Sarathi-Serve). A request whose leading tokens' KV is in the block
store (the KV connector says how much) is admitted with blocks for those tokens too and waits in
WAITING_FOR_KV until the engine reports the load; it then runs from the valid prefix.

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

from baton.engine.block_manager import BlockManager, blocks_for
from baton.common.finish_reason import FinishReason
from baton.engine.sequence import Sequence, SequenceStatus
from baton.engine.kv_connector import KVConnectorScheduler
from baton.engine.kv_types import KVLoad
from baton.engine.speculative_config import SpeculativeConfig
from baton.engine.speculator import DraftJob, Speculator, proposals_of

logger = logging.getLogger("baton.engine.scheduler")

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
    kv_loads: list[KVLoad] = field(default_factory=list)  # for requests admitted into WAITING_FOR_KV
    failed: list[Sequence] = field(default_factory=list)  # finished with an error by this schedule
    draft: DraftJob | None = None  # what a draft model computes before the step runs (the engine runs it)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass
class StepOutput:
    """What one step changed for one request, inside the engine (which turns it into a frozen
    `EngineOutput` for its callers)."""

    seq: Sequence
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[list] = field(default_factory=list)  # one per new token, when asked for
    finished: bool = False


# A speculating row's step result: (request, token per position, logprob per position, top per position)
Verified = tuple[Sequence, list[int], list[float], list[list]]


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 eos_token_ids: list[int] | None = None, connector: KVConnectorScheduler | None = None,
                 speculative: SpeculativeConfig | None = None) -> None:
        self.config = config
        # proposes, reserves and rolls back speculative tokens (None: speculation off)
        self.speculator = (Speculator(speculative, block_manager, config.max_model_len)
                           if speculative is not None else None)
        self.block_manager = block_manager
        self.eos_token_ids = set(eos_token_ids or [])
        self.connector = connector
        self.waiting: deque[Sequence] = deque()  # hold no blocks
        self.running: list[Sequence] = []  # in admission order: the last one is the newest
        self.loading: dict[str, Sequence] = {}  # WAITING_FOR_KV, in admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        limit = self.config.max_model_len
        if seq.num_tokens >= limit:
            raise ValueError(f"request {seq.seq_id} has {seq.num_tokens} tokens; the model holds {limit}")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    @property
    def num_admitted(self) -> int:
        """Requests holding blocks: running or loading their KV (what `max_num_seqs` bounds)."""
        return len(self.running) + len(self.loading)

    def abort(self, seq_id: str) -> Sequence | None:
        """Remove a request wherever it is and free its blocks; returns it, or None if unknown."""
        seq = self.loading.pop(seq_id, None)
        if seq is not None:  # its load result, when it comes, is dropped (`finish_kv_load`)
            self._finish(seq, FinishReason.CANCELLED)
            return seq
        for seq in self.running:
            if seq.seq_id == seq_id:
                self.running.remove(seq)
                self._finish(seq, FinishReason.CANCELLED)
                return seq
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                self._finish(seq, FinishReason.CANCELLED)
                return seq
        return None

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = bm.chunk_size(seq, min(seq.num_tokens - seq.num_computed_tokens, budget))
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
        if not out.scheduled and not self.running and not self.loading and self.waiting:
            # Nothing runs or loads, so every block not cached is free, and the head of the queue
            # still does not fit: it never will. End it with an error (it holds no blocks).
            seq = self.waiting.popleft()
            self._finish(seq, FinishReason.ERROR)
            seq.error = "the request does not fit in this worker's KV pool"
            out.failed.append(seq)
            logger.error("request %s needs more KV blocks than the pool has", seq.seq_id)
        if self.speculator is not None and out.scheduled:
            leftover = self.config.max_num_batched_tokens - out.num_batched_tokens
            out.scheduled, out.draft = self.speculator.plan(out.scheduled, leftover, len(self.running))
        # Decode tokens (one per request) first: the model batches them in one padded attention.
        out.scheduled.sort(key=lambda item: item[1] != 1)
        for seq, _ in out.scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.time()
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and self.num_admitted < self.config.max_num_seqs:
            seq = self.waiting[0]
            assert not seq.block_table and seq.num_computed_tokens == 0, "waiting requests hold no blocks"
            # (pooling over every token needs the rows a cache hit would skip: computed anew)
            every_row = seq.pooling is not None and seq.pooling.pooling.needs_every_token
            computed = [] if every_row else bm.get_computed_blocks(seq)
            num_local = len(computed) * bm.block_size
            num_external = self.connector.get_num_new_matched_tokens(seq, num_local) if self.connector else 0
            remaining = seq.num_tokens - num_local
            # Blocks for the whole remaining prompt (external tokens included) are taken now, even
            # when only its first chunk runs this step: a request admitted for a chunk and then
            # starved of blocks for the next one would preempt itself, be re-admitted, and redo
            # that chunk again (thrash).
            to_take = bm.num_blocks_to_take(seq, remaining, computed)
            if not self._head_fits(seq, computed, to_take):
                break  # strict FIFO: the head waits for room, nobody overtakes it
            if bm.allocate_slots(seq, remaining, computed) is None:
                break
            bm.record_prefix_lookup(seq, computed)
            self.waiting.popleft()
            seq.output_len_at_admission = seq.num_output_tokens
            if num_external:
                assert self.connector is not None
                seq.status = SequenceStatus.WAITING_FOR_KV
                self.loading[seq.seq_id] = seq
                out.kv_loads.append(self.connector.build_load(seq, num_local, num_external))
                continue  # it costs no budget until its KV is here
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_new = bm.chunk_size(seq, min(remaining, budget))
            out.scheduled.append((seq, num_new))
            budget -= num_new

    def finish_kv_load(self, seq_id: str, num_loaded_tokens: int) -> Sequence | None:
        """A load ended with `num_loaded_tokens` valid tokens after the local prefix (0 if it failed;
        the blocks are written): the request runs from there and computes the rest. None if the
        request is no longer loading (cancelled meanwhile: the caller must not write its blocks)."""
        seq = self.loading.pop(seq_id, None)
        if seq is None:
            return None
        assert seq.num_computed_tokens + num_loaded_tokens < seq.num_tokens
        seq.num_computed_tokens += num_loaded_tokens
        seq.num_cached_tokens += num_loaded_tokens
        self.block_manager.num_prefix_hits += num_loaded_tokens
        self.block_manager.cache_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return seq

    def _head_fits(self, seq: Sequence, computed: list[int], to_take: int) -> bool:
        pool = self.block_manager.pool
        if self.config.policy == "no-evict":
            # Reserve the request's whole future; running requests keep their reservations.
            worst = (self._max_blocks(seq) - len(seq.block_table) - len(computed)) * self._tables
            worst += self.block_manager.num_revived(computed)
            return worst <= pool.num_free_blocks - self._reserved_blocks()
        return to_take <= pool.num_free_blocks - self._watermark()

    def _watermark(self) -> int:
        # Keep a block per running request free when admitting (max-utilization), so admitting one
        # more does not force a preemption on the very next decode step.
        return min(self.num_admitted, self.block_manager.pool.num_usable_blocks // 10)

    def _max_blocks(self, seq: Sequence) -> int:
        total = min(seq.num_prompt_tokens + seq.sampling_params.max_tokens, self.config.max_model_len)
        return blocks_for(total, self.block_manager.block_size)

    def _reserved_blocks(self) -> int:
        admitted = [*self.running, *self.loading.values()]
        return sum(max(0, self._max_blocks(s) - len(s.block_table)) for s in admitted) * self._tables

    @property
    def _tables(self) -> int:
        # blocks a position takes: one per table (a model with window tables: `KVGroups`)
        return 1 + self.block_manager.num_window_tables

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
        if seq.pooling is not None:  # its chunks are computed again from the start
            seq.pooling.reset()
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)  # resumes before any newer request is admitted
        out.preempted.append(seq)
        logger.warning("preempted request %s (%d tokens, preemption #%d): %s",
                       seq.seq_id, seq.num_tokens, seq.num_preemptions, reason)

    def update_from_output(self, plan: SchedulerOutput, sampled: list[Sequence], token_ids: list[int],
                           logprobs: list[float], top_logprobs: list[list] | None = None,
                           verified: list[Verified] | None = None) -> list[StepOutput]:
        """Apply a step's results: advance the scheduled requests, register their full blocks,
        append the sampled tokens, finish (and free) the requests that stop, and free the blocks the
        running ones left behind a sliding window (`BlockManager.release_out_of_window`). A `remote_decode`
        request that does not stop finishes with "handoff", keeping its blocks until the engine has
        saved them (`free_finished`). `verified`: the speculating rows' samples, one per position
        (see baton.engine.speculator); their accepted tokens are appended in order, each checked
        for a stop (nothing after a stop is emitted)."""
        bm = self.block_manager
        outputs = []
        for seq, num_new in plan.scheduled:
            if proposals_of(seq):
                continue  # advanced by what it accepts, below
            seq.num_computed_tokens += num_new
            bm.cache_full_blocks(seq)
            if seq.pooling is not None and seq.num_computed_tokens == seq.num_tokens:
                # a pooling request is done once its prompt is: its blocks are freed at once
                self.finish(seq, FinishReason.STOP)
                outputs.append(StepOutput(seq, finished=True))
        now = time.time()
        tops = top_logprobs if top_logprobs is not None else [[] for _ in sampled]
        for seq, token, logprob, top in zip(sampled, token_ids, logprobs, tops):
            outputs.append(self._append(seq, [token], [logprob], [top], now))
        for seq, row_tokens, row_logprobs, row_tops in verified or []:
            assert self.speculator is not None and seq.speculation is not None
            draft, seq.speculation.proposals = seq.speculation.proposals, []
            assert len(row_tokens) == len(draft) + 1
            accepted = self.speculator.num_accepted(draft, row_tokens)
            self.speculator.record(seq, len(draft), accepted)
            n = accepted + 1
            out = self._append(seq, row_tokens[:n], row_logprobs[:n], row_tops[:n], now)
            if not out.finished:
                self.speculator.rollback(seq)
                bm.cache_full_blocks(seq)
            outputs.append(out)
        # Here, once: every row's computed tokens are final for the step (chunks advanced, verify
        # rows rolled back) and its full blocks registered, so no dead block goes unregistered.
        for seq, _ in plan.scheduled:
            if seq.status is SequenceStatus.RUNNING:
                bm.release_out_of_window(seq)
        return outputs

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[float], tops: list[list],
                now: float) -> StepOutput:
        """Append a row's new tokens in order, stopping at the first that ends it."""
        out = StepOutput(seq)
        wants_top = seq.sampling_params.logprobs is not None
        reason = None
        for token, logprob, top in zip(tokens, logprobs, tops):
            seq.append_token(token, logprob)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if wants_top:
                seq.top_logprobs.append(top)
                out.new_top_logprobs.append(top)
            out.new_token_ids.append(token)
            out.new_logprobs.append(logprob)
            reason = self.check_stop(seq)
            if reason is not None:
                self.finish(seq, reason)
                break
        if reason is None and seq.remote_decode:
            self.running.remove(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason = FinishReason.HANDOFF
        out.finished = reason is not None
        return out

    def check_stop(self, seq: Sequence) -> FinishReason | None:
        params = seq.sampling_params
        last = seq.token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            return FinishReason.STOP
        if last in params.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.running.remove(seq)
        self._finish(seq, reason)

    def free_finished(self, seq: Sequence) -> None:
        """Free the blocks a handed-off request kept until they were saved."""
        assert seq.status is SequenceStatus.FINISHED
        self.block_manager.free(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
