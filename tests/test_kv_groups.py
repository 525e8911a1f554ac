"""Window layers in block tables of their own (baton.model.kv_groups): Gemma 2/3, gpt-oss, OLMo 3.

The layout (which table and which cache tensor each layer gets), the block manager's exact block ids
(a position block takes one block per table; the window tables' entries behind the window are freed,
the global table's never; a prefix hit needs the window tables' blocks its first query sees; a rollback cuts every table), and a
tiny random-init Gemma 3 (window 24, tests/test_families.py's) through `LLM.generate`: transformers'
greedy tokens while a long generation fits a pool that could not hold it with one table, a repeated
prompt hitting every table's blocks, and a block read out and written back in the store's form.
"""

from __future__ import annotations

from typing import Any

import dataclasses

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.block_manager import BlockManager, window_hash
from baton.engine.block_pool import BlockPool
from baton.engine.sequence import Sequence
from baton.model.config import ModelConfig
from baton.model.kv_groups import kv_groups
from baton.model.model_runner import kv_bytes_per_block
from tests.test_families import VOCAB, WINDOW, family_dir  # noqa: F401 (a fixture)
from tests.test_window_blocks import hf_greedy, run_chunk

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 8
W = WINDOW  # 24: three blocks of 8
MODEL = "tiny:groups"


def config_of(types: list[str], head_dim: int = 16, **extra: Any) -> ModelConfig:
    return ModelConfig(model_type="gemma3_text", vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_layers=len(types), num_heads=4, num_kv_heads=1, head_dim=head_dim, rms_norm_eps=1e-6,
                       rope_theta=10000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                       sliding_window=512, layer_sliding=[t == "sliding" for t in types], **extra)


def gemma3_types(num_layers: int, pattern: int = 6) -> list[str]:
    return ["sliding" if (i + 1) % pattern else "full" for i in range(num_layers)]


# ------------------------------------------------------------------ the layout

def test_gemma3_1b_layers_split_into_a_global_table_and_six_window_tables():
    groups = kv_groups(config_of(gemma3_types(26)))  # global layers 5, 11, 17, 23
    assert groups.group_size == 4 and groups.num_tables == 7
    assert [groups.table_of[i] for i in (5, 11, 17, 23)] == [0, 0, 0, 0]
    assert [groups.position_of[i] for i in (5, 11, 17, 23)] == [0, 1, 2, 3]
    window = [i for i in range(26) if i not in (5, 11, 17, 23)]
    # window layers in order, four to a table; the last table holds two (its tensors 2, 3 unused)
    assert [groups.table_of[i] for i in window] == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4 + [5] * 4 + [6] * 2
    assert [groups.position_of[i] for i in window] == [0, 1, 2, 3] * 5 + [0, 1]
    assert groups.layers_of(6) == [24, 25]


def test_gemma2_alternation_is_two_tables_of_half_the_layers():
    groups = kv_groups(config_of(["sliding", "full"] * 3))
    assert (groups.group_size, groups.num_tables) == (3, 2)
    assert groups.table_of == (1, 0, 1, 0, 1, 0) and groups.position_of == (0, 0, 1, 1, 2, 2)


def test_llama4_chunked_layers_get_window_tables(family_dir):
    llama4 = ModelConfig.from_dir(family_dir("llama4_text"))  # rotary layers chunked, every 4th global (NoPE)
    assert llama4.chunked_window and kv_groups(llama4).table_of == (1, 2, 3, 0)


def test_gemma4_keeps_one_table(family_dir):
    """Gemma 4's global layers are wider than its window layers (32 against 16 here; 512 against 256
    released): a tensor per table position would pad every window block to the global width."""
    assert not kv_groups(ModelConfig.from_dir(family_dir("gemma4_text"))).grouped


@pytest.mark.parametrize("types, why", [
    (["sliding"] * 4, "an all-window model frees its one table in place"),
    (["full"] * 4, "no window"),
    (["full", "full", "full", "sliding"], "more global than window layers: tables would not pay"),
])
def test_one_table_where_grouping_is_unsound_or_pointless(types, why):
    groups = kv_groups(config_of(types))
    assert not groups.grouped and groups.group_size == 4 and groups.position_of == (0, 1, 2, 3), why


def test_a_block_holds_one_group_of_layers_and_a_long_request_about_a_fifth_of_the_bytes():
    """The figure the README gives: a Gemma-3-1B-shaped model (26 layers, 1 KV head of 256, window
    512) in bf16 at 8k tokens of context, 16-token blocks."""
    grouped = config_of(gemma3_types(26), head_dim=256)
    one = dataclasses.replace(grouped, sliding_window=None, layer_sliding=[])
    per_block_grouped = kv_bytes_per_block(grouped, 16, torch.bfloat16)
    per_block_one = kv_bytes_per_block(one, 16, torch.bfloat16)
    assert per_block_one == 26 * 2 * 16 * 256 * 2 and per_block_grouped == 4 * 2 * 16 * 256 * 2
    positions = 8192 // 16
    held_one = positions * per_block_one  # every layer keeps every position
    # the global table keeps every position; each of 6 window tables at most (512 + 16) / 16 + 1
    held_grouped = (positions + 6 * 34) * per_block_grouped
    assert (held_one, held_grouped) == (218_103_808, 46_923_776)  # 208 MiB against 44.75 MiB


# ------------------------------------------------------------------ exact block ids

def make(num_blocks: int = 30, tables: int = 2) -> tuple[BlockPool, BlockManager]:
    pool = BlockPool(num_blocks, BS)
    return pool, BlockManager(pool, MODEL, window=W, window_tables=tables)


def seq_of(seq_id: str, num_tokens: int, base: int = 100) -> Sequence:
    return Sequence(seq_id, [base + i for i in range(num_tokens)], SamplingParams(max_tokens=64, temperature=0))


def test_a_position_block_takes_one_block_per_table_and_only_window_tables_free_behind_the_window():
    pool, bm = make()
    seq = seq_of("a", 20)
    assert bm.num_blocks_to_take(seq, 20, []) == 9  # 3 position blocks x 3 tables
    assert run_chunk(bm, seq, 20) == []
    assert seq.block_table == [1, 2, 3] and seq.window_tables == [[4, 5, 6], [7, 8, 9]]
    # decode to 32 computed tokens: the query at 32 sees keys 9.., so position block 0 is dead
    released = []
    for _ in range(12):
        seq.append_token(7, 0.0)
        released += run_chunk(bm, seq, 1)
    assert seq.num_computed_tokens == 32
    assert released == [4, 7]
    assert seq.block_table == [1, 2, 3, 10] and seq.window_tables == [[0, 5, 6, 11], [0, 8, 9, 12]]
    assert pool.ref_counts[4] == pool.ref_counts[7] == 0 and pool.ref_counts[1] == 1
    bm.free(seq)
    assert pool.num_free_blocks == pool.num_usable_blocks and seq.window_tables == []
    pool.check_invariants()


def test_a_prefix_hit_takes_every_tables_block_and_stops_where_a_window_block_was_reused():
    pool, bm = make()
    first = seq_of("a", 25)
    run_chunk(bm, first, 25)
    bm.free(first)
    again = seq_of("b", 25)
    hits = bm.get_computed_blocks(again)
    assert list(hits) == [1, 2, 3] and hits.window == [(5, 9), (6, 10), (7, 11)]
    assert bm.num_revived(hits) == 9 and bm.num_blocks_to_take(again, 1, hits) == 12
    run_chunk(bm, again, 1, hits)
    assert again.block_table == [1, 2, 3, 13] and again.window_tables == [[5, 6, 7, 14], [9, 10, 11, 15]]
    assert again.num_computed_tokens == 25
    bm.free(again)
    # the second window table's block of position block 1 (block 10) is reallocated: the hit ends before it
    for block in (1, 2, 3, 5, 6, 7, 9, 11):
        pool.touch(block)
    assert 10 in pool.allocate(pool.num_free_blocks)
    assert window_hash(again.block_hashes(BS, MODEL)[1], 2) not in pool.hash_to_block
    assert list(bm.get_computed_blocks(seq_of("d", 25))) == [1]


def test_a_follow_up_hits_past_window_blocks_its_first_turn_lost_and_a_handoff_needs_them_all():
    pool, bm = make(num_blocks=60)
    first = seq_of("a", 41)  # 6 position blocks; the query at 41 sees keys 18.., so blocks 0-1 are dead
    assert run_chunk(bm, first, 41) == [7, 8, 13, 14]
    bm.free(first)
    # another request takes the free list's head, the released window blocks among it: their hashes go
    taken = pool.allocate(45)
    assert taken is not None and {7, 8, 13, 14} <= set(taken)
    pool.free(taken)
    # the follow-up's first query (at 40) sees position blocks 2.. only: the hit needs no more
    again = seq_of("b", 41)
    hits = bm.get_computed_blocks(again)
    assert list(hits) == [1, 2, 3, 4, 5]
    assert hits.window == [(0, 0), (0, 0), (9, 15), (10, 16), (11, 17)]
    assert bm.num_revived(hits) == 11 and bm.num_blocks_to_take(again, 1, hits) == 14
    assert run_chunk(bm, again, 1, hits) == []  # (the null entries hold no reference)
    assert again.num_computed_tokens == 41 and again.block_table[:5] == [1, 2, 3, 4, 5]
    assert [table[:5] for table in again.window_tables] == [[0, 0, 9, 10, 11], [0, 0, 15, 16, 17]]
    bm.free(again)
    assert pool.num_free_blocks == pool.num_usable_blocks
    # a prefill worker's request hands every layer of every prompt block over: no hit without them
    prefill = Sequence("p", [100 + i for i in range(41)], SamplingParams(max_tokens=1), remote_decode=True)
    assert list(bm.get_computed_blocks(prefill)) == []
    pool.check_invariants()


def test_a_rollback_cuts_every_table():
    pool, bm = make()
    seq = seq_of("a", 8)
    run_chunk(bm, seq, 8)
    assert bm.allocate_slots(seq, 12) is not None  # room for 1 + 11 proposals: two more position blocks
    assert seq.block_table == [1, 4, 5] and seq.window_tables == [[2, 6, 7], [3, 8, 9]]
    bm.truncate(seq, 2)
    assert seq.block_table == [1, 4] and seq.window_tables == [[2, 6], [3, 8]]
    assert all(pool.ref_counts[b] == 0 for b in (5, 7, 9))
    pool.check_invariants()


# ------------------------------------------------------------------ a tiny Gemma 3 end to end

def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_gemma3_long_generation_fits_a_pool_one_table_could_not_hold(family_dir):
    model_dir = family_dir("gemma3_text")  # 4 layers: window, window, global, window
    groups = kv_groups(ModelConfig.from_dir(model_dir))
    assert groups.num_tables == 4 and groups.group_size == 1
    prompt = [(i * 37) % (VOCAB - 3) + 3 for i in range(30)]
    expected = hf_greedy(model_dir, prompt, 60)
    # 90 tokens: 12 position blocks of 8; one table would need 4 x 12 = 48 blocks of a layer each;
    # the global table takes 12, each window table at most (24 + 8) / 8 + 1 = 5
    llm = LLM(model=str(model_dir), dtype="float32", block_size=BS, num_kv_blocks=12 + 3 * 5 + 1,
              max_num_batched_tokens=16)
    out = llm.generate([prompt], greedy(60))[0]
    assert out.outputs[0].token_ids == expected
    assert llm.engine.scheduler.num_preemptions == 0 and llm.engine.block_manager.num_released_blocks > 0
    # a follow-up turn in this tight pool: the first turn's early window blocks were reallocated, yet
    # it resumes from its 10th position block, whose query sees only the window tables' blocks 7-9
    follow = (prompt + expected)[:80] + [5, 9, 14, 20, 27]
    again = llm.generate([follow], greedy(4))[0]
    assert again.outputs[0].token_ids == hf_greedy(model_dir, follow, 4) and again.num_cached_tokens == 80
    # (the prompt's own first blocks are gone from this pool's cache); in a roomy one, the same
    # prompt again hits every table's blocks of its full position blocks
    llm = LLM(model=str(model_dir), dtype="float32", block_size=BS, num_kv_blocks=200, max_num_batched_tokens=16)
    assert llm.generate([prompt], greedy(60))[0].outputs[0].token_ids == expected
    assert llm.engine.block_manager.num_released_blocks > 0
    again = llm.generate([prompt], greedy(8))[0]
    assert again.outputs[0].token_ids == expected[:8] and again.num_cached_tokens == 24


def test_a_block_read_out_and_written_back_lands_in_every_tables_block(family_dir):
    llm = LLM(model=str(family_dir("gemma3_text")), dtype="float32", block_size=BS, num_kv_blocks=40)
    runtime = llm.engine.runtime
    ids = (3, 7, 11, 15)
    data = torch.randn(runtime.block_shape, dtype=torch.float32)
    runtime.write_block(ids, data)
    assert torch.equal(runtime.read_block(ids), data)
    # each layer's rows went to its own table's block of its tensor, nothing into the others
    runner = runtime.runner
    for layer, (t, j) in enumerate(zip(runner.groups.table_of, runner.groups.position_of)):
        rows = runner.kv_cache[j][:, :, ids[t] * BS:(ids[t] + 1) * BS].transpose(1, 2)
        assert torch.equal(rows, data[layer])
    assert int(torch.count_nonzero(runner.kv_cache)) == data.numel()


def test_a_gemma3_target_drafted_by_itself_is_exact_and_accepted(family_dir):
    """The draft's cache is indexed by the target's global table (its rows carry no window tables),
    so a draft with window layers keeps every layer in that one table; the target frees its window
    tables and rolls every table back after each verify."""
    from tests.test_spec_draft import acceptance, draft_llm

    model_dir = family_dir("gemma3_text")
    prompt = [(i * 53) % (VOCAB - 3) + 3 for i in range(30)]
    expected = hf_greedy(model_dir, prompt, 40)
    llm = draft_llm(model_dir, model_dir, block_size=BS, num_kv_blocks=120)
    assert not llm.engine.drafter.runtime.runner.groups.grouped and llm.engine.runtime.runner.groups.grouped
    assert llm.generate([prompt], greedy(40))[0].outputs[0].token_ids == expected
    assert acceptance(llm) > 0.9 and llm.engine.block_manager.num_released_blocks > 0
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_usable_blocks
