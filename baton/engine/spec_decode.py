"""Speculative decoding inside the scheduler: propose, reserve slots, accept, roll back.

Rules (the scheduler calls these; nothing else touches a request's speculation):
- After a step is scheduled, each decode row (one token due, not a grammar row, not a pooling or
  handed-off one) asks its n-gram index for up to k proposals, capped by the step's leftover token
  budget, its max_tokens and the model's length. The proposals are the row's `spec_token_ids`; the
  row is then scheduled for 1 + k query tokens, whose slots the block manager allocates (it fits
  whole or changes nothing: then the row proposes only what its held blocks already cover, and
  never takes a block another running row may need next step).
- The engine samples every one of the 1 + k positions exactly as a plain step would sample that
  position (the same processed distribution, the same (seed, output position) draw), and the row
  accepts the longest prefix of proposals equal to those samples plus the first sample after it.
  For greedy rows that is "argmax equals the proposal". For sampled rows it is rejection sampling
  for a point-mass draft (Leviathan et al., Chen et al.: accept d with probability p(d), on rejection
  draw from p without d, renormalized), coupled through the row's seeded exponential race: the
  emitted tokens are the very tokens speculation off emits for that seed, so preemption, handoff
  and a crash replay them and the output distribution is the target's.
- `rollback` advances the row's computed tokens by what was accepted only, frees the blocks past
  them (their slots held rejected tokens' KV) and registers in the prefix cache only blocks whose
  every token is accepted (`cache_full_blocks` counts computed tokens only).
- Penalties and logit bias apply per position (position j's history is the tokens plus the first j
  proposals, which is the real history whenever position j is used); min_tokens likewise. Rows with
  a grammar do not speculate in this version (their matcher would have to advance over proposals).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from baton.engine.block_manager import BlockManager, blocks_for
from baton.engine.sequence import Sequence
from baton.engine.spec_config import SpeculativeConfig
from baton.engine.spec_ngram import NgramIndex
from baton.engine.spec_policy import RowSpec, StepCostModel


@dataclass
class SpecStats:
    num_drafts: int = 0  # verify rows
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # index i: drafts whose proposal i was accepted


def verify_rows(seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
    """(request, position j) for every verified position of these speculating requests, in order."""
    return [(seq, j) for seq in seqs for j in range(1 + len(seq.spec_token_ids))]


def is_decode_row(seq: Sequence, num_new: int) -> bool:
    return num_new == 1 and seq.num_computed_tokens + 1 == seq.num_tokens


class Speculator:
    def __init__(self, config: SpeculativeConfig, block_manager: BlockManager, max_model_len: int) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.costs = StepCostModel()
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._step_started = 0.0
        self._step_shape: tuple[int, int, bool] | None = None  # (rows, tokens, verified), decode-only steps

    def eligible(self, seq: Sequence) -> bool:
        p = seq.sampling_params
        return seq.pool is None and not seq.remote_decode and p.structured is None

    def _row(self, seq: Sequence) -> RowSpec:
        if seq.spec is None:
            seq.spec = RowSpec(NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max))
        return seq.spec

    def plan(self, scheduled: list[tuple[Sequence, int]], budget: int, num_running: int) -> list[tuple[Sequence, int]]:
        """The step's rows with proposals added (`budget`: tokens left in the step). Sets each
        speculating row's `spec_token_ids` and takes its slots."""
        decode_only = all(is_decode_row(s, n) for s, n in scheduled)
        proposals: dict[int, list[int]] = {}
        for seq, n in scheduled:
            if budget <= 0 or not is_decode_row(seq, n) or not self.eligible(seq):
                continue
            row = self._row(seq)
            if not row.may_propose():
                continue
            p = seq.sampling_params
            k = min(self.config.num_speculative_tokens, budget,
                    p.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
            if k <= 0:
                continue
            draft = row.index.propose(seq.token_ids, k)  # type: ignore[attr-defined]
            if draft:
                proposals[id(seq)] = draft
                budget -= len(draft)
        rows = len(scheduled)
        tokens = rows + sum(len(d) for d in proposals.values())
        verify = bool(proposals)
        if verify and decode_only:
            expected = sum(seq.spec.acceptance * len(proposals[id(seq)])
                           for seq, _ in scheduled if id(seq) in proposals)
            verify = self.costs.should_verify(rows, tokens, expected)
        if not verify:
            self._step_shape = (rows, rows, False) if decode_only else None
            return scheduled
        out = []
        pool = self.block_manager.pool
        for seq, n in scheduled:
            draft = proposals.get(id(seq), [])
            if draft:
                draft = draft[:self._fits(seq, len(draft), pool.num_free_blocks - num_running)]
            if draft:
                taken = self.block_manager.allocate_slots(seq, 1 + len(draft))
                assert taken is not None  # _fits checked it
                seq.spec_token_ids = draft
                n = 1 + len(draft)
            out.append((seq, n))
        total = sum(n for _, n in out)
        self._step_shape = (rows, total, total > rows) if decode_only else None
        return out

    def _fits(self, seq: Sequence, k: int, spare_blocks: int) -> int:
        """How many of k proposals get slots: all if their blocks leave a block per running row
        free, else those the row's held blocks already cover."""
        bm = self.block_manager
        if bm.num_blocks_to_take(seq, 1 + k, []) <= max(0, spare_blocks):
            return k
        held = len(seq.block_table) * bm.block_size - seq.num_computed_tokens - 1
        return max(0, min(k, held))

    def start_step(self) -> None:
        self._step_started = time.perf_counter()

    def end_step(self) -> None:
        """The step planned last ran: its wall time feeds the cost model (decode-only steps)."""
        if self._step_shape is not None:
            rows, tokens, verified = self._step_shape
            self.costs.observe(rows, tokens, time.perf_counter() - self._step_started, verified)
            self._step_shape = None

    @staticmethod
    def num_accepted(draft: list[int], sampled: list[int]) -> int:
        """The longest prefix of `draft` equal to the samples at its positions."""
        accepted = 0
        while accepted < len(draft) and sampled[accepted] == draft[accepted]:
            accepted += 1
        return accepted

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += proposed
        stats.num_accepted_tokens += accepted
        for i in range(accepted):
            stats.accepted_per_pos[i] += 1
        if seq.spec is not None:
            seq.spec.observe(proposed, accepted)

    def rollback(self, seq: Sequence) -> None:
        """After a verify row's accepted tokens are appended (and it did not finish): only the
        accepted tokens' KV counts; blocks past them are freed."""
        seq.num_computed_tokens = seq.num_tokens - 1
        keep = blocks_for(seq.num_computed_tokens, self.block_manager.block_size)
        extra = seq.block_table[keep:]
        if extra:
            self.block_manager.pool.free(list(reversed(extra)))
            del seq.block_table[keep:]
