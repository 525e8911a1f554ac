"""Speculative decoding's policy inside the scheduler: propose, reserve slots, accept, roll back.

Rules (the scheduler calls these; the engine runs a draft model's forwards after the schedule,
baton/engine/drafter.py; nothing else touches a request's `Speculation`):
- After a step is scheduled, each decode row (one token due, not a pooling or
  handed-off one) asks its n-gram index for up to k proposals, capped by the step's leftover token
  budget, its max_tokens and the model's length. The proposals are the row's `Speculation.proposals`; the
  row is then scheduled for 1 + k query tokens (a draft model's rows get k placeholders here and
  their proposals from the engine once the schedule is made, in `SchedulerOutput.draft`), whose slots the block manager allocates (it fits
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
  proposals, which is the real history whenever position j is used); min_tokens likewise. A row
  with a grammar proposes only what its matcher accepts, and position j is masked by the matcher's
  state after the first j proposals (baton.engine.structured); with a draft model it does not
  speculate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from baton.engine.block_manager import BlockManager, blocks_for
from baton.engine.draft_cursor import CATCH_UP_TOKENS, DraftCursor, MtpCursor
from baton.engine.ngram_proposer import NgramIndex
from baton.engine.sequence import Sequence
from baton.engine.speculation import Speculation
from baton.engine.speculation_policy import RowPolicy, StepCostModel
from baton.engine.speculative_config import SpeculativeConfig
from baton.engine.structured import StructuredOutput


@dataclass
class DraftJob:
    """What a draft model computes after this step's schedule (the engine runs it): (row, k) rows
    that propose k tokens into their reserved slots, and (row, n) rows that only advance their
    draft KV by n tokens (a long handed-off prompt)."""

    proposing: list[tuple[Sequence, int]] = field(default_factory=list)
    catching_up: list[tuple[Sequence, int]] = field(default_factory=list)


def proposals_of(seq: Sequence) -> list[int]:
    """The request's proposals this step ([] when it does not speculate)."""
    return seq.speculation.proposals if seq.speculation is not None else []


@dataclass
class SpecStats:
    num_drafts: int = 0  # verify rows
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # index i: drafts whose proposal i was accepted


def verify_rows(seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
    """(request, position j) for every verified position of these speculating requests, in order."""
    return [(seq, j) for seq in seqs for j in range(1 + len(proposals_of(seq)))]


def is_decode_row(seq: Sequence, num_new: int) -> bool:
    return num_new == 1 and seq.num_computed_tokens + 1 == seq.num_tokens


class Speculator:
    def __init__(self, config: SpeculativeConfig, block_manager: BlockManager, max_model_len: int) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        # a draft model or the checkpoint's MTP layer proposes (else the n-gram index); the MTP layer
        # reads the target's hidden states (baton/engine/mtp_drafter.py)
        self.drafts = config.method in ("draft_model", "mtp")
        self.reads_hidden = config.method == "mtp"
        self._draft_seconds = 0.0  # the draft's forwards after this step's schedule (part of its cost)
        self.costs = StepCostModel()
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._step_started = 0.0
        self._step_shape: tuple[int, int, bool] | None = None  # (rows, tokens, verified), decode-only steps
        # a model with state layers: how many state slots are free for this step's rows (a verify row
        # borrows one per proposal for the state before it: baton.model.gated_deltanet.StateMeta); None: no limit
        self.spare_states: Callable[[list[Sequence]], int] | None = None

    def eligible(self, seq: Sequence) -> bool:
        # a constrained row speculates with n-gram proposals (cut to what its grammar accepts; each
        # verified position then gets its own mask); a draft model's would need the masks in the
        # draft's own sampling too, so constrained rows do not draft
        structured = seq.sampling_params.structured is not None
        return seq.pooling is None and not seq.remote_decode and not (structured and self.drafts)

    def _row(self, seq: Sequence) -> Speculation:
        if seq.speculation is None:
            proposer = (MtpCursor() if self.reads_hidden else DraftCursor() if self.drafts
                        else NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max))
            seq.speculation = Speculation(RowPolicy(), proposer)
        return seq.speculation

    def _room(self, seq: Sequence, budget: int) -> int:
        """The most proposals a row may make now: k, the step's leftover tokens, its max_tokens
        (the bonus token included) and the model's length."""
        p = seq.sampling_params
        return min(self.config.num_speculative_tokens, budget,
                   p.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)

    def plan(self, scheduled: list[tuple[Sequence, int]], budget: int,
             num_running: int) -> tuple[list[tuple[Sequence, int]], DraftJob | None]:
        """The step's rows with proposals added (`budget`: tokens left in the step), and what a
        draft model must compute for them (None: nothing). Sets each speculating row's proposals
        (a draft model's: k placeholders the engine replaces) and takes their slots."""
        self._draft_seconds = 0.0
        decode_only = all(is_decode_row(s, n) for s, n in scheduled)
        wanted, catch_up = (self._mtp_wants(scheduled, budget) if self.reads_hidden
                            else self._draft_wants(scheduled, budget) if self.drafts
                            else self._ngram_proposals(scheduled, budget))
        rows = len(scheduled)
        verify = bool(wanted)
        if verify and decode_only:
            # how many proposals per row to verify: the measured cost per emitted token decides
            # (fewer per row is cheaper where the kernels are compute-bound at rows * (1 + k))
            speculating = [seq for seq, _ in scheduled if id(seq) in wanted]
            cap = self.costs.choose_cap(rows, [len(wanted[id(seq)]) for seq in speculating],
                                        [self._row(seq).policy.acceptance for seq in speculating])
            wanted = {key: draft[:cap] for key, draft in wanted.items()} if cap else {}
            verify = cap > 0
        if not verify:
            # a row still catching up proposes nothing, but its draft KV advances
            self._step_shape = (rows, rows, False) if decode_only and not catch_up else None
            return scheduled, DraftJob([], catch_up) if catch_up else None
        out, drafting = [], []
        pool = self.block_manager.pool
        spare_states = self.spare_states([seq for seq, _ in scheduled]) if self.spare_states is not None else None
        for seq, n in scheduled:
            draft = wanted.get(id(seq), [])
            if draft:
                draft = draft[:self._fits(seq, len(draft), pool.num_free_blocks - num_running)]
            if draft and spare_states is not None:
                draft = draft[:spare_states]
                spare_states -= len(draft)
            if draft:
                taken = self.block_manager.allocate_slots(seq, 1 + len(draft))
                assert taken is not None  # _fits checked it
                self._row(seq).proposals = draft
                drafting.append((seq, len(draft)))
                n = 1 + len(draft)
            out.append((seq, n))
        total = sum(n for _, n in out)
        self._step_shape = (rows, total, total > rows) if decode_only else None
        # the slots exist now: the draft writes its KV into them when the engine runs it
        return out, DraftJob(drafting, catch_up) if self.drafts else None

    def add_draft_seconds(self, seconds: float) -> None:
        """The draft's forwards for this step's plan took `seconds` (part of the step's cost)."""
        self._draft_seconds += seconds

    def _candidates(self, scheduled: list[tuple[Sequence, int]]) -> list[Sequence]:
        """The step's rows that may speculate: decode rows (one token due) of eligible requests."""
        return [seq for seq, n in scheduled if is_decode_row(seq, n) and self.eligible(seq)]

    def _ngram_proposals(self, scheduled: list[tuple[Sequence, int]],
                         budget: int) -> tuple[dict[int, list[int]], list[tuple[Sequence, int]]]:
        proposals: dict[int, list[int]] = {}
        for seq in self._candidates(scheduled):
            row = self._row(seq)
            if budget <= 0 or not row.policy.may_propose():
                continue
            k = self._room(seq, budget)
            if k <= 0:
                continue
            assert isinstance(row.proposer, NgramIndex)
            draft = StructuredOutput.valid_prefix(seq, row.proposer.propose(seq.token_ids, k))
            if draft:
                proposals[id(seq)] = draft
                budget -= len(draft)
        return proposals, []

    def _draft_wants(self, scheduled: list[tuple[Sequence, int]],
                     budget: int) -> tuple[dict[int, list[int]], list[tuple[Sequence, int]]]:
        """Rows that will propose (as k placeholders, replaced by the draft's tokens once their
        slots exist), and rows that only catch their draft KV up this step (a long handed-off
        prompt: `CATCH_UP_TOKENS` per step, all rows together)."""
        wanted: dict[int, list[int]] = {}
        catch_up: list[tuple[Sequence, int]] = []
        spare = CATCH_UP_TOKENS
        for seq in self._candidates(scheduled):
            row = self._row(seq)
            if budget <= 0 or not row.policy.may_propose():
                continue
            cursor = row.proposer
            assert isinstance(cursor, DraftCursor)
            # cut back to what is valid now: the draft runs the rest before proposing
            cursor.done = cursor.valid(seq.block_table, seq.num_computed_tokens, seq.num_preemptions,
                                       self.block_manager.block_size)
            need = seq.num_tokens - 1 - cursor.done
            if need > spare:
                if spare > 0:
                    catch_up.append((seq, spare))
                    spare = 0
                continue
            k = self._room(seq, budget)
            if k <= 0:
                continue
            spare -= need
            wanted[id(seq)] = [-1] * k
            budget -= k
        return wanted, catch_up

    def mtp_cursors(self, seqs: list[Sequence]) -> list[tuple[Sequence, MtpCursor]]:
        """The requests among `seqs` that may speculate with the MTP layer, with their cursors
        (made at their first step: the head reads their prompt's hidden states as they are computed)."""
        out = []
        for seq in seqs:
            if self.eligible(seq) and not seq.is_finished:
                cursor = self._row(seq).proposer
                assert isinstance(cursor, MtpCursor)
                out.append((seq, cursor))
        return out

    def _mtp_wants(self, scheduled: list[tuple[Sequence, int]],
                   budget: int) -> tuple[dict[int, list[int]], list[tuple[Sequence, int]]]:
        """The MTP layer's rows this step: decode rows whose unread hidden states reach their last
        computed position propose (k placeholders, as a draft model's), and rows with other unread
        states (a prompt being prefilled, a row backing off) only advance the head's KV over them,
        `CATCH_UP_TOKENS` positions a step in all."""
        wanted: dict[int, list[int]] = {}
        catch_up: list[tuple[Sequence, int]] = []
        spare = CATCH_UP_TOKENS
        decode = {id(seq) for seq in self._candidates(scheduled)}
        bs = self.block_manager.block_size
        for seq, _ in scheduled:
            if seq.speculation is None or not isinstance(seq.speculation.proposer, MtpCursor):
                continue
            row, cursor = seq.speculation, seq.speculation.proposer
            cursor.done = cursor.valid(seq.block_table, seq.num_computed_tokens, seq.num_preemptions, bs)
            # positions [done, readable) have their target state and their next token
            readable = min(cursor.hidden_end, seq.num_tokens - 1) if cursor.hidden is not None else cursor.done
            need = readable - cursor.done
            if need <= 0 or need > spare:
                if 0 < spare < need:
                    catch_up.append((seq, spare))
                    spare = 0
                continue
            k = self._room(seq, budget) if budget > 0 and row.policy.may_propose() else 0
            if id(seq) in decode and readable == seq.num_tokens - 1 and k > 0:
                wanted[id(seq)] = [-1] * k
                budget -= k
            else:
                catch_up.append((seq, need))
            spare -= need
        return wanted, catch_up

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
            seconds = time.perf_counter() - self._step_started + self._draft_seconds
            self.costs.observe(rows, tokens, seconds, verified)
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
        if seq.speculation is not None:
            seq.speculation.policy.observe(proposed, accepted)

    def rollback(self, seq: Sequence) -> None:
        """After a verify row's accepted tokens are appended (and it did not finish): only the
        accepted tokens' KV counts; blocks past them are freed."""
        seq.num_computed_tokens = seq.num_tokens - 1
        self.block_manager.truncate(seq, blocks_for(seq.num_computed_tokens, self.block_manager.block_size))
