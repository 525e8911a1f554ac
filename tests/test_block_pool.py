"""The local KV block pool (free list, ref counts, lazy eviction) and the chained block hashes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from baton.engine.block_pool import BlockPool
from kvstore.hashing import hash_block, hash_blocks

REPO_ROOT = Path(__file__).resolve().parent.parent


class CheckedPool(BlockPool):
    """A pool that checks its own invariants after every public operation."""

    def allocate(self, num_blocks):
        result = super().allocate(num_blocks)
        self.check_invariants()
        return result

    def touch(self, block):
        super().touch(block)
        self.check_invariants()

    def free(self, blocks):
        super().free(blocks)
        self.check_invariants()

    def cache_block(self, block, block_hash, token_ids):
        super().cache_block(block, block_hash, token_ids)
        self.check_invariants()


def free_list(pool: BlockPool) -> list[int]:
    return list(pool.free_blocks)


TOKENS_A = list(range(100, 104))
TOKENS_B = list(range(200, 204))


# ------------------------------------------------------------------ allocation and the free list

def test_fresh_pool_hands_out_blocks_in_order_and_never_block_0():
    pool = CheckedPool(num_blocks=8, block_size=4)
    assert free_list(pool) == [1, 2, 3, 4, 5, 6, 7]
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_usable_blocks) == (7, 0, 7)

    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(1) == [4]
    assert free_list(pool) == [5, 6, 7]
    assert pool.ref_counts == [0, 1, 1, 1, 1, 0, 0, 0]
    assert pool.num_used_blocks == 4
    assert pool.usage() == pytest.approx(4 / 7)

    assert pool.allocate(3) == [5, 6, 7]  # everything usable, and still no block 0
    assert pool.num_free_blocks == 0
    assert pool.usage() == 1.0
    assert pool.allocate(1) is None
    assert pool.ref_counts[0] == 0


def test_allocate_zero_blocks_is_a_no_op():
    pool = CheckedPool(num_blocks=4, block_size=4)
    assert pool.allocate(0) == []
    assert free_list(pool) == [1, 2, 3]


def test_allocate_too_many_returns_none_and_changes_nothing():
    pool = CheckedPool(num_blocks=6, block_size=4)
    assert pool.allocate(2) == [1, 2]
    before = (free_list(pool), list(pool.ref_counts), pool.num_evictions)
    assert not pool.can_allocate(4)
    assert pool.allocate(4) is None
    assert (free_list(pool), list(pool.ref_counts), pool.num_evictions) == before
    assert pool.can_allocate(3)
    assert pool.allocate(3) == [3, 4, 5]


def test_pool_needs_a_usable_block():
    with pytest.raises(ValueError):
        BlockPool(num_blocks=1, block_size=4)


def test_free_appends_in_the_given_order_to_the_end_of_the_free_list():
    pool = CheckedPool(num_blocks=8, block_size=4)
    assert pool.allocate(5) == [1, 2, 3, 4, 5]
    pool.free([4, 2])
    assert free_list(pool) == [6, 7, 4, 2]
    pool.free([5, 1, 3])
    assert free_list(pool) == [6, 7, 4, 2, 5, 1, 3]
    # The blocks freed longest ago are reused first.
    assert pool.allocate(4) == [6, 7, 4, 2]
    assert free_list(pool) == [5, 1, 3]


def test_double_free_and_freeing_block_0_assert():
    pool = CheckedPool(num_blocks=4, block_size=4)
    assert pool.allocate(2) == [1, 2]
    pool.free([1])
    with pytest.raises(AssertionError):
        pool.free([1])
    with pytest.raises(AssertionError):
        pool.free([3])  # never allocated
    with pytest.raises(AssertionError):
        pool.free([0])
    with pytest.raises(AssertionError):
        pool.touch(0)
    assert free_list(pool) == [3, 1]
    assert pool.ref_counts == [0, 0, 1, 0]


# ------------------------------------------------------------------ shared blocks

def test_shared_block_is_freed_only_when_the_last_reference_drops():
    pool = CheckedPool(num_blocks=5, block_size=4)
    assert pool.allocate(2) == [1, 2]
    pool.touch(1)  # a second request shares block 1
    pool.touch(1)  # and a third
    assert pool.ref_counts[1] == 3
    pool.free([2, 1])
    assert pool.ref_counts[1:3] == [2, 0]
    assert free_list(pool) == [3, 4, 2]
    pool.free([1])
    assert free_list(pool) == [3, 4, 2]
    pool.free([1])
    assert free_list(pool) == [3, 4, 2, 1]
    assert pool.num_used_blocks == 0


# ------------------------------------------------------------------ prefix cache: lazy eviction

def test_cached_block_stays_findable_after_free_until_reallocated():
    pool = CheckedPool(num_blocks=4, block_size=4)
    assert pool.allocate(2) == [1, 2]
    pool.cache_block(1, "h1", TOKENS_A)
    assert pool.lookup("h1", TOKENS_A) == 1
    pool.free([2, 1])
    assert free_list(pool) == [3, 2, 1]
    # Freed, but its contents are intact: still a prefix hit.
    assert pool.lookup("h1", TOKENS_A) == 1
    assert pool.num_evictions == 0

    assert pool.allocate(2) == [3, 2]  # uncached / older blocks go first
    assert pool.lookup("h1", TOKENS_A) == 1
    assert pool.num_evictions == 0

    assert pool.allocate(1) == [1]  # reallocating it evicts it
    assert pool.lookup("h1", TOKENS_A) is None
    assert pool.hash_to_block == {}
    assert pool.block_hashes[1] is None and pool.block_tokens[1] is None
    assert pool.num_evictions == 1


def test_lookup_rechecks_tokens_on_hash_match():
    pool = CheckedPool(num_blocks=4, block_size=4)
    [block] = pool.allocate(1)
    pool.cache_block(block, "h", TOKENS_A)
    assert pool.lookup("h", TOKENS_A) == block
    assert pool.lookup("h", tuple(TOKENS_A)) == block
    assert pool.lookup("h", TOKENS_B) is None  # same hash, other tokens: a collision, not a hit
    assert pool.lookup("h", TOKENS_A[:3]) is None
    assert pool.lookup("other", TOKENS_A) is None


def test_touch_on_a_free_cached_block_revives_it():
    pool = CheckedPool(num_blocks=6, block_size=4)
    assert pool.allocate(3) == [1, 2, 3]
    pool.cache_block(2, "h2", TOKENS_A)
    pool.free([3, 2, 1])
    assert free_list(pool) == [4, 5, 3, 2, 1]

    block = pool.lookup("h2", TOKENS_A)
    assert block == 2
    pool.touch(block)
    assert pool.ref_counts[2] == 1
    assert free_list(pool) == [4, 5, 3, 1]  # the rest keep their order
    # Held again: allocating everything else cannot evict it.
    assert pool.allocate(4) == [4, 5, 3, 1]
    assert pool.lookup("h2", TOKENS_A) == 2
    assert pool.num_evictions == 0
    pool.touch(2)
    assert pool.ref_counts[2] == 2


def test_cache_block_keeps_the_first_block_for_a_hash():
    pool = CheckedPool(num_blocks=4, block_size=4)
    assert pool.allocate(2) == [1, 2]
    pool.cache_block(1, "h", TOKENS_A)
    pool.cache_block(2, "h", TOKENS_A)  # computed concurrently by another request
    assert pool.lookup("h", TOKENS_A) == 1
    assert pool.block_hashes[2] is None
    pool.cache_block(1, "h", TOKENS_A)  # re-registering is idempotent
    assert pool.hash_to_block == {"h": 1}
    # Reallocating block 2 evicts nothing (it was never registered).
    pool.free([2])
    assert pool.allocate(2) == [3, 2]
    assert pool.num_evictions == 0
    assert pool.lookup("h", TOKENS_A) == 1


def test_cache_block_requires_a_held_block():
    pool = CheckedPool(num_blocks=4, block_size=4)
    with pytest.raises(AssertionError):
        pool.cache_block(1, "h", TOKENS_A)
    assert pool.hash_to_block == {}


def test_evicting_counts_each_reallocated_cached_block():
    pool = CheckedPool(num_blocks=5, block_size=4)
    assert pool.allocate(4) == [1, 2, 3, 4]
    for block in (1, 2, 3):
        pool.cache_block(block, f"h{block}", [block] * 4)
    pool.free([3, 2, 1, 4])
    assert free_list(pool) == [3, 2, 1, 4]
    assert pool.allocate(2) == [3, 2]
    assert pool.num_evictions == 2
    assert [pool.lookup(f"h{b}", [b] * 4) for b in (1, 2, 3)] == [1, None, None]


# ------------------------------------------------------------------ block hashes

MODEL = "tiny:0123456789abcdef"


def test_hash_block_is_stable_across_processes():
    parent = hash_block(None, [1, 2, 3, 4], MODEL)
    child = hash_block(parent, [5, 6, 7, 8], MODEL)
    code = (
        "from kvstore.hashing import hash_block; "
        f"p = hash_block(None, [1, 2, 3, 4], {MODEL!r}); "
        f"print(p); print(hash_block(p, [5, 6, 7, 8], {MODEL!r}))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            cwd=REPO_ROOT, timeout=60, check=True)
    assert result.stdout.split() == [parent, child]
    assert len(parent) == 32 and int(parent, 16) >= 0


def test_hash_block_depends_on_parent_tokens_and_model():
    base = hash_block(None, [1, 2, 3, 4], MODEL)
    assert hash_block(None, [1, 2, 3, 4], MODEL) == base
    assert hash_block(None, (1, 2, 3, 4), MODEL) == base
    variants = {
        hash_block(base, [1, 2, 3, 4], MODEL),       # other parent
        hash_block(None, [1, 2, 3, 5], MODEL),       # other last token
        hash_block(None, [2, 1, 3, 4], MODEL),       # same tokens, other order
        hash_block(None, [1, 2, 3, 4], "other:0"),   # other weights
        hash_block("", [1, 2, 3, 4], "x" + MODEL),
    }
    assert base not in variants and len(variants) == 5
    # A different parent changes the id even when the block's own tokens are the same.
    assert hash_block(hash_block(None, [9] * 4, MODEL), [1] * 4, MODEL) != \
        hash_block(hash_block(None, [8] * 4, MODEL), [1] * 4, MODEL)


def test_hash_blocks_chains_full_blocks_and_ignores_the_partial_tail():
    tokens = list(range(1000, 1040))  # 40 tokens: two full blocks of 16 and 8 left over
    hashes = hash_blocks(tokens, 16, MODEL)
    h0 = hash_block(None, tokens[:16], MODEL)
    h1 = hash_block(h0, tokens[16:32], MODEL)
    assert hashes == [h0, h1]
    assert hash_blocks(tokens + [7] * 7, 16, MODEL) == [h0, h1]   # 47 tokens: still two
    assert hash_blocks(tokens[:32], 16, MODEL) == [h0, h1]        # exactly two full blocks
    assert hash_blocks(tokens[:15], 16, MODEL) == []
    assert hash_blocks([], 16, MODEL) == []
    extended = hash_blocks(tokens + [7] * 8, 16, MODEL)           # 48: a third block
    assert extended[:2] == [h0, h1] and len(extended) == 3
    # Continuing a chain from a parent gives the same ids as hashing from the start.
    assert hash_blocks(tokens[16:32], 16, MODEL, parent_hash=h0) == [h1]
    # A change in the first block changes every later id.
    changed = hash_blocks([0] + tokens[1:], 16, MODEL)
    assert changed[0] != h0 and changed[1] != h1


def test_a_cache_salt_hashes_the_whole_chain_apart_and_unsalted_ids_stay_the_same():
    tokens = list(range(1000, 1040))
    plain = hash_blocks(tokens, 16, MODEL)
    # The ids of before cache_salt existed (blocks already in a store stay valid).
    assert plain == ["56822fc7c37dfadc1ad3babdbc9ee250", "174bf77ac2871cd48661ca9d3964945a"]
    assert hash_blocks(tokens, 16, MODEL, cache_salt=None) == plain
    alice = hash_blocks(tokens, 16, MODEL, cache_salt="alice-secret")
    bob = hash_blocks(tokens, 16, MODEL, cache_salt="bob-secret")
    # Salted, no block of the prompt is shared with the unsalted chain or with another salt's...
    assert not set(alice) & set(plain) and not set(alice) & set(bob) and not set(bob) & set(plain)
    # ...and the same salt shares all of them, chained as any other (the salt rides on the parent).
    assert hash_blocks(tokens, 16, MODEL, cache_salt="alice-secret") == alice
    assert hash_blocks(tokens[16:32], 16, MODEL, parent_hash=alice[0], cache_salt="alice-secret") == alice[1:]
    assert alice[0] == hash_block(None, tokens[:16], MODEL, "alice-secret")
