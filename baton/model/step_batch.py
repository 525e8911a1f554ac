"""What one forward step computes, as plain values: the engine's requests never cross into the model.

A step is a `StepBatch` of `StepRow`s, one per scheduled request, each saying which tokens of the
request are computed at which positions, over which blocks, and which outputs the engine wants back
(a sampled next token, prompt logprobs, pooled hidden states). The engine builds them from its
scheduler's plan; the draft model builds its own for its greedy steps. `step_row` decides a row's
kind the one way both do it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class RowKind(enum.Enum):
    DECODE = "decode"  # the request's last token: one query through the decode kernels, its logits sampled
    VERIFY = "verify"  # a decode row with proposals: 1 + k queries, one logits row per position
    CHUNK = "chunk"  # prompt tokens (a prefill chunk): causal attention over the chunk and the cached prefix


@dataclass(frozen=True, slots=True)
class StepRow:
    request_id: str  # unique within the step; a state layer's slot is keyed by it
    kind: RowKind
    start: int  # the position of tokens[0]: the request's tokens computed before this step
    tokens: Sequence[int]  # computed this step at positions start.. (VERIFY: the last token, then the proposals)
    block_table: Sequence[int]  # the request's block ids (slots of every position computed or read)
    sample: bool = False  # CHUNK: the prompt ends with it: its last position's logits are sampled
    prompt_logprob_rows: int = 0  # CHUNK: logits rows of positions start, start + 1, ... for prompt logprobs
    pooled: range | None = None  # CHUNK: positions whose final hidden states are returned (pooling)
    # the window layers' tables, each as long as block_table (a model mixing window and global
    # layers: baton.model.kv_groups); empty: every layer reads block_table
    window_tables: tuple[Sequence[int], ...] = ()
    # a multi-token-prediction head's rows (baton.model.mtp): the target's hidden state beside each
    # token, a tensor [len(tokens), hidden] in the model's dtype; None: a plain model's row
    hidden: Any = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True, slots=True)
class StepBatch:
    rows: tuple[StepRow, ...]
    # return the final hidden state of every token of every row (`StepResult.row_hidden`): what a
    # multi-token-prediction head reads next to the tokens (baton.model.mtp)
    hidden_states: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(row.tokens) for row in self.rows)


def step_row(request_id: str, token_ids: Sequence[int], start: int, num_new: int, block_table: Sequence[int], *,
             proposals: Sequence[int] = (), num_prompt_tokens: int | None = None,
             pooled: range | None = None, window_tables: Sequence[Sequence[int]] = ()) -> StepRow:
    """The row computing `num_new` tokens of a request whose tokens are `token_ids`, from position
    `start` (its computed tokens). `proposals`: draft tokens verified after its last token (then
    `num_new` is 1 + their count); `num_prompt_tokens`: set when the request asks for prompt logprobs
    (the rows scoring prompt tokens are returned); `pooled`: a pooling request's pooled positions of
    this chunk (it is never sampled); `window_tables`: its window layers' tables (kv_groups)."""
    end = start + num_new
    tables = tuple(window_tables)
    if proposals:
        assert num_new == 1 + len(proposals) and end - len(proposals) == len(token_ids), "a verify row is a decode row"
        return StepRow(request_id, RowKind.VERIFY, start, (token_ids[start], *proposals), block_table,
                       window_tables=tables)
    if pooled is None and num_new == 1 and end == len(token_ids):
        return StepRow(request_id, RowKind.DECODE, start, (token_ids[start],), block_table, window_tables=tables)
    # the logits at position p score the prompt token at p + 1
    scored = max(0, min(end, num_prompt_tokens - 1) - start) if num_prompt_tokens is not None else 0
    return StepRow(request_id, RowKind.CHUNK, start, token_ids[start:end], block_table,
                   sample=pooled is None and end == len(token_ids), prompt_logprob_rows=scored, pooled=pooled,
                   window_tables=tables)
