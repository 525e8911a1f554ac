"""The local pool of KV blocks: free list, reference counts, and lazy eviction of cached blocks.

Block ids here are physical indices into the KV tensor. Block 0 is reserved (padding of attention
gathers points at it) and never handed out. A freed block whose contents are a full, hashed block
stays findable by its hash until it is reallocated (lazy eviction); the free list is ordered
least-recently-freed first, so the blocks freed longest ago are reused first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence



def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("a block pool needs at least 2 blocks (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[str | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[str, int] = {}
        # Insertion-ordered set of free block ids: O(1) append, pop-front and removal from the middle
        # (a cached block that gets hit again leaves the free list without being reallocated).
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` blocks off the free list (ref count 1), or None with nothing changed."""
        if num_blocks > self.num_free_blocks:
            return None
        blocks = []
        for _ in range(num_blocks):
            block, _ = self.free_blocks.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def lookup(self, block_hash: str, token_ids: Sequence[int]) -> int | None:
        """The block holding this hash, if present and its tokens really match (no collision)."""
        block = self.hash_to_block.get(block_hash)
        if block is None or self.block_tokens[block] != tuple(token_ids):
            return None
        return block

    def touch(self, block: int) -> None:
        """Take a reference on a cached block (a prefix hit); it leaves the free list if it was there."""
        assert block != 0, "block 0 is reserved"
        if self.ref_counts[block] == 0:
            del self.free_blocks[block]
        self.ref_counts[block] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block; blocks reaching zero go to the end of the free list.

        Callers pass a request's blocks in reverse order, so that its tail blocks (the least likely
        to be shared) are the first to be evicted.
        """
        for block in blocks:
            assert block != 0 and self.ref_counts[block] > 0, f"double free of block {block}"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None

    def cache_block(self, block: int, block_hash: str, token_ids: Sequence[int]) -> None:
        """Register a full block under its hash so later requests can reuse it."""
        assert self.ref_counts[block] > 0, "only a held block can be registered"
        if self.block_hashes[block] == block_hash:
            return
        if block_hash in self.hash_to_block:
            # Another block already holds this content (computed concurrently): keep the first.
            return
        self.block_hashes[block] = block_hash
        self.block_tokens[block] = tuple(token_ids)
        self.hash_to_block[block_hash] = block

    def _evict(self, block: int) -> None:
        block_hash = self.block_hashes[block]
        if block_hash is not None:
            if self.hash_to_block.get(block_hash) == block:
                del self.hash_to_block[block_hash]
            self.block_hashes[block] = None
            self.block_tokens[block] = None
            self.num_evictions += 1

    def check_invariants(self) -> None:
        assert self.ref_counts[0] == 0 and 0 not in self.free_blocks
        for block in range(1, self.num_blocks):
            assert (self.ref_counts[block] == 0) == (block in self.free_blocks), block
        for block_hash, block in self.hash_to_block.items():
            assert self.block_hashes[block] == block_hash
