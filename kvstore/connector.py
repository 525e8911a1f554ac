"""The KV connector: how an engine's scheduler loads blocks from the block store and saves them to it
(vLLM v1's KVConnector shape: a scheduler side without I/O, and the I/O the worker's shell runs).

Loading, in three steps, each owned by one party:
1. The scheduler asks `get_num_new_matched_tokens(seq, num_computed_tokens)`: how many tokens beyond
   the local prefix the store holds. It is side-effect free and answers from what the request
   carries (`seq.remote_kv`: the block ids a prefill worker stored, from the handoff, or those a
   probe of the store found before the request was added).
2. The scheduler allocates blocks for the local and the external tokens in one `allocate_slots`,
   parks the request in WAITING_FOR_KV and puts `build_load(...)` in its output.
3. The worker's shell runs `fetch(store, load, block_shape)` (one MGET; every block's tokens are
   re-checked, and its dtype, shape and size: anyone who can write to Redis can write a block's key,
   and a block of the wrong layout must be a miss, not a crash; it stops at the first missing,
   unreadable, malformed or foreign block) and hands the result to the engine,
   which writes the blocks that arrived and tells the scheduler how many tokens they hold: the
   request resumes from that valid prefix and computes the rest.

Saving: when a prefill worker's request finishes by handoff, the scheduler keeps its blocks until
`build_save` has encoded those the store did not hold (and the partial last block); the shell writes
them, and refreshes the TTL of the others, in the same MULTI/EXEC as the handoff.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from kvstore.redis_backend import block_key, decode_block, encode_block

if TYPE_CHECKING:
    from baton.engine.sequence import Sequence

logger = logging.getLogger("baton.kv_connector")


@dataclass
class RemoteKV:
    """What the store is believed to hold of a request's leading tokens."""

    block_hashes: list[str]  # ids of the leading full blocks, in order
    partial_key: str | None = None  # store key of the partial block right after them (a handoff's)
    num_partial_tokens: int = 0  # tokens in that partial block

    @property
    def num_tokens(self) -> int:
        return self.num_partial_tokens if self.partial_key else 0


@dataclass
class BlockLoad:
    block_id: int  # the local block to fill
    key: str  # its store key
    token_ids: list[int]  # the tokens it must hold (re-checked: never trust an id alone)
    block_hash: str | None  # None for a partial block


@dataclass
class KVLoad:
    """Blocks to read from the store into a request's allocated blocks (emitted by the scheduler)."""

    seq_id: str
    blocks: list[BlockLoad]


@dataclass
class LoadedKV:
    """The leading blocks of a `KVLoad` that arrived intact (a failed load has none)."""

    seq_id: str
    kv: list[torch.Tensor] = field(default_factory=list)  # [layers, 2, block_size, kv_heads, head_dim] each
    num_tokens: int = 0
    num_bytes: int = 0
    block_hashes: list[str] = field(default_factory=list)  # of the full blocks among them
    num_missing: int = 0  # blocks of the load that did not arrive intact (computed instead)
    num_rejected: int = 0  # of those, the one found unreadable or of the wrong dtype, shape or size
    rejected_keys: list[str] = field(default_factory=list)  # its key: to delete, so a good block can land


@dataclass
class KVSave:
    """A handed-off request's blocks to write: full blocks by id, the partial last block by request."""

    full: list[tuple[str, bytes]] = field(default_factory=list)
    partial: bytes | None = None
    refresh: list[str] = field(default_factory=list)  # ids already in the store: TTL refreshed only
    num_full_blocks: int = 0  # full blocks of the prompt, including those the store already had


class BlockReader(Protocol):
    async def get(self, keys: Seq[str]) -> list[bytes | None]: ...


class KVConnector:
    def __init__(self, block_size: int, model_id: str) -> None:
        self.block_size = block_size
        self.model_id = model_id

    # ---- scheduler side: no I/O, no side effects ----

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        """Tokens after the first `num_computed_tokens` (block-aligned local hits) that the store
        holds for `seq`. At least one token is always left to compute: its logits are needed."""
        remote = seq.remote_kv
        if remote is None or seq.sampling_params.prompt_logprobs is not None:
            return 0  # prompt logprobs need every prompt position computed here
        bs = self.block_size
        limit = seq.num_tokens - 1
        num_full = min(len(remote.block_hashes), limit // bs)
        total = num_full * bs
        partial = remote.num_tokens if 0 < remote.num_tokens < bs else 0
        if num_full == len(remote.block_hashes) and partial and total + partial <= limit:
            total += partial
        return max(0, total - num_computed_tokens)

    def build_load(self, seq: Sequence, num_computed_tokens: int, num_external_tokens: int) -> KVLoad:
        """The load for `num_external_tokens` after the local prefix, into the blocks the scheduler
        has just allocated for them."""
        remote = seq.remote_kv
        assert remote is not None and num_computed_tokens % self.block_size == 0
        bs = self.block_size
        blocks = []
        end = num_computed_tokens + num_external_tokens
        for start in range(num_computed_tokens, end, bs):
            index = start // bs
            tokens = seq.token_ids[start:min(start + bs, end)]
            if len(tokens) == bs:
                block_hash: str | None = remote.block_hashes[index]
                key = block_key(remote.block_hashes[index])
            else:
                assert remote.partial_key is not None and start + len(tokens) == end
                block_hash, key = None, remote.partial_key
            blocks.append(BlockLoad(seq.block_table[index], key, tokens, block_hash))
        return KVLoad(seq.seq_id, blocks)

    def build_save(self, seq: Sequence, num_tokens: int, read_block: Callable[[int], torch.Tensor]) -> KVSave:
        """Encode the first `num_tokens` tokens' blocks of `seq`, except those the store held when
        the request arrived (`seq.remote_kv`, from a fresh probe): those only get their TTL
        refreshed, so a prefix in use does not expire under the requests that share it."""
        bs = self.block_size
        hashes = seq.block_hashes(bs, self.model_id)
        present = set(seq.remote_kv.block_hashes) if seq.remote_kv is not None else set()
        num_full = num_tokens // bs
        save = KVSave(num_full_blocks=num_full)
        for index in range(num_full):
            if hashes[index] in present:
                save.refresh.append(hashes[index])
                continue
            tokens = seq.token_ids[index * bs:(index + 1) * bs]
            save.full.append((hashes[index], encode_block(tokens, read_block(seq.block_table[index]))))
        if num_tokens % bs:
            save.partial = encode_block(seq.token_ids[num_full * bs:num_tokens],
                                        read_block(seq.block_table[num_full]))
        return save


# Keys already reported as malformed: a poisoned popular prefix is rejected on every request that
# shares it, and is logged once (bounded: a flood of bad keys cannot grow it without end).
_reported: set[str] = set()
_MAX_REPORTED = 4096


def _reject(key: str, reason: str) -> None:
    if key in _reported:
        logger.debug("block %s in the store rejected again: %s", key, reason)
        return
    if len(_reported) >= _MAX_REPORTED:
        _reported.clear()
    _reported.add(key)
    logger.warning("block %s in the store rejected (%s); computing it instead, and deleting it so the "
                   "good block can be stored (further rejections of this key are not logged)", key, reason)


async def fetch(store: BlockReader, load: KVLoad, block_shape: Seq[int] | None = None) -> LoadedKV:
    """Read a load's blocks (one round trip); keep the leading ones that hold the expected tokens,
    as a well-formed block of `block_shape` ([layers, 2, block_size, kv_heads, head_dim], this
    engine's; None: any shape). The first that is not ends the valid prefix: it and the blocks
    after it are computed instead, and it counts in `num_rejected`."""
    result = LoadedKV(load.seq_id, num_missing=len(load.blocks))
    values = await store.get([b.key for b in load.blocks])
    for block, value in zip(load.blocks, values):
        if value is None:
            break
        try:
            stored_tokens, kv = decode_block(value)
            if block_shape is not None and list(kv.shape) != list(block_shape):
                raise ValueError(f"shape {list(kv.shape)}, expected {list(block_shape)}")
        except Exception as exc:  # untrusted bytes: whatever fails to decode is a miss, never a crash
            result.num_rejected += 1
            result.rejected_keys.append(block.key)
            _reject(block.key, f"{type(exc).__name__}: {exc}")
            break
        if stored_tokens != block.token_ids:  # a hash collision or a stale partial: recompute
            logger.warning("block %s holds other tokens than expected; recomputing", block.key)
            break
        result.kv.append(kv)
        result.num_missing -= 1
        result.num_tokens += len(block.token_ids)
        result.num_bytes += len(value)
        if block.block_hash is not None:
            result.block_hashes.append(block.block_hash)
    return result


async def probe(store: BlockReader, block_hashes: Seq[str]) -> list[str]:
    """The leading ids of `block_hashes` that the store holds now (a hint: they may expire)."""
    found: list[str] = []
    if not block_hashes:
        return found
    present = await store.exists([block_key(h) for h in block_hashes])
    for block_hash, here in zip(block_hashes, present):
        if not here:
            break
        found.append(block_hash)
    return found
