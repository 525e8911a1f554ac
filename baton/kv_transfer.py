"""Moving KV blocks between an engine's local pool and the block store.

Both worker kinds use it: the prefill worker to fetch prefix blocks another request already computed
and to publish the blocks it computed; the decode worker to load a handed-off request's blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Container
from dataclasses import dataclass

from baton.engine import LLMEngine
from baton.sequence import Sequence
from kvstore.hashing import hash_blocks
from kvstore.redis_backend import RedisBlockStore, decode_block, encode_block

logger = logging.getLogger("baton.kv_transfer")


@dataclass
class WarmResult:
    num_local: int  # full blocks already in the local pool
    num_fetched: int  # full blocks loaded from the store
    bytes_fetched: int


def _install_cached_block(engine: LLMEngine, block_hash: str, token_ids: list[int], kv) -> bool:
    """Put a fetched block into the local pool as a cached (ref 0) block findable by its hash."""
    pool = engine.pool
    blocks = pool.allocate(1)
    if blocks is None:
        return False
    engine.runner.write_block(blocks[0], kv)
    pool.cache_block(blocks[0], block_hash, token_ids)
    pool.free(blocks)  # ref 0: stays findable until reallocated (lazy eviction)
    return True


async def warm_prefix(engine: LLMEngine, store: RedisBlockStore, token_ids: list[int]) -> WarmResult:
    """Make the local prefix cache hold as many leading full blocks of `token_ids` as the store has."""
    bs = engine.pool.block_size
    hashes = hash_blocks(token_ids, bs, engine.model_config.model_id)
    num_local = 0
    for index, block_hash in enumerate(hashes):
        if engine.pool.lookup(block_hash, token_ids[index * bs:(index + 1) * bs]) is None:
            break
        num_local += 1
    missing = hashes[num_local:]
    num_fetched = bytes_fetched = 0
    if missing:
        values = await store.get_blocks(missing)
        for offset, (block_hash, value) in enumerate(zip(missing, values)):
            if value is None:
                break
            index = num_local + offset
            expected = token_ids[index * bs:(index + 1) * bs]
            try:
                stored_tokens, kv = decode_block(value)
            except (ValueError, KeyError, TypeError) as exc:
                logger.warning("block %s in the store is unreadable: %s", block_hash, exc)
                break
            if stored_tokens != expected:  # a hash collision: never trust the id alone
                logger.warning("block %s holds other tokens than expected; recomputing", block_hash)
                break
            if not _install_cached_block(engine, block_hash, expected, kv):
                break
            num_fetched += 1
            bytes_fetched += len(value)
    return WarmResult(num_local, num_fetched, bytes_fetched)


def full_blocks_of(engine: LLMEngine, seq: Sequence, num_tokens: int) -> list[tuple[str, list[int], int]]:
    """(hash, tokens, local block) of every full block among the first `num_tokens` tokens."""
    bs = engine.pool.block_size
    hashes = seq.block_hashes(bs, engine.model_config.model_id)
    return [(hashes[i], seq.token_ids[i * bs:(i + 1) * bs], seq.block_table[i]) for i in range(num_tokens // bs)]


def encode_seq_blocks(engine: LLMEngine, seq: Sequence, num_tokens: int,
                      skip_hashes: Container[str]) -> tuple[list[tuple[str, bytes]], bytes | None]:
    """Encoded full blocks (except those known to be in the store) and the partial last block."""
    bs = engine.pool.block_size
    full = [(h, encode_block(tokens, engine.runner.read_block(block)))
            for h, tokens, block in full_blocks_of(engine, seq, num_tokens) if h not in skip_hashes]
    partial = None
    num_full = num_tokens // bs
    if num_tokens % bs:
        partial = encode_block(seq.token_ids[num_full * bs:num_tokens],
                               engine.runner.read_block(seq.block_table[num_full]))
    return full, partial


def adopt_blocks(engine: LLMEngine, seq: Sequence, num_tokens: int, partial_value: bytes | None) -> bool:
    """Give `seq` a block table holding its first `num_tokens` tokens' KV from the local cache
    (after `warm_prefix`) plus the transferred partial block. False (nothing held) if incomplete:
    the caller then lets the scheduler recompute what is missing."""
    bs = engine.pool.block_size
    pool = engine.pool
    hashes = seq.block_hashes(bs, engine.model_config.model_id)
    num_full = num_tokens // bs
    blocks = []
    for i in range(num_full):
        block = pool.lookup(hashes[i], seq.token_ids[i * bs:(i + 1) * bs])
        if block is None:
            return False
        blocks.append(block)
    partial_tokens = seq.token_ids[num_full * bs:num_tokens]
    partial_kv = None
    if partial_tokens:
        if partial_value is None:
            return False
        stored_tokens, partial_kv = decode_block(partial_value)
        if stored_tokens != partial_tokens:
            return False
    revived = sum(1 for b in blocks if pool.ref_counts[b] == 0)
    # Only blocks no running request may still claim (no-evict reservations, the watermark):
    # taking reserved ones would force a preemption that no-evict promises never happens.
    if revived + (1 if partial_tokens else 0) > engine.scheduler.spare_blocks():
        return False
    for block in blocks:
        pool.touch(block)
    if partial_tokens:
        new = pool.allocate(1)
        assert new is not None
        engine.runner.write_block(new[0], partial_kv)
        blocks.append(new[0])
    seq.block_table = blocks
    seq.num_computed_tokens = num_tokens
    seq.num_registered_blocks = num_full
    seq.num_cached_tokens = num_tokens
    return True
