"""OpenAI n / best_of / batched prompts, logprobs / top_logprobs / echo / prompt_logprobs, cached
tokens in the usage (cache_salt keeping them apart), and TGI's top_n_tokens / decoder_input_details /
best_of: through a real gateway, prefill and decode worker (float32, tiny model) and checked against
transformers' float32 log-softmax over the same tokens."""

from __future__ import annotations

import json
import random

import httpx
import pytest
import torch

from tests.cluster import Cluster

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ABS = 2e-3  # float32 on both sides; batch shapes differ


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with Cluster(tiny_model_dir, prefill=1, decode=1) as c:
        yield c


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def reference_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, V]: row p scores the token at p + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def post(cluster: Cluster, path: str, body: dict) -> dict:
    r = httpx.post(cluster.base_url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(cluster: Cluster, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", cluster.base_url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data:"):].strip() for line in r.iter_lines() if line.startswith("data:")]
    if path.startswith("/v1/"):  # OpenAI ends with [DONE]; TGI's last event carries generated_text
        assert lines.pop() == "[DONE]"
    return [json.loads(line) for line in lines]


def test_completion_logprobs_and_echo_equal_transformers(cluster, hf_model, tokenizer):
    prompt = prompt_of(21, 1)
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    out = post(cluster, "/v1/completions", body)
    lp = out["choices"][0]["logprobs"]
    generated = tokenizer(out["choices"][0]["text"], add_special_tokens=False)["input_ids"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert "".join(lp["tokens"]) == out["choices"][0]["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    # greedy: each token is its own top-1, and its logprob is the model's log-softmax
    for token, top, value in zip(lp["tokens"], lp["top_logprobs"], lp["token_logprobs"]):
        assert len(top) == 3 and max(top.values()) == pytest.approx(value) and top[token] == value
    # lm-eval's loglikelihood request: echo + logprobs, the prompt scored token by token
    echo = post(cluster, "/v1/completions", {**body, "max_tokens": 1, "echo": True, "logprobs": 1})
    elp = echo["choices"][0]["logprobs"]
    assert len(elp["tokens"]) == len(prompt) + 1 and elp["token_logprobs"][0] is None
    assert elp["top_logprobs"][0] is None
    assert echo["choices"][0]["text"].startswith(tokenizer.decode(prompt))
    reference = reference_logprobs(hf_model, prompt + generated[:1])
    expected = [reference[p, prompt[p + 1]].item() for p in range(len(prompt) - 1)]
    assert elp["token_logprobs"][1:len(prompt)] == pytest.approx(expected, abs=ABS)
    assert elp["token_logprobs"][len(prompt)] == pytest.approx(lp["token_logprobs"][0], abs=ABS)
    assert elp["token_logprobs"][len(prompt)] == pytest.approx(reference[-1].max().item(), abs=ABS)


def test_chat_logprobs_streamed_and_not_agree(cluster):
    import openai

    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)
    kwargs = {"model": "", "messages": [{"role": "user", "content": "Bonjour, ça va ? 你好"}], "max_tokens": 6,
              "temperature": 0, "logprobs": True, "top_logprobs": 2}
    full = client.chat.completions.create(**kwargs)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 6
    for entry in content:
        assert [t.token for t in entry.top_logprobs][0] == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    streamed = [e for chunk in client.chat.completions.create(**kwargs, stream=True)
                for choice in chunk.choices if choice.logprobs for e in choice.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    # logprobs off: none in the answer
    plain = client.chat.completions.create(**{**kwargs, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_n_choices_share_one_prefill_and_differ_by_seed(cluster):
    prompt = prompt_of(40, 2)  # 2 full blocks the siblings take from the prefix cache
    before = cluster.fresh_worker_states("prefill")[0]["num_prefix_hit_tokens"]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 3, "ignore_eos": True}
    out = post(cluster, "/v1/completions", body)
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({c["text"] for c in choices}) == 3  # three seeds, three texts
    assert out["usage"]["prompt_tokens"] == 40 and out["usage"]["completion_tokens"] == 24
    after = cluster.fresh_worker_states("prefill")[0]["num_prefix_hit_tokens"]
    assert after - before >= 2 * 32  # the two siblings computed only the partial block
    # reproducible: the same request again, and streamed, gives the same choices
    again = post(cluster, "/v1/completions", body)
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in choices]
    chunks = stream(cluster, "/v1/completions", body)
    texts = ["", "", ""]
    for chunk in chunks:
        for c in chunk["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == [c["text"] for c in choices]
    # the cached prompt shows in the usage of a repeat
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    cluster.wait_idle()


def test_cache_salt_shows_cached_tokens_only_to_the_same_salt(cluster):
    """The prefix cache is everyone's: a repeat's cached_tokens (and its speed) tells a client that
    someone sent that prefix before. With vLLM's cache_salt, blocks are shared only under one salt;
    the answer is the same either way."""
    body = {"prompt": prompt_of(50, 38), "max_tokens": 4, "temperature": 0, "ignore_eos": True}

    def answer(salt: str | None) -> tuple[str, int]:
        out = post(cluster, "/v1/completions", {**body, "cache_salt": salt} if salt is not None else body)
        return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]

    text, cached = answer("tenant-a")
    assert cached == 0
    assert answer("tenant-a") == (text, 48)  # 3 full blocks of 16, from tenant-a's own first request
    assert answer("tenant-b") == (text, 0)  # another salt: nothing to guess from
    assert answer(None) == (text, 0)  # nor from the shared, unsalted cache
    assert answer(None) == (text, 48)  # which shares as before
    cluster.wait_idle()


def test_batched_prompts_each_answer_as_alone(cluster):
    prompts = [prompt_of(9, 3), prompt_of(30, 4)]
    base = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    alone = [post(cluster, "/v1/completions", {**base, "prompt": p})["choices"][0]["text"] for p in prompts]
    out = post(cluster, "/v1/completions", {**base, "prompt": prompts, "n": 2})
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in out["choices"]] == [alone[0], alone[0], alone[1], alone[1]]
    assert out["usage"]["prompt_tokens"] == 39


def test_best_of_answers_the_most_likely_candidate(cluster):
    body = {"prompt": prompt_of(12, 5), "max_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    candidates = post(cluster, "/v1/completions", {**body, "n": 3, "logprobs": 0})["choices"]
    totals = [sum(c["logprobs"]["token_logprobs"]) for c in candidates]
    best = post(cluster, "/v1/completions", {**body, "best_of": 3})
    assert len(best["choices"]) == 1 and best["usage"]["completion_tokens"] == 18
    assert best["choices"][0]["text"] == candidates[totals.index(max(totals))]["text"]


def test_prompt_logprobs_vllm_shape(cluster, hf_model):
    prompt = prompt_of(6, 6)
    out = post(cluster, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                            "prompt_logprobs": 2})
    entries = out["choices"][0]["prompt_logprobs"]
    assert len(entries) == 6 and entries[0] is None
    reference = reference_logprobs(hf_model, prompt + [0])
    for p, entry in enumerate(entries[1:]):
        assert entry[str(prompt[p + 1])]["logprob"] == pytest.approx(reference[p, prompt[p + 1]].item(), abs=ABS)
        ranked = sorted((v for v in entry.values() if v["rank"] is not None), key=lambda v: v["rank"])
        assert [v["rank"] for v in ranked][:2] == [1, 2]


def test_tgi_top_n_tokens_decoder_input_details_and_best_of(cluster, hf_model, tokenizer):
    text = "The capital of France is"
    ids = tokenizer(text)["input_ids"]
    out = post(cluster, "/generate", {"inputs": text, "parameters": {
        "max_new_tokens": 3, "details": True, "decoder_input_details": True, "top_n_tokens": 2}})
    details = out["details"]
    assert [t["id"] for t in details["prefill"]] == ids and details["prefill"][0]["logprob"] is None
    reference = reference_logprobs(hf_model, ids + [details["tokens"][0]["id"]])
    assert [t["logprob"] for t in details["prefill"][1:]] == pytest.approx(
        [reference[p, ids[p + 1]].item() for p in range(len(ids) - 1)], abs=ABS)
    assert len(details["top_tokens"]) == 3 and all(len(t) == 2 for t in details["top_tokens"])
    assert [t[0]["id"] for t in details["top_tokens"]] == [t["id"] for t in details["tokens"]]  # greedy
    events = stream(cluster, "/generate_stream", {"inputs": text, "parameters": {"max_new_tokens": 3,
                                                                                 "top_n_tokens": 2}})
    streamed = [e["top_tokens"] for e in events]
    assert [[t["id"] for t in top] for top in streamed] == [[t["id"] for t in top] for top in details["top_tokens"]]
    assert [t["logprob"] for top in streamed for t in top] == pytest.approx(
        [t["logprob"] for top in details["top_tokens"] for t in top], abs=ABS)
    best = post(cluster, "/generate", {"inputs": text, "parameters": {
        "max_new_tokens": 4, "do_sample": True, "seed": 3, "best_of": 3, "details": True}})
    # TGI's best_of_sequences hold the other candidates, flat: {generated_text, tokens, seed, ...}
    sequences = [best["details"]] + best["details"]["best_of_sequences"]
    assert len(sequences) == 3 and len({s["seed"] for s in sequences}) == 3
    totals = [sum(t["logprob"] for t in s["tokens"]) for s in sequences]
    assert totals[0] == max(totals)
    cluster.wait_idle()
