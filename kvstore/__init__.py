"""Paged KV block store: block ids (chained hashes), the local block pool, the Redis backend."""

from kvstore.block_pool import BlockPool
from kvstore.hashing import hash_block, hash_blocks

__all__ = ["BlockPool", "hash_block", "hash_blocks"]
