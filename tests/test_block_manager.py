"""Per-request block accounting: slot allocation, prefix-cache hits, freeing."""

from __future__ import annotations

import pytest

from baton.engine.block_manager import BlockManager, blocks_for
from baton.common.sampling_params import SamplingParams
from baton.engine.sequence import Sequence
from baton.engine.block_pool import BlockPool
from kvstore.hashing import hash_blocks

BS = 16
MODEL = "tiny:test"


def make(num_blocks: int = 12, prefix_caching: bool = True) -> tuple[BlockPool, BlockManager]:
    pool = BlockPool(num_blocks, BS)
    return pool, BlockManager(pool, MODEL, enable_prefix_caching=prefix_caching)


def seq_of(seq_id: str, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(max_tokens=64, temperature=0))


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    """What the engine does after a step that ran `n` tokens of `seq`."""
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)
    bm.pool.check_invariants()


def prefill(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit `seq` the way the scheduler does (prefix hits first), run its whole prompt."""
    computed = bm.get_computed_blocks(seq)
    remaining = seq.num_tokens - len(computed) * BS
    new = bm.allocate_slots(seq, remaining, computed)
    assert new is not None
    bm.record_prefix_lookup(seq, computed)
    compute(bm, seq, remaining)
    return new


PROMPT = list(range(1000, 1040))  # 40 tokens: blocks of 16, 16, 8


def test_blocks_for():
    assert [blocks_for(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


def test_allocate_slots_for_a_40_token_prompt_gives_blocks_1_2_3():
    pool, bm = make()
    seq = seq_of("a", PROMPT)
    assert bm.allocate_slots(seq, 40) == [1, 2, 3]
    assert seq.block_table == [1, 2, 3]
    assert seq.num_computed_tokens == 0  # allocation reserves slots; computing is the engine's step
    assert list(pool.free_blocks) == list(range(4, 12))
    assert pool.ref_counts[1:4] == [1, 1, 1]


def test_allocate_slots_in_chunks_matches_one_shot():
    pool, bm = make()
    seq = seq_of("a", PROMPT)
    assert bm.allocate_slots(seq, 10) == [1]
    compute(bm, seq, 10)
    assert bm.allocate_slots(seq, 10) == [2]   # tokens 10..19 cross into the second block
    compute(bm, seq, 10)
    assert bm.allocate_slots(seq, 12) == []    # tokens 20..31 fit in block 2
    compute(bm, seq, 12)
    assert bm.allocate_slots(seq, 8) == [3]
    compute(bm, seq, 8)
    assert seq.block_table == [1, 2, 3]


def test_decode_growth_allocates_a_block_only_when_the_last_is_full():
    pool, bm = make()
    seq = seq_of("a", PROMPT)
    prefill(bm, seq)
    assert seq.block_table == [1, 2, 3]
    # Tokens 40..47 fit in block 3 (positions 32..47).
    for step in range(8):
        seq.append_token(5000 + step, 0.0)
        assert bm.allocate_slots(seq, 1) == []
        compute(bm, seq, 1)
    assert seq.num_computed_tokens == 48
    seq.append_token(6000, 0.0)  # position 48: a new block
    assert bm.allocate_slots(seq, 1) == [4]
    assert seq.block_table == [1, 2, 3, 4]
    assert list(pool.free_blocks) == list(range(5, 12))


def test_allocate_slots_returns_none_and_changes_nothing_when_the_pool_is_short():
    pool, bm = make(num_blocks=4)  # 3 usable
    seq = seq_of("a", list(range(60)))  # needs 4
    assert bm.allocate_slots(seq, 60) is None
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert list(pool.free_blocks) == [1, 2, 3]
    assert bm.allocate_slots(seq, 48) == [1, 2, 3]  # a chunk that fits


def test_only_fully_computed_blocks_are_registered():
    pool, bm = make()
    seq = seq_of("a", PROMPT)
    bm.allocate_slots(seq, 40)
    compute(bm, seq, 20)
    hashes = hash_blocks(PROMPT, BS, MODEL)
    assert pool.hash_to_block == {hashes[0]: 1}
    compute(bm, seq, 20)
    assert pool.hash_to_block == {hashes[0]: 1, hashes[1]: 2}
    assert pool.block_hashes[3] is None  # 8 of 16 tokens: a partial block has no id
    assert seq.block_hashes(BS, MODEL) == hashes


def test_second_request_with_the_same_prefix_reuses_the_same_blocks():
    pool, bm = make()
    a = seq_of("a", PROMPT)
    prefill(bm, a)
    assert a.block_table == [1, 2, 3]
    assert a.num_cached_tokens == 0

    b = seq_of("b", PROMPT[:32] + list(range(7000, 7013)))  # same 32-token prefix, 45 tokens
    assert bm.get_computed_blocks(b) == [1, 2]
    computed = bm.get_computed_blocks(b)
    assert bm.num_blocks_to_take(b, 13, computed) == 1
    assert bm.allocate_slots(b, 13, computed) == [4]
    bm.record_prefix_lookup(b, computed)
    assert b.block_table == [1, 2, 4]
    assert b.num_computed_tokens == 32  # the prefix jumps straight to computed
    assert b.num_cached_tokens == 32
    assert pool.ref_counts[1:5] == [2, 2, 1, 1]
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (40 + 45, 32)
    compute(bm, b, 13)

    # Freeing one holder keeps the shared blocks alive for the other.
    bm.free(a)
    assert pool.ref_counts[1:5] == [1, 1, 0, 1]
    assert list(pool.free_blocks) == list(range(5, 12)) + [3]
    bm.free(b)
    assert list(pool.free_blocks) == list(range(5, 12)) + [3, 4, 2, 1]
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_prefix_hit_on_freed_blocks_revives_them():
    pool, bm = make()
    a = seq_of("a", PROMPT)
    prefill(bm, a)
    bm.free(a)
    assert list(pool.free_blocks) == list(range(4, 12)) + [3, 2, 1]

    b = seq_of("b", PROMPT + [1, 2, 3])
    computed = bm.get_computed_blocks(b)
    assert computed == [1, 2]
    # 2 revived cached blocks + 1 new block for tokens 32..42
    assert bm.num_blocks_to_take(b, b.num_tokens - 32, computed) == 3
    assert bm.allocate_slots(b, b.num_tokens - 32, computed) == [4]
    assert b.block_table == [1, 2, 4]
    assert list(pool.free_blocks) == list(range(5, 12)) + [3]
    assert pool.num_evictions == 0
    pool.check_invariants()


def test_prefix_hit_is_refused_when_revived_blocks_do_not_fit():
    pool, bm = make(num_blocks=4)  # 3 usable
    a = seq_of("a", PROMPT)
    prefill(bm, a)
    bm.free(a)
    b = seq_of("b", PROMPT)
    computed = bm.get_computed_blocks(b)
    assert computed == [1, 2]
    other = seq_of("x", [1])
    assert bm.allocate_slots(other, 1) == [3]  # the uncached block goes first
    # b needs 2 revived + 1 new = 3 blocks, only 2 are free: nothing may change.
    assert bm.allocate_slots(b, 8, computed) is None
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert pool.ref_counts[1:3] == [0, 0]
    assert list(pool.free_blocks) == [2, 1]
    pool.check_invariants()


def test_all_tokens_cached_still_leaves_a_token_to_compute():
    pool, bm = make()
    a = seq_of("a", PROMPT[:32])  # exactly two full blocks
    prefill(bm, a)
    assert a.block_table == [1, 2]
    b = seq_of("b", PROMPT[:32])
    computed = bm.get_computed_blocks(b)
    assert computed == [1]  # the last block is recomputed so the step yields logits
    assert b.num_tokens - len(computed) * BS == 16
    c = seq_of("c", PROMPT[:33])  # one token past the cached blocks: both are hits
    assert bm.get_computed_blocks(c) == [1, 2]


def test_prefix_hits_stop_at_the_first_differing_block():
    pool, bm = make()
    a = seq_of("a", PROMPT)
    prefill(bm, a)
    diverged = PROMPT[:20] + [9] + PROMPT[21:]  # block 2 differs, block 3.. cannot match either
    assert bm.get_computed_blocks(seq_of("b", diverged)) == [1]
    assert bm.get_computed_blocks(seq_of("c", [9] + PROMPT[1:])) == []


def test_no_prefix_hits_across_models_or_when_disabled():
    pool, bm = make()
    prefill(bm, seq_of("a", PROMPT))
    other_model = BlockManager(pool, "other:model")
    assert other_model.get_computed_blocks(seq_of("b", PROMPT)) == []

    pool2, off = make(prefix_caching=False)
    a = seq_of("a", PROMPT)
    prefill(off, a)
    assert pool2.hash_to_block == {}
    assert off.get_computed_blocks(seq_of("b", PROMPT)) == []


def test_blocks_filled_by_generated_tokens_become_prefix_hits():
    pool, bm = make()
    a = seq_of("a", PROMPT)
    prefill(bm, a)
    generated = list(range(8000, 8008))
    for token in generated:  # fills block 3 (positions 40..47)
        a.append_token(token, 0.0)
        bm.allocate_slots(a, 1)
        compute(bm, a, 1)
    assert pool.block_hashes[3] is not None
    # A follow-up turn that starts with the whole conversation so far hits all three blocks.
    follow = seq_of("b", PROMPT + generated + [42])
    assert bm.get_computed_blocks(follow) == [1, 2, 3]


def test_free_returns_blocks_in_reverse_order_and_resets_the_sequence():
    pool, bm = make()
    a = seq_of("a", PROMPT)
    prefill(bm, a)
    b = seq_of("b", list(range(20)))
    prefill(bm, b)
    assert b.block_table == [4, 5]
    bm.free(a)
    assert list(pool.free_blocks) == list(range(6, 12)) + [3, 2, 1]
    assert a.block_table == [] and a.num_computed_tokens == 0 and a.num_registered_blocks == 0
    bm.free(b)
    assert list(pool.free_blocks) == list(range(6, 12)) + [3, 2, 1, 5, 4]
    assert pool.num_free_blocks == pool.num_blocks - 1
    # The tail blocks are reused first: block 1 (the shared prefix's root) is evicted last.
    assert bm.allocate_slots(seq_of("c", list(range(500, 600))), 100) == [6, 7, 8, 9, 10, 11, 3]
    assert pool.lookup(hash_blocks(PROMPT, BS, MODEL)[0], PROMPT[:16]) == 1
    assert pool.num_evictions == 0  # block 3 was partial, never cached


def test_resumed_sequence_rehits_its_own_blocks():
    """Preemption frees a request's blocks; on resume its prompt + output prefix is found again."""
    pool, bm = make()
    a = seq_of("a", PROMPT)
    prefill(bm, a)
    for token in range(9000, 9010):  # 50 tokens: three full blocks are computed
        a.append_token(token, 0.0)
        bm.allocate_slots(a, 1)
        compute(bm, a, 1)
    assert a.block_table == [1, 2, 3, 4]
    bm.free(a)
    assert bm.get_computed_blocks(a) == [1, 2, 3]
    assert list(pool.free_blocks) == list(range(5, 12)) + [4, 3, 2, 1]
    remaining = a.num_tokens - 48
    assert bm.allocate_slots(a, remaining, [1, 2, 3]) == [5]
    assert list(pool.free_blocks) == list(range(6, 12)) + [4]
    assert a.num_computed_tokens == 48
    pool.check_invariants()


def test_many_sequences_end_with_an_all_free_pool():
    pool, bm = make(num_blocks=40)
    # 6, 15, 24, 33, 42 tokens: each later one extends an earlier one's full blocks
    seqs = [seq_of(str(i), PROMPT[: 5 + 9 * i] + [i]) for i in range(5)]
    for s in seqs:
        prefill(bm, s)
    assert [s.num_cached_tokens for s in seqs] == [0, 0, 0, 16, 32]
    for s in seqs:
        s.append_token(1, 0.0)
        assert bm.allocate_slots(s, 1) is not None
        compute(bm, s, 1)
    for s in reversed(seqs):
        bm.free(s)
        pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks - 1
    assert all(count == 0 for count in pool.ref_counts)


def test_record_prefix_lookup_counts():
    pool, bm = make()
    prefill(bm, seq_of("a", PROMPT))
    prefill(bm, seq_of("b", PROMPT))
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (80, 32)


@pytest.mark.parametrize("n", [1, 15, 16, 17])
def test_growth_boundaries(n):
    pool, bm = make()
    seq = seq_of("a", list(range(n)))
    assert bm.allocate_slots(seq, n) == list(range(1, blocks_for(n, BS) + 1))
    compute(bm, seq, n)
    seq.append_token(1, 0.0)
    grew = bm.allocate_slots(seq, 1)
    assert grew == ([blocks_for(n, BS) + 1] if n % BS == 0 else [])
