"""Per-request block accounting over a `BlockPool`: prefix hits, slot allocation, freeing.

It only allocates and frees; what to run is the scheduler's decision. Every allocation either fits
whole or returns None with nothing changed. With a window (every layer a sliding-window layer, see
baton.engine.window_blocks) the blocks behind it are freed while the request runs
(`release_out_of_window`): their table entries become the null block 0. A hybrid's prefix hit
goes only as far as a state snapshot reaches (baton.engine.state_cache), and its prefill chunks end
at the last full block boundary so that a snapshot exists there (`chunk_size`).
"""

from __future__ import annotations

from baton.engine.block_pool import BlockPool, blocks_for
from baton.engine.sequence import Sequence
from baton.engine.state_cache import StateCache, chunk_end
from baton.engine.window_blocks import NULL_BLOCK, may_release, num_dead_blocks, num_released


class BlockManager:
    def __init__(self, pool: BlockPool, model_id: str, enable_prefix_caching: bool = True,
                 window: int | None = None, state_cache: StateCache | None = None) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.model_id = model_id
        self.enable_prefix_caching = enable_prefix_caching
        # tokens every layer attends (window_blocks.freeable_window); None: no block is ever dead
        self.window = window
        # a hybrid's state snapshots: a hit must end where one was kept (None: no state layers)
        self.state_cache = state_cache
        self.num_released_blocks = 0  # table entries freed behind the window, all requests
        self.num_prefix_queries = 0  # tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of which found

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Local blocks already holding a prefix of the request's tokens (prefix cache hits).

        At least one token is always left to compute: the step needs it to produce logits.
        """
        if not self.enable_prefix_caching or seq.block_table or seq.sampling_params.prompt_logprobs is not None:
            # (prompt logprobs need the logits of every prompt position: nothing may be skipped)
            return []
        hits: list[int] = []
        bs = self.block_size
        for index, block_hash in enumerate(seq.block_hashes(bs, self.model_id)):
            block = self.pool.lookup(block_hash, seq.token_ids[index * bs:(index + 1) * bs])
            if block is None:
                break
            hits.append(block)
        if hits and len(hits) * bs >= seq.num_tokens:
            hits.pop()
        if self.state_cache is not None:
            hashes = seq.block_hashes(bs, self.model_id)
            while hits and not self.state_cache.has(hashes[len(hits) - 1]):
                hits.pop()
        return hits

    def chunk_size(self, seq: Sequence, num_new: int) -> int:
        """Tokens to compute for `seq` this step out of `num_new` allowed: a hybrid's prefill chunk
        ends at the last full block boundary it would cross (where its state is snapshot)."""
        if self.state_cache is None:
            return num_new
        return chunk_end(seq, num_new, self.block_size)

    def num_blocks_to_take(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int]) -> int:
        """Free-list blocks that `allocate_slots` would consume (new blocks + revived cached ones)."""
        covered = len(seq.block_table) + len(computed_blocks)
        total_tokens = seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        new_blocks = max(0, blocks_for(total_tokens, self.block_size) - covered)
        revived = sum(1 for b in computed_blocks if self.pool.ref_counts[b] == 0)
        return new_blocks + revived

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> list[int] | None:
        """Make the block table cover `num_new_tokens` more tokens (after any prefix hits).

        Returns the newly allocated blocks, or None (nothing changed) if the pool cannot hold them.
        """
        computed_blocks = computed_blocks or []
        needed = self.num_blocks_to_take(seq, num_new_tokens, computed_blocks)
        if needed > self.pool.num_free_blocks:
            return None
        for block in computed_blocks:
            self.pool.touch(block)
        if computed_blocks:
            seq.block_table.extend(computed_blocks)
            seq.num_computed_tokens += len(computed_blocks) * self.block_size
        total_tokens = seq.num_computed_tokens + num_new_tokens
        num_new_blocks = blocks_for(total_tokens, self.block_size) - len(seq.block_table)
        new_blocks = self.pool.allocate(max(0, num_new_blocks))
        assert new_blocks is not None  # checked above
        seq.block_table.extend(new_blocks)
        return new_blocks

    def record_prefix_lookup(self, seq: Sequence, computed_blocks: list[int]) -> None:
        seq.num_cached_tokens = len(computed_blocks) * self.block_size
        self.num_prefix_queries += seq.num_tokens
        self.num_prefix_hits += seq.num_cached_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every block whose tokens are all computed under its chained hash."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        hashes = seq.block_hashes(bs, self.model_id)
        for index in range(seq.num_registered_blocks, num_full):
            block = seq.block_table[index]
            # (a released entry is the null block: no hash may ever name it)
            if block != NULL_BLOCK and self.pool.block_hashes[block] is None:
                self.pool.cache_block(block, hashes[index], seq.token_ids[index * bs:(index + 1) * bs])
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def release_out_of_window(self, seq: Sequence) -> list[int]:
        """Free the blocks of `seq` that no future query attends (all behind the window), keeping
        their table positions as null entries; returns the blocks freed. Only this request's
        reference is dropped: a block another request shares stays; a hashed one stays findable in
        the prefix cache until it is reallocated. Call it once the computed tokens are final for
        the step (after a speculative rollback); O(log n + blocks freed)."""
        if self.window is None or not may_release(seq):
            return []
        table = seq.block_table
        end = min(num_dead_blocks(seq.num_computed_tokens, self.window, self.block_size), len(table))
        start = num_released(table)
        if end <= start:
            return []
        dead = table[start:end]
        table[start:end] = [NULL_BLOCK] * len(dead)
        # Reverse order, as in `free`: the chain's first block stays findable longest.
        self.pool.free(list(reversed(dead)))
        self.num_released_blocks += len(dead)
        return dead

    def free(self, seq: Sequence) -> None:
        # Reverse order: the tail of a request is the least likely to be shared, so evict it first.
        # The released (null) entries lead the table and hold no reference.
        self.pool.free(list(reversed(seq.block_table[num_released(seq.block_table):])))
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
