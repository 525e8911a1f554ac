"""Blocks behind a sliding window are freed while the request runs (every layer a window layer).

Unit tests over the block manager and the scheduler (no model) check the exact block ids, ref
counts, the null entries and what must not be freed (handoffs, pooling, prompt logprobs); then a
tiny random-init Mistral (window 24, tests/test_families.py's) must give transformers' greedy tokens
while its pool shows the freeing: a request's held blocks stay bounded, a long generation fits a
pool too small for it without the freeing, and a later identical prompt still hits the prefix cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from baton import LLM, SamplingParams
from baton.common.finish_reason import FinishReason
from baton.engine.block_manager import BlockManager, blocks_for
from baton.engine.block_pool import BlockPool
from baton.model.config import ModelConfig
from baton.engine.pooling import Pooling, PoolState
from baton.engine.scheduler import SchedulerOutput
from baton.engine.sequence import Sequence, SequenceStatus
from baton.engine.window_blocks import freeable_window, num_dead_blocks, num_released
from tests.test_families import VOCAB, WINDOW, family_dir  # noqa: F401 (a fixture)
from tests.test_scheduler import Sim, out_token

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 8
W = WINDOW  # 24: three blocks of 8
MODEL = "tiny:window"
BOUND = -(-(W + BS) // BS) + 1  # blocks a decoding request may hold at most


def make(num_blocks: int = 20, window: int | None = W) -> tuple[BlockPool, BlockManager]:
    pool = BlockPool(num_blocks, BS)
    return pool, BlockManager(pool, MODEL, window=window)


def seq_of(seq_id: str, num_tokens: int, base: int = 100, **kwargs: Any) -> Sequence:
    params = SamplingParams(max_tokens=64, temperature=0, prompt_logprobs=kwargs.pop("prompt_logprobs", None))
    return Sequence(seq_id, [base + i for i in range(num_tokens)], params, **kwargs)


def run_chunk(bm: BlockManager, seq: Sequence, n: int, computed: list[int] | None = None) -> list[int]:
    """One step of `n` tokens as the scheduler applies it: allocate, compute, register, release."""
    assert bm.allocate_slots(seq, n, computed) is not None
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)
    released = bm.release_out_of_window(seq)
    bm.pool.check_invariants()
    return released


def decode(bm: BlockManager, seq: Sequence) -> list[int]:
    seq.append_token(7, 0.0)
    return run_chunk(bm, seq, 1)


def assert_exact_window(seq: Sequence) -> None:
    """Entry k is null exactly when no query at a position >= computed attends any of its keys
    (key j is seen by query i when i - W < j <= i): its last position is <= computed - W."""
    c = seq.num_computed_tokens
    for k, block in enumerate(seq.block_table):
        last = (k + 1) * BS - 1
        assert (block == 0) == (last <= c - W), (k, c, seq.block_table)


# ------------------------------------------------------------------ the rule and the null entries

def test_dead_blocks_follow_transformers_window_rule():
    # the next query sits at position c and sees keys c - W + 1 .. c
    assert num_dead_blocks(W - 1, W, BS) == 0  # key 0 is still seen by the query at W - 1
    assert num_dead_blocks(W + BS - 2, W, BS) == 0  # key 7 is seen by the query at W + 6
    assert num_dead_blocks(W + BS - 1, W, BS) == 1  # the query at W + 7 sees keys 8.. only
    assert num_released([]) == 0 and num_released([0, 0, 5, 6]) == 2 and num_released([0, 0]) == 2


def test_window_blocks_are_freed_where_no_global_layer_shares_their_table():
    def config(sliding: list[bool], window: int | None = W) -> ModelConfig:
        return ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=len(sliding), num_heads=1,
                           num_kv_heads=1, head_dim=8, sliding_window=window, layer_sliding=sliding)

    assert freeable_window(config([True, True, True])) == W  # Mistral
    # Gemma 2: its window layers get tables of their own (tests/test_kv_groups.py), freed behind the window
    assert freeable_window(config([True, False, True, False])) == W
    # more global than window layers keep one table, which the global layers read whole
    assert freeable_window(config([True, False, False])) is None
    assert freeable_window(config([False, False], window=None)) is None
    assert freeable_window(config([True, True], window=None)) is None


def test_decode_frees_exactly_the_blocks_behind_the_window():
    pool, bm = make()
    seq = seq_of("a", 40)
    assert run_chunk(bm, seq, 40) == [1, 2]  # positions 0-15: the next query (40) sees 17..40
    assert seq.block_table == [0, 0, 3, 4, 5] and pool.num_free_blocks == 19 - 3
    assert pool.ref_counts[1] == pool.ref_counts[2] == 0 and pool.ref_counts[0] == 0
    released = []
    for _ in range(20):
        released += decode(bm, seq)
        assert_exact_window(seq)
        assert len(seq.block_table) - num_released(seq.block_table) <= BOUND
    assert seq.num_computed_tokens == 60
    assert released == [3, 4]
    assert seq.block_table == [0, 0, 0, 0, 5, 6, 7, 8]
    assert pool.num_free_blocks == 19 - 4 and pool.num_used_blocks == 4
    assert bm.num_released_blocks == 4
    bm.free(seq)  # the null entries are not freed again
    assert pool.num_free_blocks == 19 and not any(pool.ref_counts)
    pool.check_invariants()


def test_a_shared_block_stays_until_its_last_holder_releases_it_and_stays_cached():
    pool, bm = make()
    a = seq_of("a", 40)
    assert bm.allocate_slots(a, 40) == [1, 2, 3, 4, 5]
    a.num_computed_tokens = 40
    bm.cache_full_blocks(a)
    b = seq_of("b", 40)
    hits = bm.get_computed_blocks(b)
    assert hits == [1, 2, 3, 4]
    run_chunk(bm, b, 8, hits)  # b computes its last block; 1 and 2 are dead for it too
    assert b.block_table == [0, 0, 3, 4, 6]
    assert pool.ref_counts[1] == pool.ref_counts[2] == 1  # a still holds them
    assert pool.num_free_blocks == 19 - 6
    assert bm.release_out_of_window(a) == [1, 2]
    assert pool.ref_counts[1] == pool.ref_counts[2] == 0 and pool.num_free_blocks == 19 - 4
    # freed, but hashed: a third request with the same prompt still hits them
    c = seq_of("c", 40)
    assert bm.get_computed_blocks(c) == [1, 2, 3, 4]
    for seq in (a, b):
        bm.free(seq)
    assert pool.num_free_blocks == 19 and not any(pool.ref_counts)


def test_released_entries_are_never_registered_under_a_hash():
    pool, bm = make()
    seq = seq_of("a", 48)
    run_chunk(bm, seq, 48)
    assert seq.block_table[:3] == [0, 0, 0]
    seq.num_registered_blocks = 0  # even asked to register from the start again
    bm.cache_full_blocks(seq)
    assert pool.block_hashes[0] is None and 0 not in pool.hash_to_block.values()
    pool.check_invariants()


@pytest.mark.parametrize("kind", ["remote_decode", "pooling", "prompt_logprobs", "no window"])
def test_what_is_never_freed_early(kind):
    pool, bm = make(window=None if kind == "no window" else W)
    kwargs: dict[str, Any] = {"remote_decode": {"remote_decode": True}, "pooling": {"pooling": PoolState(Pooling.LAST, 60)},
                              "prompt_logprobs": {"prompt_logprobs": 1}, "no window": {}}[kind]
    seq = seq_of("a", 60, **kwargs)
    assert run_chunk(bm, seq, 60) == []
    assert 0 not in seq.block_table and pool.num_used_blocks == 8


def test_rollback_of_the_tail_leaves_the_null_entries():
    pool, bm = make()
    seq = seq_of("a", 57)
    run_chunk(bm, seq, 57)
    assert seq.block_table == [0, 0, 0, 0, 5, 6, 7, 8]
    # a verify row's proposals took two more blocks; rollback frees past the computed tokens
    assert bm.allocate_slots(seq, 1 + 15) == [9, 10]
    keep = blocks_for(seq.num_computed_tokens, BS)
    pool.free(list(reversed(seq.block_table[keep:])))
    del seq.block_table[keep:]
    assert seq.block_table == [0, 0, 0, 0, 5, 6, 7, 8] and pool.num_used_blocks == 4
    bm.free(seq)
    pool.check_invariants()


# ------------------------------------------------------------------ through the scheduler (no model)

def window_sim(num_blocks: int, **kwargs: Any) -> Sim:
    sim = Sim(num_blocks, block_size=BS, **kwargs)
    sim.bm.window = W
    return sim


def test_a_generation_longer_than_the_pool_fits_with_the_window():
    # 30 + 100 tokens need 17 blocks; the pool has 8 (prompt: 4, then at most BOUND while decoding)
    sim = window_sim(num_blocks=9)
    seq = sim.add("a", 30, 100)
    steps = 0
    while sim.sched.has_work():
        sim.step()
        steps += 1
        if not seq.is_finished:
            assert sim.pool.num_used_blocks <= BOUND
            assert_exact_window(seq)
    sim.assert_all_done()
    # the last release came when 128 tokens were computed (the step after it finished the request)
    assert sim.sched.num_preemptions == 0 and sim.bm.num_released_blocks == num_dead_blocks(128, W, BS)
    # without the window the same request cannot finish: it preempts itself, and then does not fit
    plain = Sim(num_blocks=9, block_size=BS)
    seq = plain.add("a", 30, 100)
    while plain.sched.has_work():
        out = plain.sched.schedule()
        sampled = [s for s, n in out.scheduled if s.num_computed_tokens + n == s.num_tokens]
        tokens = [out_token(s.seq_id, s.num_output_tokens) for s in sampled]
        plain.sched.update_from_output(out, sampled, tokens, [0.0] * len(tokens))
    assert seq.finish_reason is FinishReason.ERROR and seq.num_output_tokens < 100


@pytest.mark.parametrize("budget", [512, 8])
def test_preemption_and_chunked_prefill_with_the_window(budget):
    # three 20-token prompts admitted into 10 blocks, each growing to 4 or 5 blocks: they preempt
    # each other, are computed again, and every token is still the expected one
    sim = window_sim(num_blocks=11, budget=budget)
    for name in "abc":
        sim.add(name, 20, 40)
    sim.run()
    sim.assert_all_done()
    assert sim.bm.num_released_blocks > 0
    assert sim.sched.num_preemptions > 0
    sim.assert_no_thrash(max_per_request=3)


def test_a_preempted_request_restarts_from_its_released_blocks_in_the_prefix_cache():
    sim = window_sim(num_blocks=40)
    seq = sim.add("a", 40, 30)
    while seq.num_computed_tokens < 50:
        sim.step()
    assert seq.block_table[:3] == [0, 0, 0]  # released, still hashed in the free list
    sim.sched._preempt(seq, SchedulerOutput(), reason="test")
    assert sim.pool.num_used_blocks == 0
    sim.step()  # re-admitted: every full block of its 51 tokens is a hit, released ones included
    assert seq.num_cached_tokens == 48 and seq.num_computed_tokens == 51
    assert seq.block_table[:3] == [0, 0, 0]  # and the dead ones are released again
    assert_exact_window(seq)
    sim.run()
    sim.assert_all_done()


def test_a_handed_off_request_keeps_its_prompt_blocks():
    sim = window_sim(num_blocks=20)
    seq = Sequence("a", list(range(100, 160)), SamplingParams(max_tokens=5, temperature=0), remote_decode=True)
    sim.sched.add(seq)
    sim.seqs["a"] = seq
    sim.step()
    assert seq.finish_reason is FinishReason.HANDOFF and seq.status is SequenceStatus.FINISHED
    assert len(seq.block_table) == 8 and 0 not in seq.block_table  # all there for `build_save`
    sim.sched.free_finished(seq)
    assert sim.pool.num_free_blocks == 19


def test_a_request_loaded_from_the_store_frees_behind_the_window_once_it_runs():
    from kvstore.hashing import hash_blocks
    from baton.engine.kv_types import RemoteKV

    sim = window_sim(num_blocks=20)
    seq = sim.add("a", 60, 10)
    seq.remote_kv = RemoteKV(tuple(hash_blocks(seq.token_ids, BS, "test-model")[:6]))
    out = sim.sched.schedule()
    assert seq.status is SequenceStatus.WAITING_FOR_KV
    [load] = out.kv_loads
    assert [b.block_id for b in load.blocks] == seq.block_table[:6] and 0 not in seq.block_table
    sim.sched.finish_kv_load("a", 48)
    assert 0 not in seq.block_table  # nothing is released while loading or at the load's end
    sim.step()
    assert seq.block_table[:4] == [0] * 4
    sim.run()
    assert seq.output_token_ids == [out_token("a", i) for i in range(10)]
    sim.assert_all_done()


# ------------------------------------------------------------------ a tiny Mistral against transformers

NEW = 48
_REF: dict[tuple[str, tuple[int, ...], int], list[int]] = {}
_HF_MODELS: dict[str, Any] = {}


def hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    key = (str(model_dir), tuple(prompt), n)
    if key not in _REF:
        from transformers import AutoModelForCausalLM

        if str(model_dir) not in _HF_MODELS:
            _HF_MODELS[str(model_dir)] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        model = _HF_MODELS[str(model_dir)]
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, eos_token_id=None, pad_token_id=0)
        _REF[key] = out[0, len(prompt):].tolist()
    return _REF[key]


def window_llm(model_dir: Path, **kwargs: Any) -> LLM:
    llm = LLM(model=str(model_dir), dtype="float32", block_size=BS, **kwargs)
    assert llm.engine.block_manager.window == freeable_window(llm.engine.model_config) == W  # the engine's own
    return llm


def record_held(llm: LLM) -> list[int]:
    """Blocks in use after each step of the engine (one request at a time in these tests)."""
    engine, held = llm.engine, []
    step = engine.step

    def recording(*args: Any, **kwargs: Any) -> Any:
        out = step(*args, **kwargs)
        if engine.scheduler.running:
            held.append(engine.pool.num_used_blocks)
        return out

    engine.step = recording  # type: ignore[method-assign]
    return held


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral(family_dir) -> Path:  # noqa: F811
    return family_dir("mistral")


@pytest.fixture(scope="module")
def long_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(24)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (70, 66)]


def test_mistral_matches_transformers_while_freeing(mistral, long_prompts):
    expected = [hf_greedy(mistral, p, NEW) for p in long_prompts]
    llm = window_llm(mistral, num_kv_blocks=64)
    held = record_held(llm)
    # one at a time: the pool's count is this request's
    outputs = [llm.generate(p, greedy())[0] for p in long_prompts]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.block_manager.num_released_blocks > 0
    # a prompt's 9 blocks are taken at admission, and its 5 dead ones freed by the same step that
    # computes it: after every step a request holds at most BOUND blocks (15 at the end without)
    assert len(held) == 2 * (NEW - 1) and max(held) <= BOUND < blocks_for(70 + NEW, BS)
    # batched and in 16-token chunks: the same tokens
    llm = window_llm(mistral, num_kv_blocks=64, max_num_batched_tokens=16)
    assert [o.outputs[0].token_ids for o in llm.generate(long_prompts, greedy())] == expected


def test_mistral_long_generation_fits_a_small_pool_and_reuses_its_prefix(mistral, long_prompts):
    prompt, n = long_prompts[0], 64
    expected = hf_greedy(mistral, prompt, n)
    # 70 + 64 tokens are 17 blocks; the pool has 12 (the prompt takes 9, decoding at most BOUND)
    assert blocks_for(70 + n, BS) > 12
    llm = window_llm(mistral, num_kv_blocks=13)
    first = llm.generate(prompt, greedy(n))[0]
    assert first.outputs[0].token_ids == expected and first.outputs[0].finish_reason == "length"
    assert llm.engine.scheduler.num_preemptions == 0
    # the same prompt again, after the first finished: its first blocks (released early, still
    # hashed in the free list) are hits
    llm = window_llm(mistral, num_kv_blocks=64)
    llm.generate(prompt, greedy())
    again = llm.generate(prompt, greedy())[0]
    assert again.num_cached_tokens == 64 and again.outputs[0].token_ids == expected[:NEW]


def test_mistral_speculative_rollback_with_the_window(mistral):
    gen = torch.Generator().manual_seed(5)
    motif = torch.randint(3, VOCAB, (9,), generator=gen).tolist()
    prompt = (motif * 8)[:70]  # repetitive: the n-gram proposer has something to propose
    expected = hf_greedy(mistral, prompt, 40)
    llm = window_llm(mistral, num_kv_blocks=64,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    out = llm.generate(prompt, greedy(40))[0]
    assert out.outputs[0].token_ids == expected
    assert llm.engine.scheduler.speculator.stats.num_drafts > 0
    assert llm.engine.block_manager.num_released_blocks > 0
