"""Overload, cancellation and preemption against the real system (tiny model, real HTTP, real Redis)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.cluster import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.overload import run_overload  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with Cluster(tiny_model_dir, prefill=1, decode=1,
                 gateway_args=("--max-concurrent-requests", "8", "--max-batch-total-tokens", "4096",
                               "--max-input-tokens", "512", "--max-total-tokens", "1024"),
                 decode_args=("--num-kv-blocks", "512")) as c:
        yield c


@pytest.mark.parametrize("multiple", [2.0, 4.0])
def test_overload_every_request_completes_or_is_rejected(cluster, multiple):
    report = asyncio.run(run_overload(cluster.base_url, multiple, num_requests=24 * int(multiple),
                                      max_new_tokens=24, hang_timeout=60, time_limit=240))
    assert report["failed"] == 0 and report["hung"] == 0, report["errors"]
    assert report["completed"] > 0 and report["rejected"] > 0
    assert report["completed"] + report["rejected"] == report["requests"]
    assert report["reject_p99_ms"] < 1000  # "no" is answered at once
    assert not any(report["after"].values()), report["after"]  # budget, running, blocks: all zero
    stats = cluster.stats()
    assert sum(stats["rejections"].values()) >= report["rejected"]


def test_dropped_streams_release_everything(cluster):
    async def open_and_drop(client: httpx.AsyncClient) -> int:
        seen = 0
        async with client.stream("POST", "/generate_stream", json={
                "inputs": "tell me a very long story", "parameters": {"max_new_tokens": 600}}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    seen += 1
                    if seen == 3:
                        break  # the client goes away mid-stream
        return seen

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as client:
            return await asyncio.gather(*(open_and_drop(client) for _ in range(8)))

    assert asyncio.run(run()) == [3] * 8
    stats = cluster.wait_idle(timeout=20)
    assert stats["token_budget"]["in_use"] == 0
    # The decode worker stopped generating for them: its token counter no longer moves.
    produced = sum(d.get("num_requests_finished", 0) for d in cluster.fresh_worker_states("decode"))
    time.sleep(1.5)
    assert sum(d.get("num_requests_finished", 0) for d in cluster.fresh_worker_states("decode")) == produced
    assert all(d["num_requests_running"] == 0 for d in cluster.worker_states("decode"))


@pytest.mark.parametrize("policy", ["max-utilization", "no-evict"])
def test_small_kv_pool_preempts_only_under_max_utilization(tiny_model_dir, policy):
    from baton import LLM, SamplingParams

    prompts = [" ".join(["word"] * (10 + 7 * i)) for i in range(8)]
    # The gateway's budget is set far above the pool (by default it is derived from the pool and
    # would keep the decode worker out of trouble): the decode worker must cope on its own.
    with Cluster(tiny_model_dir, prefill=1, decode=1, gateway_args=("--max-batch-total-tokens", "100000"),
                 decode_args=("--num-kv-blocks", "16", "--scheduler-policy", policy)) as cluster:
        async def run() -> list[list[int]]:
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as client:
                async def one(prompt: str) -> list[int]:
                    r = await client.post("/generate", json={"inputs": prompt, "parameters": {
                        "max_new_tokens": 96, "details": True, "do_sample": False}})
                    assert r.status_code == 200, r.text
                    return [t["id"] for t in r.json()["details"]["tokens"]]
                return await asyncio.gather(*(one(p) for p in prompts))

        got = asyncio.run(run())
        time.sleep(1.2)
        preemptions = sum(d["num_preemptions"] for d in cluster.worker_states("decode"))
        cluster.wait_idle()
    reference = LLM(model=str(tiny_model_dir), dtype="float32", enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, SamplingParams(temperature=0, max_tokens=96))]
    assert got == expected
    if policy == "max-utilization":
        assert preemptions > 0
    else:
        assert preemptions == 0
