"""A draft model's proposals: k greedy steps of its own over plain rows (`ModelRuntime.propose`).

The draft's KV cache is indexed by the target's block ids, so a row carries the target's block
table; which of its positions already hold the draft's KV (`start`) is the engine's to know
(baton/engine/draft_cursor.py). Proposals need not be right, only likely: the target verifies each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from baton.model.model_runner import StepResult
from baton.model.step_batch import StepBatch, StepRow, step_row


@dataclass(frozen=True, slots=True)
class DraftRow:
    request_id: str
    token_ids: Sequence[int]  # the request's tokens: the last one is computed by nobody yet
    start: int  # leading positions whose draft KV is in the cache
    block_table: Sequence[int]  # the target's, with slots up to position len(token_ids) - 1 + num_proposals
    num_proposals: int  # k


@torch.inference_mode()
def propose_greedy(execute: Callable[[StepBatch], StepResult], rows: Sequence[DraftRow], catch_up: Sequence[StepRow],
                   vocab: int) -> tuple[list[list[int]], int]:
    """k proposals per row (the draft's argmax over the first `vocab` ids, each appended before the
    next step), and how many forwards ran. The first forward computes each row's missing positions
    and the CHUNK rows of `catch_up` (rows that only advance their draft KV this step)."""
    tokens = [list(row.token_ids) for row in rows]
    done = [row.start for row in rows]
    proposals: list[list[int]] = [[] for _ in rows]
    forwards = 0
    for step in range(max((row.num_proposals for row in rows), default=0)):
        active = [i for i, row in enumerate(rows) if row.num_proposals > step]
        batch = [step_row(rows[i].request_id, tokens[i], done[i], len(tokens[i]) - done[i], rows[i].block_table)
                 for i in active]
        result = execute(StepBatch(tuple(batch + (list(catch_up) if step == 0 else []))))
        forwards += 1
        picks = result.logits[:len(result.sampled), :vocab].argmax(dim=-1).tolist()
        chosen = dict(zip(result.sampled, picks))
        for i in active:
            token = chosen[rows[i].request_id]
            done[i] = len(tokens[i])
            tokens[i].append(token)
            proposals[i].append(token)
    if not rows and catch_up:
        execute(StepBatch(tuple(catch_up)))
        forwards += 1
    return proposals, forwards
