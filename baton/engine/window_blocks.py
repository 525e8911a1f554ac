"""Which KV blocks of a sliding-window model no query will read again (so they can be freed).

A window layer attends key j from the query at position i when i - window < j <= i (transformers'
rule, see baton.model.attention). A request's next query sits at position `num_computed_tokens`
and every later one further right, so key j is dead for good once j <= num_computed_tokens - window,
i.e. j < num_computed_tokens + 1 - window. A block is dead when its last position is: the leading
`(num_computed_tokens + 1 - window) // block_size` blocks.

That holds for a block of window layers only. When EVERY layer is a window layer (Mistral) the
request's one table is freed so; a model mixing window and global layers (Gemma 2/3, gpt-oss)
keeps its window layers in tables of their own (baton.model.kv_groups), and those are freed so,
while the global layers' table keeps every block.

A freed block's entry in the request's block table becomes `NULL_BLOCK` (block 0, reserved by the
pool, never handed out, never written, all zeros): positions keep their table index, and the decode
and prefill paths gather block 0 there, under a window mask that never attends it. Freed entries are
always a prefix of the table (the window only moves right; speculative rollback and preemption
touch the tail or the whole table), so how many there are is found by binary search, without any
per-request state to keep in step.
"""

from __future__ import annotations

from bisect import bisect_left

from baton.model.runtime import ModelConfig, kv_groups
from baton.engine.sequence import Sequence

NULL_BLOCK = 0  # the pool's reserved block: a released entry of a block table


def freeable_window(config: ModelConfig) -> int | None:
    """The window if blocks behind it can be freed (every layer is a window layer, or the window
    layers have tables of their own), else None."""
    if config.sliding_window is None or len(config.layer_sliding) != config.num_layers:
        return None
    if kv_groups(config).grouped:
        return config.sliding_window
    if config.num_layers == 0 or not all(config.layer_sliding):
        return None  # a global layer reads every position: nothing is ever out of sight
    return config.sliding_window


def num_dead_blocks(num_computed_tokens: int, window: int, block_size: int) -> int:
    """Leading blocks no query at a position >= num_computed_tokens attends (see the module doc)."""
    return max(0, (num_computed_tokens + 1 - window) // block_size)


def num_released(block_table: list[int]) -> int:
    """How many leading entries are released (NULL_BLOCK): O(log n), the entries being a prefix."""
    return bisect_left(range(len(block_table)), True, key=lambda i: block_table[i] != NULL_BLOCK)


def may_release(seq: Sequence) -> bool:
    """Whether a request's dead blocks may be freed before it ends. Not for a prefill worker's
    request (`remote_decode`: its prompt's blocks are encoded into the handoff when it finishes),
    a pooling request (its blocks are freed as soon as its prompt is done anyway), or one asking
    for prompt logprobs (kept whole, as it is kept out of the prefix cache and the store: a rare
    path left exactly as it was)."""
    return (not seq.remote_decode and seq.pooling is None
            and seq.sampling_params.prompt_logprobs is None)
