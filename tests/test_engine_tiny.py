"""The colocated engine on tiny random-init Llamas, against Hugging Face transformers' greedy output.

Greedy output must equal `LlamaForCausalLM.generate(do_sample=False)` token for token, however the
engine gets there: one request at a time, batched, in 8-token prefill chunks, through preemption
and recompute, and from the prefix cache.

`tiny_model_dir` (see conftest) is built so that its output depends on the whole context and its
logits are far from ties: broken attention or positions would change its tokens.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from baton.llm import LLM
from baton.common.sampling_params import SamplingParams

N = 8
PROMPT_LENS = (1, 5, 17, 40, 70)
MODELS = ("tiny_model_dir",)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def mixing_model_dir(tiny_model_dir):
    """The shared tiny model is built context-sensitive (see conftest)."""
    return tiny_model_dir


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in PROMPT_LENS]


_HF_CACHE: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def hf_greedy(model_dir, prompt: list[int], max_new_tokens: int = N) -> list[int]:
    key = (str(model_dir), tuple(prompt), max_new_tokens)
    if key not in _HF_CACHE:
        from transformers import GenerationConfig

        model = _hf_model(model_dir)
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                                  pad_token_id=0, bos_token_id=1)
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        generated = out[0, len(prompt):].tolist()
        assert len(generated) == max_new_tokens  # no early stop: the oracle is N tokens long
        _HF_CACHE[key] = generated
    return _HF_CACHE[key]


_HF_MODELS: dict[str, object] = {}


def _hf_model(model_dir):
    from transformers import LlamaForCausalLM

    if str(model_dir) not in _HF_MODELS:
        _HF_MODELS[str(model_dir)] = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _HF_MODELS[str(model_dir)]


def make_llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    return LLM(model=str(model_dir), dtype="float32", **kwargs)


def greedy(max_tokens: int = N) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def tokens_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_pool_all_free(llm: LLM) -> None:
    pool = llm.engine.pool
    assert pool.num_free_blocks == pool.num_blocks - 1
    assert not any(pool.ref_counts)
    pool.check_invariants()


# ------------------------------------------------------------------ the test models are fit for purpose

def test_mixing_model_output_depends_on_context(mixing_model_dir, prompts):
    refs = [hf_greedy(mixing_model_dir, p) for p in prompts]
    assert all(len(set(r)) >= 4 for r in refs)  # not a repeated token
    last = prompts[3][-1]
    firsts = {hf_greedy(mixing_model_dir, ctx + [last], 1)[0] for ctx in ([5], [7, 8, 9], prompts[2])}
    assert len(firsts) == 3  # same last token, other context: other next token


# ------------------------------------------------------------------ greedy parity

@pytest.mark.parametrize("model", MODELS)
def test_greedy_one_at_a_time_matches_transformers(model, prompts, request):
    model_dir = request.getfixturevalue(model)
    llm = make_llm(model_dir)
    for prompt in prompts:
        [out] = llm.generate(prompt, greedy())
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt), len(prompt)
        assert out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].logprobs) == N and all(lp <= 0 for lp in out.outputs[0].logprobs)
        assert_pool_all_free(llm)


@pytest.mark.parametrize("model", MODELS)
def test_greedy_batched_matches_transformers_and_repeats_from_the_prefix_cache(model, prompts, request):
    model_dir = request.getfixturevalue(model)
    expected = [hf_greedy(model_dir, p) for p in prompts]
    llm = make_llm(model_dir)
    first = llm.generate(prompts, greedy())
    assert tokens_of(first) == expected
    assert [o.num_cached_tokens for o in first] == [0] * len(prompts)
    assert [o.outputs[0].finish_reason for o in first] == ["length"] * len(prompts)
    assert_pool_all_free(llm)

    second = llm.generate(prompts, greedy())
    assert tokens_of(second) == expected
    # every full prompt block but (if the prompt is block-aligned) the last comes from the cache
    assert [o.num_cached_tokens for o in second] == [(n - 1) // 16 * 16 for n in PROMPT_LENS]
    assert second[-1].num_cached_tokens == 64
    assert_pool_all_free(llm)


@pytest.mark.parametrize("model", MODELS)
def test_greedy_chunked_prefill_matches_transformers(model, prompts, request):
    model_dir = request.getfixturevalue(model)
    llm = make_llm(model_dir, max_num_batched_tokens=8)
    plans = []
    schedule = llm.engine.scheduler.schedule

    def recording_schedule():
        plan = schedule()
        plans.append([(seq.num_prompt_tokens, n) for seq, n in plan.scheduled])
        return plan

    llm.engine.scheduler.schedule = recording_schedule
    outputs = llm.generate(prompts, greedy())
    assert tokens_of(outputs) == [hf_greedy(model_dir, p) for p in prompts]
    assert max(sum(n for _, n in plan) for plan in plans) == 8
    # the 70-token prompt ran in chunks of at most 8 tokens, then decoded one token a step
    chunks = [n for plan in plans for prompt_len, n in plan if prompt_len == 70]
    assert sum(chunks) == 70 + N - 1 and max(chunks) <= 8 and chunks[-(N - 1):] == [1] * (N - 1)
    assert_pool_all_free(llm)


@pytest.mark.parametrize("model", MODELS)
def test_greedy_through_preemption_matches_transformers(model, prompts, request, caplog):
    model_dir = request.getfixturevalue(model)
    # 4-token blocks, 21 in all: the 70-token request alone fills 20 of them
    llm = make_llm(model_dir, block_size=4, num_kv_blocks=21)
    outputs = llm.generate(prompts, greedy())
    assert llm.engine.scheduler.num_preemptions > 0
    assert any("preempted request" in r.getMessage() for r in caplog.records)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * len(prompts)
    assert tokens_of(outputs) == [hf_greedy(model_dir, p) for p in prompts]
    assert_pool_all_free(llm)


def test_greedy_in_no_evict_mode_matches_transformers(mixing_model_dir, prompts):
    llm = make_llm(mixing_model_dir, block_size=4, num_kv_blocks=21, scheduler_policy="no-evict")
    outputs = llm.generate(prompts, greedy())
    assert llm.engine.scheduler.num_preemptions == 0
    assert tokens_of(outputs) == [hf_greedy(mixing_model_dir, p) for p in prompts]
    assert_pool_all_free(llm)


def test_a_prompt_sharing_a_cached_prefix_matches_transformers(mixing_model_dir, prompts):
    llm = make_llm(mixing_model_dir)
    base = prompts[4]  # 70 tokens
    llm.generate(base, greedy())
    branch = base[:40] + [777, 778, 779]
    [out] = llm.generate(branch, greedy())
    assert out.num_cached_tokens == 32
    assert out.outputs[0].token_ids == hf_greedy(mixing_model_dir, branch)
    assert_pool_all_free(llm)


def test_a_cache_salt_shares_the_prefix_cache_only_with_the_same_salt(mixing_model_dir, prompts):
    """vLLM's cache_salt: a request finds cached blocks only from requests of its own salt (the
    output is the same either way); unsalted requests share as before."""
    llm = make_llm(mixing_model_dir)
    prompt = prompts[4]  # 70 tokens: 4 full blocks of 16

    def run(salt: str | None) -> tuple[list[int], int]:
        [out] = llm.generate(prompt, dataclasses.replace(greedy(), cache_salt=salt))
        return out.outputs[0].token_ids, out.num_cached_tokens

    expected = hf_greedy(mixing_model_dir, prompt)
    assert run(None) == (expected, 0)
    assert run("tenant-a") == (expected, 0)  # the unsalted blocks are not its
    assert run("tenant-a") == (expected, 64)
    assert run("tenant-b") == (expected, 0)
    assert run(None) == (expected, 64)  # nor are the salted ones the unsalted requests'
    assert_pool_all_free(llm)


# ------------------------------------------------------------------ sampling through the engine

def sampled(seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=N, ignore_eos=True, **kwargs)


def test_seeded_sampling_is_reproducible_across_engines(mixing_model_dir, prompts):
    params = [sampled(seed) for seed in (11, 12, 13, 14, 15)]
    first = tokens_of(make_llm(mixing_model_dir).generate(prompts, params))
    # another engine, another batch shape, and preemption: the same draws
    llm = make_llm(mixing_model_dir, block_size=4, num_kv_blocks=21, max_num_batched_tokens=16)
    second = tokens_of(llm.generate(prompts, params))
    assert llm.engine.scheduler.num_preemptions > 0
    assert second == first
    # the draws are really random: other seeds give other tokens, and they differ from greedy
    other = tokens_of(make_llm(mixing_model_dir).generate(prompts, [sampled(seed) for seed in (21, 22, 23, 24, 25)]))
    assert other != first
    assert first != [hf_greedy(mixing_model_dir, p) for p in prompts]


def test_per_request_params_in_one_batch(mixing_model_dir, prompts):
    llm = make_llm(mixing_model_dir)
    mixed = llm.generate([prompts[3], prompts[4], prompts[2]],
                         [greedy(), sampled(5), sampled(6, top_k=3, repetition_penalty=1.3)])
    assert mixed[0].outputs[0].token_ids == hf_greedy(mixing_model_dir, prompts[3])
    [alone] = llm.generate(prompts[4], sampled(5))
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids
    [alone] = llm.generate(prompts[2], sampled(6, top_k=3, repetition_penalty=1.3))
    assert mixed[2].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_pool_all_free(llm)


def test_openai_penalties_and_logit_bias_match_transformers_with_the_same_edits(mixing_model_dir, prompts):
    # The reference: transformers' logits, edited by OpenAI's rule by hand at every step.
    prompt = prompts[3]
    bias = {int(hf_greedy(mixing_model_dir, prompt)[1]): -100.0, 77: 2.5}
    model = _hf_model(mixing_model_dir)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(N):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            output = ids[len(prompt):]
            for token in set(output):
                logits[token] -= 0.8 + 0.6 * output.count(token)
            for token, b in bias.items():
                logits[token] += b
            ids.append(int(logits.argmax()))
    expected = ids[len(prompt):]
    llm = make_llm(mixing_model_dir)
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, presence_penalty=0.8,
                            frequency_penalty=0.6, logit_bias=[[t, b] for t, b in bias.items()])
    [out] = llm.generate(prompt, params)
    assert out.outputs[0].token_ids == expected
    assert expected != hf_greedy(mixing_model_dir, prompt)  # the edits changed the text
    assert_pool_all_free(llm)


# ------------------------------------------------------------------ stopping

def test_stop_token_ends_the_request_with_stop(mixing_model_dir, prompts):
    prompt = prompts[3]
    ref = hf_greedy(mixing_model_dir, prompt)
    stop_at = next(i for i in range(2, N) if ref[i] not in ref[:i])
    llm = make_llm(mixing_model_dir)
    [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=N, stop_token_ids=[ref[stop_at]]))
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids == ref[:stop_at + 1]  # the stop token is the last one
    assert_pool_all_free(llm)


def test_eos_stops_unless_ignored(mixing_model_dir, prompts):
    prompt = prompts[2]
    ref = hf_greedy(mixing_model_dir, prompt)
    eos_at = next(i for i in range(1, N) if ref[i] not in ref[:i])
    llm = make_llm(mixing_model_dir)
    llm.engine.scheduler.eos_token_ids = {ref[eos_at]}  # pretend the model emits its EOS there
    [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=N))
    assert (out.outputs[0].finish_reason, out.outputs[0].token_ids) == ("stop", ref[:eos_at + 1])
    [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))
    assert (out.outputs[0].finish_reason, out.outputs[0].token_ids) == ("length", ref)
    [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))
    assert (out.outputs[0].finish_reason, out.outputs[0].token_ids) == ("length", ref[:1])
    assert_pool_all_free(llm)


def test_text_prompts_are_tokenized_without_special_tokens(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    text = "The quick brown fox"
    [out] = llm.generate(text, greedy(3))
    assert out.prompt == text
    assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    assert out.outputs[0].token_ids == hf_greedy(tiny_model_dir, out.prompt_token_ids, 3)
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
