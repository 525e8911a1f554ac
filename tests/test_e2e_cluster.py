"""A 2 prefill + 2 decode system on the tiny model: concurrency, load spreading, prefix reuse."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.cluster import Cluster


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with Cluster(tiny_model_dir, prefill=2, decode=2, decode_args=("--num-kv-blocks", "256")) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from baton import LLM

    return LLM(model=str(tiny_model_dir), dtype="float32", enable_prefix_caching=False)


async def complete(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
    response = await client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})  # no model: the served one
    assert response.status_code == 200, response.text
    return response.json()


async def generate_ids(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> list[int]:
    response = await client.post("/generate", json={
        "inputs": prompt, "parameters": {"max_new_tokens": max_tokens, "details": True, "do_sample": False}})
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]]


def test_32_concurrent_requests_all_correct_and_spread(cluster, reference, tiny_model_dir):
    from baton import SamplingParams

    words = "the quick brown fox jumps over a lazy dog while 東京 and café ☕ wait".split()
    prompts = [" ".join(words[: 2 + i % len(words)]) * (1 + i // 8) for i in range(32)]
    max_tokens = [8 + (i % 5) * 6 for i in range(32)]

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as client:
            return await asyncio.gather(*(generate_ids(client, p, m) for p, m in zip(prompts, max_tokens)))

    results = asyncio.run(run())
    expected = reference.generate(prompts, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens])
    for got, exp in zip(results, expected):
        assert got == exp.outputs[0].token_ids
    time.sleep(1.5)  # heartbeats refresh every second
    served = [d["num_requests_finished"] for d in cluster.worker_states("decode")]
    assert len(served) == 2 and all(n > 0 for n in served), served
    cluster.wait_idle()


def test_shared_prefix_is_not_recomputed(cluster):
    prefix = list(range(5000, 5064))  # four full blocks

    async def run() -> None:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as client:
            await complete(client, prefix + [1, 2, 3], 2)
            await complete(client, prefix + [4, 5], 2)
            await complete(client, prefix + [6], 2)

    before = sum(p["num_prefix_hit_tokens"] for p in cluster.worker_states("prefill"))
    asyncio.run(run())
    import time

    time.sleep(1.5)  # heartbeats refresh every second
    after = sum(p["num_prefix_hit_tokens"] for p in cluster.worker_states("prefill"))
    # the 2nd and 3rd requests find the 64-token prefix, locally or fetched from the store
    assert after - before >= 128
