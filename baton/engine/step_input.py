"""The scheduler's plan as the model layer's input: one plain row per scheduled request.

The engine's requests stay in the engine: a row carries only what the forward pass reads (tokens,
positions, block table, the outputs wanted), and results come back keyed by request id.
"""

from __future__ import annotations

from baton.engine.sequence import Sequence
from baton.engine.speculator import proposals_of
from baton.model.runtime import StepBatch, step_row


def build_step_batch(scheduled: list[tuple[Sequence, int]]) -> StepBatch:
    """The rows of (request, tokens to compute) pairs, in the plan's order."""
    rows = []
    for seq, num_new in scheduled:
        start = seq.num_computed_tokens
        pooled = seq.pooling.positions(start, start + num_new) if seq.pooling is not None else None
        asks_prompt_logprobs = seq.sampling_params.prompt_logprobs is not None
        rows.append(step_row(seq.seq_id, seq.token_ids, start, num_new, seq.block_table, proposals=proposals_of(seq),
                             num_prompt_tokens=seq.num_prompt_tokens if asks_prompt_logprobs else None,
                             pooled=pooled, window_tables=seq.window_tables))
    return StepBatch(tuple(rows))
