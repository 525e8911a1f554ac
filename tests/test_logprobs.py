"""Log-probabilities (sampled tokens' top k, prompt tokens') against transformers' float32 log-softmax.

Through the offline engine on the tiny random model: one request, a batch, chunked prefill (prompt
logprobs arrive chunk by chunk) and a prompt whose prefix is cached (prompt logprobs must not skip
the cached positions).
"""

from __future__ import annotations

import random

import pytest
import torch

from baton.llm import LLM
from baton.common.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TOP = 5


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, V]: row p is the log-softmax over the token at p + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check_against(reference: torch.Tensor, token_ids: list[int], start: int, chosen: list[float],
                  tops: list[list]) -> None:
    """chosen[i] / tops[i] describe token_ids[start + i + 1] scored by reference row start + i."""
    for i, (lp, top) in enumerate(zip(chosen, tops)):
        row = reference[start + i]
        assert lp == pytest.approx(row[token_ids[start + i + 1]].item(), abs=2e-4)
        values, indices = row.topk(len(top))
        assert [t[0] for t in top] == indices.tolist()
        assert [t[1] for t in top] == pytest.approx(values.tolist(), abs=2e-4)


@pytest.mark.parametrize("chunk", [None, 7])
def test_sampled_and_prompt_logprobs_equal_transformers_log_softmax(tiny_model_dir, hf_model, chunk):
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (2, 19, 40)]
    kwargs = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(model=str(tiny_model_dir), dtype="float32", **kwargs)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=TOP, prompt_logprobs=3)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        full = prompt + completion.token_ids
        reference = hf_logprobs(hf_model, full)
        # generated tokens: scored by the position before each
        assert len(completion.top_logprobs) == 6 and all(len(t) == TOP for t in completion.top_logprobs)
        check_against(reference, full, len(prompt) - 1, completion.logprobs, completion.top_logprobs)
        # greedy: the chosen token is the most likely one
        assert [t[0][0] for t in completion.top_logprobs] == completion.token_ids
        # prompt tokens: none for the first, then each scored by the one before
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        entries = out.prompt_logprobs[1:]
        assert len(entries) == len(prompt) - 1
        check_against(reference, full, 0, [e[0] for e in entries], [e[1] for e in entries])


def test_prompt_logprobs_cover_a_prefix_the_cache_holds(tiny_model_dir, hf_model):
    rng = random.Random(8)
    prefix = [rng.randrange(3, 49152) for _ in range(40)]
    llm = LLM(model=str(tiny_model_dir), dtype="float32")
    llm.generate([prefix + [5, 6]], SamplingParams(max_tokens=1, temperature=0))  # caches 2 blocks
    prompt = prefix + [7, 8, 9]
    [out] = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    assert out.num_cached_tokens == 0  # computed, not taken from the cache
    entries = out.prompt_logprobs[1:]
    assert all(e is not None and e[1] == [] for e in entries)
    check_against(hf_logprobs(hf_model, prompt + out.outputs[0].token_ids), prompt, 0,
                  [e[0] for e in entries], [e[1] for e in entries])
    # and a request without prompt logprobs still hits the cache
    [again] = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    assert again.num_cached_tokens == 32


def test_sampled_rows_report_the_raw_model_logprob(tiny_model_dir, hf_model):
    """A sampled (temperature 0.7, top-k 3, penalised) token's logprob is the model's, not the
    warped distribution's (vLLM's raw_logprobs)."""
    prompt = [11, 22, 33, 44, 55]
    llm = LLM(model=str(tiny_model_dir), dtype="float32")
    params = SamplingParams(max_tokens=4, temperature=0.7, top_k=3, seed=3, repetition_penalty=1.3,
                            ignore_eos=True, logprobs=0)
    [out] = llm.generate([prompt], params)
    completion = out.outputs[0]
    assert completion.top_logprobs == [[], [], [], []]
    full = prompt + completion.token_ids
    check_against(hf_logprobs(hf_model, full), full, len(prompt) - 1, completion.logprobs, completion.top_logprobs)


def test_logprobs_out_of_range_are_refused():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
