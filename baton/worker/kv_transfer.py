"""The worker side of the KV connector over a block store (kvstore's Redis backend, or the in-memory
one in tests): read a load's blocks, check each, probe which blocks the store holds.

Every block read is untrusted bytes: its tokens, dtype, shape and size are checked, and the first
block that is missing, unreadable, malformed or foreign ends the valid prefix (it and the blocks
after it are computed instead). A malformed block is deleted, so the block computed instead can land
(full blocks are written with SET NX).

A load with a state (a hybrid model's handoff) is all or nothing: every block and the state must
arrive, the state made by this model's kind of state layers over exactly the expected tokens, in
its shapes and dtypes; otherwise nothing is loaded and the prompt is recomputed (a state miss).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence as Seq
from typing import Protocol

import torch

from baton.engine.kv_types import KVLoad, LoadedKV
from kvstore.codec import decode_block, decode_state, logical_shape, state_mismatch
from kvstore.keys import block_key

logger = logging.getLogger("baton.kv_connector")


class BlockStore(Protocol):
    async def get(self, keys: Seq[str]) -> list[bytes | None]: ...

    async def exists(self, keys: Seq[str]) -> list[bool]: ...

    async def delete(self, keys: Seq[str]) -> None: ...


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


def _key(block_hash: str | None, partial: str | None) -> str:
    return block_key(block_hash) if block_hash is not None else str(partial)


class StoreKVTransfer:
    """`KVConnectorWorker` over a block store, for an engine whose blocks are `block_shape`
    ([layers, 2, block_size, kv_heads, head_dim] in any cache format; None: any shape)."""

    def __init__(self, store: BlockStore, block_shape: Seq[int] | None = None, state_kind: str | None = None,
                 state_layout: Mapping[str, tuple[Seq[int], torch.dtype]] | None = None) -> None:
        self.store = store
        self.block_shape = list(block_shape) if block_shape is not None else None
        # a hybrid model's state: its kind and its tensors' (shape, dtype), what a handed-off state must match
        self.state_kind = state_kind
        self.state_layout = {name: (list(shape), dtype) for name, (shape, dtype) in (state_layout or {}).items()}

    async def load(self, load: KVLoad) -> LoadedKV:
        """Read a load's blocks (one round trip) and keep the leading ones that hold the expected
        tokens as well-formed blocks of this engine's shape; delete a malformed one."""
        result = LoadedKV(load.request_id, num_missing=len(load.blocks))
        keys = [_key(b.block_hash, b.partial_key) for b in load.blocks]
        values = await self.store.get(keys + ([load.state_key] if load.state_key is not None else []))
        for block, key, value in zip(load.blocks, keys, values):
            if value is None:
                break
            try:
                stored_tokens, kv = decode_block(value)
                # a block of another cache format (bf16, int8, fp8) is converted when written
                if self.block_shape is not None and logical_shape(kv) != self.block_shape:
                    raise ValueError(f"shape {logical_shape(kv)}, expected {self.block_shape}")
            except Exception as exc:  # untrusted bytes: whatever fails to decode is a miss, never a crash
                result.num_rejected += 1
                result.rejected_keys.append(key)
                _reject(key, f"{type(exc).__name__}: {exc}")
                break
            if stored_tokens != list(block.token_ids):  # a hash collision or a stale partial: recompute
                logger.warning("block %s holds other tokens than expected; recomputing", key)
                break
            result.kv.append(kv)
            result.num_missing -= 1
            result.num_tokens += len(block.token_ids)
            result.num_bytes += len(value)
            if block.block_hash is not None:
                result.block_hashes.append(block.block_hash)
        if load.state_key is not None:
            result = self._with_state(load, result, values[-1])
        await self.store.delete(result.rejected_keys)
        return result

    def _with_state(self, load: KVLoad, blocks: LoadedKV, value: bytes | None) -> LoadedKV:
        """`blocks` with the load's state, or nothing loaded (a state miss) when either is incomplete."""
        key = str(load.state_key)
        reason = None
        if blocks.num_missing:
            reason = "its blocks did not all arrive"
        elif value is None:
            reason = "no state in the store"
        else:
            try:
                kind, tokens, tensors = decode_state(value)
                if self.state_kind is None:
                    raise ValueError("this model keeps no state")
                reason = state_mismatch(kind, tensors, self.state_kind, self.state_layout)
                if reason is None and tokens != list(load.state_token_ids):
                    reason = "it was computed over other tokens"
                if reason is None:
                    blocks.state = tensors
                    blocks.num_bytes += len(value)
                    return blocks
            except Exception as exc:  # untrusted bytes: a miss, never a crash
                reason = f"{type(exc).__name__}: {exc}"
            blocks.rejected_keys.append(key)
            _reject(key, reason)
        logger.info("state %s not resumed (%s): recomputing request %s's prompt", key, reason, load.request_id)
        return LoadedKV(load.request_id, num_missing=len(load.blocks), num_rejected=blocks.num_rejected
                        + (key in blocks.rejected_keys), rejected_keys=blocks.rejected_keys, num_state_misses=1)

    async def probe(self, block_hashes: Seq[str]) -> list[str]:
        found: list[str] = []
        if not block_hashes:
            return found
        present = await self.store.exists([block_key(h) for h in block_hashes])
        for block_hash, here in zip(block_hashes, present):
            if not here:
                break
            found.append(block_hash)
        return found
