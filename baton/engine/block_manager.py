"""Per-request block accounting over a `BlockPool`: prefix hits, slot allocation, freeing.

It only allocates and frees; what to run is the scheduler's decision. Every allocation either fits
whole or returns None with nothing changed. With a window (every layer a sliding-window layer, see
baton.engine.window_blocks) the blocks behind it are freed while the request runs
(`release_out_of_window`): their table entries become the null block 0. A model mixing window and
global layers (Gemma 2/3, gpt-oss: `KVGroups`) keeps a table for its global layers
(`seq.block_table`) and `window_tables` more for its window layers, all of one length, each entry a
block of the one pool; behind the window only the window tables' entries are freed (and a prefix hit
needs their blocks only where its first query sees them). A hybrid's prefix hit
goes only as far as a state snapshot reaches (baton.engine.state_cache), and its prefill chunks end
at the last full block boundary so that a snapshot exists there (`chunk_size`).
"""

from __future__ import annotations

from baton.engine.block_pool import BlockPool, blocks_for
from baton.engine.kv_types import PrefixHits
from baton.engine.sequence import Sequence
from baton.engine.state_cache import StateCache, chunk_end
from baton.engine.window_blocks import NULL_BLOCK, may_release, num_dead_blocks, num_released


class BlockManager:
    def __init__(self, pool: BlockPool, model_id: str, enable_prefix_caching: bool = True,
                 window: int | None = None, state_cache: StateCache | None = None,
                 window_tables: int = 0) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.model_id = model_id
        self.enable_prefix_caching = enable_prefix_caching
        # tokens every layer attends (window_blocks.freeable_window); None: no block is ever dead
        self.window = window
        # tables of window layers beside seq.block_table (kv_groups.KVGroups): the window frees
        # their entries only; 0: one table, which the window (if any) frees
        self.num_window_tables = window_tables
        # a hybrid's state snapshots: a hit must end where one was kept (None: no state layers)
        self.state_cache = state_cache
        self.num_released_blocks = 0  # table entries freed behind the window, all requests
        self.num_prefix_queries = 0  # tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of which found

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Local blocks already holding a prefix of the request's tokens (prefix cache hits): the
        global table's, and with window tables a `PrefixHits` whose `window` has each index's
        window-table blocks. A hit of n position blocks needs the window tables' blocks only where
        the request's first query (at n * block_size) still sees them (vLLM's rule for sliding
        windows): those behind the window are null entries, as if released, so a chat's follow-up
        resumes after its first turn's window blocks were freed and reused. A prefill worker's
        request (its handoff carries every layer of every prompt block) needs them all.

        At least one token is always left to compute: the step needs it to produce logits.
        """
        if not self.enable_prefix_caching or seq.block_table or seq.sampling_params.prompt_logprobs is not None:
            # (prompt logprobs need the logits of every prompt position: nothing may be skipped)
            return []
        bs = self.block_size
        hashes = seq.block_hashes(bs, self.model_id)
        blocks: list[int] = []
        siblings: list[tuple[int | None, ...]] = []
        for index, block_hash in enumerate(hashes):
            tokens = seq.token_ids[index * bs:(index + 1) * bs]
            block = self.pool.lookup(block_hash, tokens)
            if block is None:
                break
            blocks.append(block)
            siblings.append(tuple(self.pool.lookup(window_hash(block_hash, t), tokens)
                                  for t in range(1, self.num_window_tables + 1)))
        n = len(blocks) - (1 if blocks and len(blocks) * bs >= seq.num_tokens else 0)
        while n and not self._hit_may_end_at(seq, n, siblings, hashes):
            n -= 1
        hits = PrefixHits(blocks[:n])
        if self.num_window_tables:
            seen = self._first_window_block_seen(seq, n)
            hits.window = [tuple(NULL_BLOCK for _ in row) if index < seen else row  # type: ignore[misc]
                           for index, row in enumerate(siblings[:n])]
        return hits

    def _first_window_block_seen(self, seq: Sequence, num_blocks: int) -> int:
        """The first position block whose window-table blocks a hit of `num_blocks` must bring."""
        if self.window is None or not may_release(seq):
            return 0
        return num_dead_blocks(num_blocks * self.block_size, self.window, self.block_size)

    def _hit_may_end_at(self, seq: Sequence, num_blocks: int, siblings: list[tuple[int | None, ...]],
                        hashes: list[str]) -> bool:
        """Whether a hit of the leading `num_blocks` (all in the global table) resumes the request:
        the window tables' blocks it needs are there, and a hybrid's state snapshot ends there."""
        seen = self._first_window_block_seen(seq, num_blocks)
        if any(None in row for row in siblings[seen:num_blocks]):
            return False
        return self.state_cache is None or self.state_cache.has(hashes[num_blocks - 1])

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
        return new_blocks * (1 + self.num_window_tables) + self.num_revived(computed_blocks)

    def num_revived(self, computed_blocks: list[int]) -> int:
        """Blocks of these hits that sit on the free list (a hit takes them off it)."""
        ids = list(computed_blocks) + [b for tables in getattr(computed_blocks, "window", ()) for b in tables]
        return sum(1 for b in ids if b != NULL_BLOCK and self.pool.ref_counts[b] == 0)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> list[int] | None:
        """Make the block table cover `num_new_tokens` more tokens (after any prefix hits).

        Returns the newly allocated blocks, or None (nothing changed) if the pool cannot hold them.
        """
        computed_blocks = computed_blocks or []
        needed = self.num_blocks_to_take(seq, num_new_tokens, computed_blocks)
        if needed > self.pool.num_free_blocks:
            return None
        k = self.num_window_tables
        if k and not seq.window_tables:
            seq.window_tables = [[] for _ in range(k)]
        window_hits = getattr(computed_blocks, "window", [])
        assert len(window_hits) == (len(computed_blocks) if k else 0), "window tables' hits missing"
        for block in computed_blocks:
            self.pool.touch(block)
        for siblings in window_hits:
            for table, block in zip(seq.window_tables, siblings):
                if block != NULL_BLOCK:  # (behind the window: a released entry, no reference)
                    self.pool.touch(block)
                table.append(block)
        if computed_blocks:
            seq.block_table.extend(computed_blocks)
            seq.num_computed_tokens += len(computed_blocks) * self.block_size
        total_tokens = seq.num_computed_tokens + num_new_tokens
        num_new_blocks = max(0, blocks_for(total_tokens, self.block_size) - len(seq.block_table))
        new_blocks = self.pool.allocate(num_new_blocks * (1 + k))
        assert new_blocks is not None  # checked above
        seq.block_table.extend(new_blocks[:num_new_blocks])
        for t, table in enumerate(seq.window_tables, start=1):
            table.extend(new_blocks[t * num_new_blocks:(t + 1) * num_new_blocks])
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
            tokens = seq.token_ids[index * bs:(index + 1) * bs]
            block = seq.block_table[index]
            # (a released entry is the null block: no hash may ever name it)
            if block != NULL_BLOCK and self.pool.block_hashes[block] is None:
                self.pool.cache_block(block, hashes[index], tokens)
            for t, table in enumerate(seq.window_tables, start=1):
                if table[index] != NULL_BLOCK and self.pool.block_hashes[table[index]] is None:
                    self.pool.cache_block(table[index], window_hash(hashes[index], t), tokens)
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def release_out_of_window(self, seq: Sequence) -> list[int]:
        """Free the blocks of `seq` that no future query attends (all behind the window), keeping
        their table positions as null entries; returns the blocks freed. Only this request's
        reference is dropped: a block another request shares stays; a hashed one stays findable in
        the prefix cache until it is reallocated. Call it once the computed tokens are final for
        the step (after a speculative rollback); O(log n + blocks freed)."""
        if self.window is None or not may_release(seq):
            return []
        freed: list[int] = []
        for table in (seq.window_tables if self.num_window_tables else [seq.block_table]):
            end = min(num_dead_blocks(seq.num_computed_tokens, self.window, self.block_size), len(table))
            start = num_released(table)
            if end <= start:
                continue
            dead = table[start:end]
            table[start:end] = [NULL_BLOCK] * len(dead)
            # Reverse order, as in `free`: the chain's first block stays findable longest.
            self.pool.free(list(reversed(dead)))
            self.num_released_blocks += len(dead)
            freed += dead
        return freed

    def truncate(self, seq: Sequence, num_blocks: int) -> None:
        """Drop every table's entries past the first `num_blocks` (a speculative rollback)."""
        for table in [seq.block_table, *seq.window_tables]:
            extra = table[num_blocks:]
            if extra:
                self.pool.free([b for b in reversed(extra) if b != NULL_BLOCK])
                del table[num_blocks:]

    def free(self, seq: Sequence) -> None:
        # Reverse order: the tail of a request is the least likely to be shared, so evict it first.
        # The released (null) entries lead the table and hold no reference.
        for table in [seq.block_table, *seq.window_tables]:
            self.pool.free(list(reversed(table[num_released(table):])))
        seq.block_table = []
        seq.window_tables = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0


def window_hash(block_hash: str, table: int) -> str:
    """The prefix-cache key of window table `table`'s block at the position `block_hash` names (the
    tables' blocks hold other layers' KV of the same tokens)."""
    return f"{block_hash}/w{table}"
