"""The default model as `baton serve` serves it by default (issue 23): its GGUF's own Q4_1 blocks in
both workers, handed off through the block store, over real HTTP. The quality gate: the perplexity of
a fixed text scored through the API (`echo` + `logprobs`, as lm-eval asks) stays within 5% of
transformers' on the same weights."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from tests.cluster import Cluster
from tests.test_quant import TEXT

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def cluster(default_gguf_model_dir):
    with Cluster(default_gguf_model_dir, prefill=1, decode=1, dtype="auto") as c:  # float32 would dequantize
        yield c


def test_perplexity_through_the_api_stays_within_5_percent_of_transformers(cluster, default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(default_model_dir)).encode(TEXT, add_special_tokens=False)
    r = httpx.post(cluster.base_url + "/v1/completions", timeout=300, json={
        "prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    scored = r.json()["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)]
    assert len(scored) == len(ids) - 1 and all(isinstance(v, float) for v in scored)
    served = math.exp(-sum(scored) / len(scored))
    hf = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    reference = math.exp(-sum(logprobs[p, ids[p + 1]].item() for p in range(len(ids) - 1)) / (len(ids) - 1))
    assert abs(served / reference - 1) < 0.05, (served, reference)
    assert served != pytest.approx(reference, rel=1e-4)  # quantized: not the dequantized weights' numbers


def test_a_streamed_chat_in_japanese_is_answered(cluster):
    import openai

    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model="", messages=[{"role": "user", "content": "日本の首都はどこですか？"}],
                                            max_tokens=24, temperature=0, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() and chunks[-1].choices[0].finish_reason in ("stop", "length")
