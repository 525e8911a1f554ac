"""Which block table each cached layer reads, for models that mix sliding-window and global layers
(Gemma 2/3, gpt-oss, OLMo 3): vLLM v1's hybrid allocator in Baton's terms (docs/design-decisions.md,
decision 21).

One block table for all layers cannot free anything behind a window: the global layers still read
every position. So the layers are split into groups of equal size `g` (the number of global layers):
the global layers are table 0, the window layers tables 1..k (`g` each, the last one padded). The
cache holds `g` layer tensors, and a block id is `g` layers' K and V for `block_size` tokens: each
table's blocks come out of the one pool, and table t's layer at position j reads and writes tensor
j at table t's block ids. All tables of a request have the same length (one entry per block of
positions); a window table's entries behind the window are freed as the request runs (they become
the null block), the global table's never. Gemma 3 (5 window layers to 1 global) at 8k tokens with
a 512-token window then holds 4 + 6 x (512 / block + 1) blocks of 4 layers instead of 8k / block
blocks of 26.

Grouped only when it is sound and pays: some window and some global layers, no more global than
window layers, every cached layer of one shape (Gemma 4's wider global layers keep one table), no
state layers. Llama 4's chunked layers are window layers here: a query sees keys of its own chunk
only, never more than the last `sliding_window` positions, so the sliding rule's dead blocks are
dead for them too (it frees a little later than the chunk rule could). Every other model gets the
one table, `g` = its cached layers (an all-window model frees behind its window in place:
window_blocks).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from baton.model.config import ModelConfig


@dataclass(frozen=True)
class KVGroups:
    group_size: int  # g: layer tensors in the cache (the layers a block id holds)
    table_of: tuple[int, ...]  # per cached layer (attention_layers order): 0 global, 1..k window
    position_of: tuple[int, ...]  # per cached layer: its tensor, in [0, g)

    @property
    def num_tables(self) -> int:
        return 1 + max(self.table_of, default=0)

    @property
    def num_window_tables(self) -> int:
        return self.num_tables - 1

    @property
    def grouped(self) -> bool:
        return self.num_tables > 1

    def layers_of(self, table: int) -> list[int]:
        """Cache-order indices of the layers table `table` serves, by tensor position."""
        return [i for i, t in enumerate(self.table_of) if t == table]


def one_table(num_cached: int) -> KVGroups:
    return KVGroups(num_cached, (0,) * num_cached, tuple(range(num_cached)))


@functools.cache
def _layout(num_cached: int, sliding: tuple[bool, ...]) -> KVGroups:
    num_global = sliding.count(False)
    if num_global == 0 or num_global > len(sliding) - num_global:
        return one_table(num_cached)
    table_of, position_of, seen = [], [], [0, 0]
    for s in sliding:
        n = seen[s]
        seen[s] += 1
        table_of.append(1 + n // num_global if s else 0)
        position_of.append(n % num_global)
    return KVGroups(num_global, tuple(table_of), tuple(position_of))


def kv_groups(config: ModelConfig) -> KVGroups:
    """The layout of `config`'s cache (see the module docstring)."""
    cached = config.attention_layers
    if (config.sliding_window is None or config.layer_head_dim or config.has_state_layers
            or config.kv_lora_rank):
        return one_table(len(cached))
    return _layout(len(cached), tuple(config.is_sliding(i) for i in cached))
