"""What the engine and the block store exchange, as plain records (no I/O, no engine state): what a
request brings of the store (`RemoteKV`), what the scheduler asks to load (`KVLoad`), what arrived
(`LoadedKV`), what a handed-off request leaves to save (`KVSave`). Blocks are named by their chained
hash; only the partial last block of a handoff is named by its store key (it has no hash)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class RemoteKV:
    """What the store is believed to hold of a request's leading tokens."""

    block_hashes: tuple[str, ...]  # ids of the leading full blocks, in order
    partial_key: str | None = None  # store key of the partial block right after them (a handoff's)
    num_partial_tokens: int = 0  # tokens in that partial block

    @property
    def num_tokens(self) -> int:
        return self.num_partial_tokens if self.partial_key else 0


@dataclass(frozen=True)
class BlockLoad:
    block_id: int  # the local block to fill
    token_ids: tuple[int, ...]  # the tokens it must hold (re-checked: never trust an id alone)
    block_hash: str | None  # a full block's id; None for the partial block
    partial_key: str | None = None  # the partial block's store key

    def __post_init__(self) -> None:
        assert (self.block_hash is None) != (self.partial_key is None), "a block has a hash or a partial key"


@dataclass(frozen=True)
class KVLoad:
    """Blocks to read from the store into a request's allocated blocks (emitted by the scheduler)."""

    request_id: str
    blocks: tuple[BlockLoad, ...]
    # a hybrid model's state at the end of exactly these blocks' tokens (a handoff's): the load is
    # all or nothing, since the blocks without the state (or a state without all of them) resume nothing
    state_key: str | None = None
    state_token_ids: tuple[int, ...] = ()  # the tokens the state must have been computed over


@dataclass
class LoadedKV:
    """The leading blocks of a `KVLoad` that arrived intact (a failed load has none)."""

    request_id: str
    kv: list[torch.Tensor] = field(default_factory=list)  # [layers, 2, block_size, kv_heads, head_dim] each
    num_tokens: int = 0
    num_bytes: int = 0
    block_hashes: list[str] = field(default_factory=list)  # of the full blocks among them
    num_missing: int = 0  # blocks of the load that did not arrive intact (computed instead)
    num_rejected: int = 0  # of those, the one found unreadable or of the wrong dtype, shape or size
    rejected_keys: list[str] = field(default_factory=list)  # its key: to delete, so a good block can land
    state: dict[str, torch.Tensor] | None = None  # the state of a load with a state_key, when it arrived whole
    num_state_misses: int = 0  # 1 when the load's state was missing, malformed or foreign (all recomputed)


@dataclass(frozen=True)
class KVSave:
    """A handed-off request's blocks to write: full blocks by id, the partial last block by key."""

    full: tuple[tuple[str, bytes], ...] = ()
    partial: tuple[str, bytes] | None = None  # (store key, value)
    refresh: tuple[str, ...] = ()  # ids already in the store: TTL refreshed only
    num_full_blocks: int = 0  # full blocks of the prompt, including those the store already had
    block_hashes: tuple[str, ...] = ()  # ids of those full blocks, in order (the handoff carries them)
    state: tuple[str, bytes] | None = None  # (store key, value): a hybrid's state at the end of the prompt

    @property
    def num_bytes(self) -> int:
        return (sum(len(v) for _, v in self.full) + (len(self.partial[1]) if self.partial else 0)
                + (len(self.state[1]) if self.state else 0))


class PrefixHits(list):
    """A prefix-cache hit: the global table's blocks (the list itself) and, for a model with window
    tables (`BlockManager.num_window_tables`), each index's window-table blocks in `window`."""

    def __init__(self, blocks: list[int] | None = None, window: list[tuple[int, ...]] | None = None) -> None:
        super().__init__(blocks or [])
        self.window: list[tuple[int, ...]] = window or []
