"""Stable block ids: a full block's id is a hash chained over (parent id, its tokens, model id).

Two requests that share a prefix share the ids of its full blocks, on any process or machine, so a
block computed once can be found again (prefix caching). Python's `hash()` is salted per process
and would break that; blake2b over a canonical msgpack encoding does not.

A request's `cache_salt` (vLLM's field) goes into its first block's id, so its whole chain differs
from every other salt's and from the unsalted one: its blocks are found only by requests with the
same salt. Unsalted ids are those of before (a salt adds a fourth item to the first block's payload;
nothing else changes), so the blocks already stored stay valid.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgpack


def hash_block(parent_hash: str | None, token_ids: Sequence[int], model_id: str,
               cache_salt: str | None = None) -> str:
    """Id of one full block: 32 hex chars of blake2b(parent id, token ids, model id), and the
    request's salt for a first block (a later one inherits it through its parent's id)."""
    item: list = [parent_hash or "", list(token_ids), model_id]
    if cache_salt and not parent_hash:
        item.append(cache_salt)
    return hashlib.blake2b(msgpack.packb(item), digest_size=16).hexdigest()


def hash_blocks(token_ids: Sequence[int], block_size: int, model_id: str,
                parent_hash: str | None = None, cache_salt: str | None = None) -> list[str]:
    """Ids of every full block of `token_ids` (a trailing partial block has no id)."""
    hashes: list[str] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start:start + block_size], model_id, cache_salt)
        hashes.append(parent_hash)
    return hashes
