"""Speculative decoding with a draft model (`{"method": "draft_model"}`): exact, and its KV right.

The target's greedy output is token for token what it is without speculation (and transformers'),
batched, with chunked prefill and through preemption, whatever the draft proposes: a draft that is
the target itself (every proposal should be accepted: if the draft's own KV bookkeeping were wrong,
catching up, rolling back, reusing block ids, its proposals would not be the target's tokens) and
a different model with the same tokenizer (most proposals rejected). A resumed request (a handoff's
tokens, no KV) and a prompt longer than one step's catch-up are drafted too; seeded sampling gives
speculation off's tokens; a draft with another vocabulary is refused; the pool is whole at the end.
"""

from __future__ import annotations

import json
import shutil

import pytest

from baton import LLM, SamplingParams
from baton.engine.draft_cursor import CATCH_UP_TOKENS
from tests.test_engine_tiny import assert_pool_all_free, tokens_of
from tests.test_spec_decode import greedy, hf_greedy, prompts  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory, default_model_dir):
    """Another random-init Llama with the real tokenizer: one layer, other weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("draft-llama")
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(7)
    LlamaForCausalLM(config).save_pretrained(out)
    for f in default_model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out


def draft_llm(model_dir, draft_dir, k: int = 4, force: bool | None = True, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    llm = LLM(model=str(model_dir), dtype="float32", **kwargs,
              speculative_config={"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k})
    if force is not None:
        llm.engine.scheduler.speculator.costs.force = force
    return llm


def acceptance(llm: LLM) -> float:
    stats = llm.engine.stats()
    return stats.spec_num_accepted_tokens / max(1, stats.spec_num_draft_tokens)


def test_the_target_as_its_own_draft_is_exact_and_accepted(tiny_model_dir, prompts):
    off = tokens_of(LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256).generate(prompts, greedy()))
    assert off == [hf_greedy(tiny_model_dir, p, 40) for p in prompts]
    for kwargs in ({}, {"max_num_batched_tokens": 8}, {"block_size": 4, "num_kv_blocks": 24}):
        llm = draft_llm(tiny_model_dir, tiny_model_dir, **kwargs)
        assert tokens_of(llm.generate(prompts, greedy())) == off, kwargs
        stats = llm.engine.stats()
        assert stats.spec_num_drafts > 0 and acceptance(llm) > 0.9, (kwargs, stats)
        assert stats.spec_accepted_per_pos[3] > 0, kwargs  # whole runs of 4 accepted
        assert_pool_all_free(llm)
        if "num_kv_blocks" in kwargs:
            assert llm.engine.scheduler.num_preemptions > 0  # and the draft started those over
    # fewer target steps than tokens: each verify step emitted several
    assert llm.engine.num_steps < sum(len(t) for t in off)


def test_a_different_draft_is_exact_whatever_it_proposes(tiny_model_dir, other_draft, prompts):
    off = tokens_of(LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256).generate(prompts, greedy()))
    for kwargs in ({}, {"block_size": 4, "num_kv_blocks": 24}):
        llm = draft_llm(tiny_model_dir, other_draft, k=3, **kwargs)
        assert tokens_of(llm.generate(prompts, greedy())) == off, kwargs
        assert llm.engine.stats().spec_num_draft_tokens > 0
        assert_pool_all_free(llm)


def test_seeded_sampling_gives_the_tokens_of_speculation_off(tiny_model_dir, prompts):
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=seed, ignore_eos=True)
              for seed in range(6)]
    batch = [prompts[0]] * 3 + [prompts[1]] * 3
    off = tokens_of(LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256).generate(batch, params))
    llm = draft_llm(tiny_model_dir, tiny_model_dir)
    assert tokens_of(llm.generate(batch, params)) == off
    assert llm.engine.stats().spec_num_accepted_tokens > 0


def test_a_resumed_request_and_a_long_prompt_are_drafted_after_catching_up(tiny_model_dir, prompts):
    """A handoff's request arrives with output tokens and no KV; a prompt longer than a step's
    catch-up takes several steps before it proposes. Both give the plain tokens, drafted."""
    long_prompt = (prompts[0] * 20)[:CATCH_UP_TOKENS + 200]
    plain = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256)
    expected = tokens_of(plain.generate([long_prompt, prompts[2]], greedy(30)))
    llm = draft_llm(tiny_model_dir, tiny_model_dir)
    assert tokens_of(llm.generate([long_prompt], greedy(30))) == expected[:1]
    assert acceptance(llm) > 0.9
    engine = llm.engine
    before = engine.stats().spec_num_drafts
    engine.add_request("resumed", prompts[2], greedy(30), output_token_ids=expected[1][:10])
    got: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            got += out.new_token_ids
    assert expected[1][:10] + got == expected[1]
    assert engine.stats().spec_num_drafts > before
    assert_pool_all_free(llm)


def test_a_draft_with_another_tokenizer_is_refused(tiny_model_dir, other_draft, tmp_path):
    odd = tmp_path / "odd-draft"
    shutil.copytree(other_draft, odd)
    tokenizer = json.loads((odd / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["zzz-not-in-the-target"] = vocab.pop(next(iter(vocab)))
    (odd / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        draft_llm(tiny_model_dir, odd)
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        draft_llm(tiny_model_dir, tmp_path / "missing")


def test_the_drafts_kv_cache_counts_in_the_kv_budget(tiny_model_dir, prompts):
    """--kv-cache-memory bounds the target's and the draft's KV together (a container sized by the
    flag held both): with an int8 target cache and a float32 draft of the same shape, the draft's
    blocks are over 3x the target's, so the budget buys far fewer blocks than without the draft,
    the heartbeat (whose blocks x block size is the gateway's token budget) says so, and greedy
    output is still the plain run's."""
    budget = 1 << 20
    plain = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_dtype="int8", kv_cache_memory=budget)
    off = tokens_of(plain.generate(prompts, greedy()))
    llm = draft_llm(tiny_model_dir, tiny_model_dir, num_kv_blocks=None, kv_cache_dtype="int8", kv_cache_memory=budget)
    engine = llm.engine
    target_bytes = engine.runtime.runner.kv_cache.numel() * engine.runtime.runner.kv_cache.element_size()
    draft_cache = engine.drafter.runtime.runner.kv_cache
    draft_bytes = draft_cache.numel() * draft_cache.element_size()
    assert draft_bytes > 3 * target_bytes
    assert target_bytes + draft_bytes <= budget
    beat = engine.stats().heartbeat()
    assert beat["kv_cache_bytes"] == target_bytes + draft_bytes
    assert beat["num_kv_blocks_total"] < plain.engine.stats().num_kv_blocks_total // 3
    assert tokens_of(llm.generate(prompts, greedy())) == off
    assert acceptance(llm) > 0.5  # the draft's float32 KV and the target's int8 mostly agree
    assert_pool_all_free(llm)
