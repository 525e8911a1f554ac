"""How much of a request the draft model's KV cache holds: the speculation policy's side of a
`{"method": "draft_model"}` config (the draft itself runs in baton/engine/drafter.py).

Rules:
- Its KV lives in its own cache, indexed by the target's block ids: a row's draft KV for position p
  sits in the slot the target's block table gives p. So the draft needs no block accounting of its
  own, and the slots of the proposals are the ones the target reserves to verify them.
  Its cache has as many blocks as the target's and counts in the same `kv_cache_memory` budget
  (the engine divides it by the target's plus the draft's bytes per block).
- Proposals need not be right, only likely (the target verifies every one), so the draft's KV may
  be stale anywhere it does not know to be valid: each row keeps a cursor (how many leading
  positions hold its draft KV, and the block ids they were written under). Before proposing, the
  cursor is cut back to the target's computed tokens (rejected proposals' KV is then recomputed)
  and to the leading blocks still in the row's table under the same ids (a preemption, a rollback
  or a handoff's fresh table resets it). The draft then catches up on what it lacks (a handed-off
  prompt: all of it, up to `CATCH_UP_TOKENS` per step; a row that needs more catches up over
  several steps without proposing) and runs k one-token steps, appending its argmax each time.
- The scheduler's speculation policy only reserves the slots (baton/engine/speculator.py); the
  engine runs the draft after the schedule (vLLM's order), and the draft model runs behind the
  model layer's door (`ModelRuntime.propose`), over plain rows.
- Blocks a prefix-cache hit shares were written by the draft of the request that computed them, or
  not at all (a block loaded from the store): a new row's cursor starts at 0, so it never reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from baton.engine.block_pool import blocks_for


CATCH_UP_TOKENS = 512  # draft prefill per step, all rows together: bounds the step a handoff adds


@dataclass
class DraftCursor:
    """How much of a row the draft's cache holds: positions [0, done), written under `blocks`."""

    done: int = 0
    blocks: list[int] = field(default_factory=list)
    preemptions: int = 0  # the row's count when written: a preempted row starts over

    def valid(self, block_table: list[int], num_computed_tokens: int, num_preemptions: int, block_size: int) -> int:
        """Leading positions of a row (its target's block table and counts now) whose draft KV is
        in the cache (or need not be: blocks the target released, out of every window, hold the
        reserved block 0, which nothing may write; the draft reads zeros there)."""
        released = 0
        while released < len(block_table) and block_table[released] == 0:
            released += 1
        done = min(self.done, num_computed_tokens) if self.preemptions == num_preemptions else 0
        for index in range(released, blocks_for(done, block_size)):
            if index >= len(block_table) or block_table[index] != self.blocks[index]:
                done = index * block_size
                break
        return max(done, min(released * block_size, num_computed_tokens))

    def advance(self, done: int, block_table: list[int], num_preemptions: int, block_size: int) -> None:
        """The draft's KV of positions [0, done) is written, under the row's current blocks."""
        self.done, self.preemptions = done, num_preemptions
        self.blocks = list(block_table[:blocks_for(done, block_size)])


@dataclass
class MtpCursor(DraftCursor):
    """A draft cursor (positions [0, done) hold the head's KV) and the target's hidden states of
    positions [hidden_start, hidden_start + len(hidden)) the head has not read yet."""

    hidden: Any = None  # torch.Tensor [n, hidden] in the head's dtype, or None
    hidden_start: int = 0
    hidden_preemptions: int = 0  # the row's preemption count when they were computed

    @property
    def hidden_end(self) -> int:
        return self.hidden_start + (0 if self.hidden is None else self.hidden.shape[0])

    def record(self, start: int, hidden: torch.Tensor, num_preemptions: int) -> None:
        """The target computed positions [start, start + len(hidden)) with these final hidden states."""
        if self.hidden is not None and num_preemptions == self.hidden_preemptions \
                and self.hidden_start <= start <= self.hidden_end:
            self.hidden = torch.cat([self.hidden[:start - self.hidden_start], hidden])
        else:  # the first, or after a gap (another engine computed the positions between)
            self.hidden, self.hidden_start = hidden, start
        self.hidden_preemptions = num_preemptions

    def valid(self, block_table: list[int], num_computed_tokens: int, num_preemptions: int, block_size: int) -> int:
        """`DraftCursor.valid`, then past any positions no hidden state will come for (they keep what
        the head's cache holds): up to the first unread state, or to the computed tokens. The cursor
        moves there (its blocks those of the row's table now), whether or not the head runs this step."""
        done = super().valid(block_table, num_computed_tokens, num_preemptions, block_size)
        if self.hidden is not None and (self.hidden_preemptions != num_preemptions
                                        or self.hidden_end > num_computed_tokens):
            self.hidden = None  # computed before a preemption: recomputed positions bring their own
        if self.hidden is None:
            done = num_computed_tokens
        elif self.hidden_start > done:
            done = self.hidden_start
        else:
            self._drop_before(done)
            done = done if self.hidden is not None else num_computed_tokens
        self.advance(done, block_table, num_preemptions, block_size)
        return done

    def unread(self, start: int, end: int) -> torch.Tensor:
        assert self.hidden is not None and self.hidden_start <= start and end <= self.hidden_end
        return self.hidden[start - self.hidden_start:end - self.hidden_start]

    def advance(self, done: int, block_table: list[int], num_preemptions: int, block_size: int) -> None:
        """`DraftCursor.advance`; the states of positions before `done` are read (dropped)."""
        super().advance(done, block_table, num_preemptions, block_size)
        self._drop_before(done)

    def _drop_before(self, position: int) -> None:
        if self.hidden is None or position <= self.hidden_start:
            return
        if position >= self.hidden_end:
            self.hidden = None
            return
        self.hidden = self.hidden[position - self.hidden_start:]
        self.hidden_start = position
