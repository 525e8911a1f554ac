"""Admission: token budget, strict FIFO, 429 past max_concurrent_requests / a full queue,
503 after max_queue_wait, a budget derived from decode heartbeats, and no leaked reservation."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
from tests.test_gateway_support import start_gateway, wait_until

from gateway.admission import Admission
from gateway.config import Settings
from gateway.errors import ApiError
from gateway.metrics import GatewayMetrics



def make_admission(**kw) -> tuple[Admission, GatewayMetrics]:
    settings = Settings(model_dir=Path("/nonexistent/m"), **kw)
    metrics = GatewayMetrics("m")
    return Admission(settings, metrics), metrics


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_fifo_head_of_line_and_release():
    adm, _ = make_admission(max_batch_total_tokens=100)
    task = asyncio.create_task(adm.run())
    try:
        a = adm.submit(60, 422)
        b = adm.submit(50, 422)  # does not fit next to a: waits
        c = adm.submit(10, 422)  # would fit, but must not jump ahead of b
        await settle()
        assert a.decision.done() and a.decision.result() is None
        assert not b.decision.done() and not c.decision.done()
        assert adm.snapshot()["requests"] == {"running": 1, "waiting": 2}
        adm.done(a)
        await settle()
        assert b.decision.result() is None and c.decision.result() is None
        assert adm.snapshot()["token_budget"]["in_use"] == 60
        adm.done(b)
        adm.done(c)
        adm.done(c)  # a second done is harmless
        await settle()
        assert adm.snapshot()["token_budget"]["in_use"] == 0
    finally:
        task.cancel()


async def test_a_ticket_is_released_on_every_exit_path_of_its_with_block():
    """The ticket as a context manager: budget back after the block, also when it raises or is
    cancelled, and only once (an explicit release inside the block is not counted twice)."""
    adm, _ = make_admission(max_batch_total_tokens=100)
    task = asyncio.create_task(adm.run())
    try:
        with pytest.raises(RuntimeError):
            with adm.submit(70, 422) as ticket:
                await settle()
                assert ticket.decision.result() is None and adm.snapshot()["token_budget"]["in_use"] == 70
                raise RuntimeError("a bug in a route")
        await settle()
        assert adm.snapshot()["token_budget"]["in_use"] == 0

        async def held() -> None:
            with adm.submit(80, 422) as ticket:
                ticket.release()  # released early, then again by the block's end
                await asyncio.sleep(3600)
        waiting = adm.submit(60, 422)
        holder = asyncio.create_task(held())
        await settle()
        assert adm.snapshot()["token_budget"]["in_use"] == 60
        holder.cancel()  # the client went away while it waited
        await settle()
        waiting.release()
        await settle()
        assert adm.snapshot()["token_budget"]["in_use"] == 0 and adm.snapshot()["requests"] == {
            "running": 0, "waiting": 0}
    finally:
        task.cancel()


async def test_rejections_and_withdrawal():
    adm, metrics = make_admission(max_batch_total_tokens=100, max_concurrent_requests=3, max_queue_size=1)
    task = asyncio.create_task(adm.run())
    try:
        big = adm.submit(101, 422)
        a, b, c = adm.submit(100, 422), adm.submit(100, 422), adm.submit(100, 422)
        await settle()
        assert isinstance(big.decision.result(), ApiError) and big.decision.result().status == 422
        assert a.decision.result() is None
        assert not b.decision.done()  # queued
        assert c.decision.result().status == 429  # queue (size 1) full
        d = adm.submit(1, 422)
        e = adm.submit(1, 422)
        await settle()
        assert d.decision.result().status == 429  # queue full
        adm.done(b)  # b gives up waiting: leaves the queue without touching the budget
        await settle()
        assert adm.snapshot()["requests"] == {"running": 1, "waiting": 0}
        assert e.decision.done()
        for t in (big, a, c, d, e):
            adm.done(t)
        await settle()
        assert adm.snapshot()["token_budget"]["in_use"] == 0
        assert metrics.rejections_by_reason["queue_full"] >= 2
        assert metrics.rejections_by_reason["exceeds_budget"] == 1
    finally:
        task.cancel()


async def test_derived_budget_a_request_must_fit_one_decode_worker():
    adm, _ = make_admission(max_batch_total_tokens=None)
    task = asyncio.create_task(adm.run())
    try:
        waiting = adm.submit(10, 400)
        await settle()
        assert not waiting.decision.done()  # no decode worker yet: wait, do not reject
        adm.set_derived_budget(300, 100)  # three workers of 100 tokens
        too_big, fits = adm.submit(150, 400), adm.submit(100, 400)
        await settle()
        assert waiting.decision.result() is None and fits.decision.result() is None
        err = too_big.decision.result()
        assert err.status == 400 and "largest decode worker" in err.message
    finally:
        task.cancel()


async def test_each_gateway_admits_against_its_share_of_the_budget():
    adm, _ = make_admission(max_batch_total_tokens=None)
    task = asyncio.create_task(adm.run())
    try:
        adm.set_derived_budget(1000, 1000, gateways=2)  # one decode worker, two gateways
        a, b, too_big = adm.submit(300, 400), adm.submit(300, 400), adm.submit(600, 400)
        await settle()
        assert a.decision.result() is None
        assert not b.decision.done()  # 600 of this gateway's 500 would be over its share: waits
        err = too_big.decision.result()
        assert err.status == 400 and "share" in err.message and "2 gateways" in err.message
        assert adm.snapshot()["token_budget"]["total"] == 500
        adm.set_derived_budget(1000, 1000, gateways=1)  # the other gateway is gone: all of it
        await settle()
        assert b.decision.result() is None
    finally:
        task.cancel()


async def test_concurrency_limit_counts_running_and_waiting():
    adm, metrics = make_admission(max_batch_total_tokens=100, max_concurrent_requests=2)
    task = asyncio.create_task(adm.run())
    try:
        _a, _b, c = adm.submit(100, 422), adm.submit(100, 422), adm.submit(1, 422)
        await settle()
        assert c.decision.result().status == 429 and c.decision.result().kind == "overloaded"
        assert c.decision.result().headers["Retry-After"] == "1"
        assert metrics.rejections_by_reason == {"concurrency": 1}
    finally:
        task.cancel()


@pytest.fixture
def small_gateway(default_model_dir, gw_redis_url, gw_tokenizer, gw_echo_worker):
    server = start_gateway(default_model_dir, gw_redis_url, gw_tokenizer, max_concurrent_requests=2,
                           max_batch_total_tokens=2048, max_queue_wait=0.6)
    yield server
    server.stop()


def stats(url: str) -> dict:
    return httpx.get(url + "/stats", timeout=5).json()


def hold_requests(url: str, n: int, max_new_tokens: int = 100) -> list[threading.Thread]:
    def run() -> None:
        httpx.post(url + "/generate", json={"inputs": "hold", "parameters": {"max_new_tokens": max_new_tokens}},
                   timeout=30)

    threads = [threading.Thread(target=run, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_429_over_max_concurrent_requests_with_real_clients(small_gateway, gw_worker, monkeypatch):
    import openai
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import OverloadedError

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    gw_worker.hold = True
    threads = hold_requests(small_gateway.url, 2)
    assert wait_until(lambda: stats(small_gateway.url)["requests"]["running"] == 2)

    client = openai.OpenAI(base_url=small_gateway.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=5)
    assert info.value.response.headers["retry-after"] == "1"
    assert info.value.body["type"] == "overloaded" and info.value.body["code"] == 429
    with pytest.raises(OverloadedError):
        InferenceClient(model=small_gateway.url).text_generation("hi", max_new_tokens=5)
    r = httpx.post(small_gateway.url + "/generate_stream", json={"inputs": "hi"})
    assert r.status_code == 429 and r.json()["error_type"] == "overloaded"
    assert stats(small_gateway.url)["rejections"]["concurrency"] == 3

    gw_worker.hold = False
    for t in threads:
        t.join(10)
    assert wait_until(lambda: stats(small_gateway.url)["token_budget"]["in_use"] == 0)
    assert httpx.post(small_gateway.url + "/generate", json={"inputs": "hi"}).status_code == 200


def test_queue_wait_timeout_is_503_and_budget_is_returned(small_gateway, gw_worker):
    gw_worker.hold = True
    threads = hold_requests(small_gateway.url, 1, max_new_tokens=2000)  # takes the whole budget
    assert wait_until(lambda: stats(small_gateway.url)["requests"]["running"] == 1)
    t0 = time.monotonic()
    r = httpx.post(small_gateway.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 100})
    assert r.status_code == 503
    assert "max_queue_wait" in r.json()["error"]["message"]
    assert 0.5 < time.monotonic() - t0 < 5
    assert stats(small_gateway.url)["requests"]["waiting"] == 0
    gw_worker.hold = False
    for t in threads:
        t.join(10)
    assert wait_until(lambda: stats(small_gateway.url)["token_budget"]["in_use"] == 0)


def test_waiting_client_that_disconnects_never_reaches_prefill(small_gateway, gw_worker):
    gw_worker.hold = True
    before = len(gw_worker.requests)
    threads = hold_requests(small_gateway.url, 1, max_new_tokens=2000)
    # Admitted is not yet received: wait until the worker has the held request.
    assert wait_until(lambda: len(gw_worker.requests) == before + 1)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(small_gateway.url + "/generate", json={"inputs": "hi"}, timeout=0.2)
    assert wait_until(lambda: stats(small_gateway.url)["requests"]["waiting"] == 0)
    assert stats(small_gateway.url)["rejections"].get("client_disconnected") == 1
    gw_worker.hold = False
    for t in threads:
        t.join(10)
    time.sleep(0.1)
    assert len(gw_worker.requests) == before + 1  # the abandoned request was never sent to a worker


def test_budget_derived_from_decode_heartbeats(default_model_dir, gw_redis_url, gw_tokenizer, gw_worker):
    server = start_gateway(default_model_dir, gw_redis_url, gw_tokenizer, max_batch_total_tokens=None,
                           max_queue_wait=5.0)
    try:
        assert stats(server.url)["token_budget"]["total"] == 0
        result: dict[str, httpx.Response] = {}
        thread = threading.Thread(target=lambda: result.setdefault(
            "r", httpx.post(server.url + "/generate", json={"inputs": "hi"}, timeout=10)))
        thread.start()
        assert wait_until(lambda: stats(server.url)["requests"]["waiting"] == 1)  # no decode worker yet
        gw_worker.heartbeat = {"worker_id": "echo", "num_kv_blocks_total": 256, "block_size": 16,
                            "num_kv_blocks_used": 0, "num_requests_running": 0, "num_requests_waiting": 0,
                            "num_preemptions": 0, "max_num_seqs": 64}
        thread.join(10)
        assert result["r"].status_code == 200
        s = stats(server.url)
        assert s["token_budget"] == {"total": 4096, "in_use": 0, "max_request_tokens": 4096,
                                     "source": "decode_heartbeats", "cluster_total": 4096, "gateways": 1}
        assert s["workers"]["decode"][0]["num_kv_blocks_total"] == 256
    finally:
        server.stop()


def test_two_gateways_together_admit_no_more_than_the_budget(default_model_dir, gw_redis_url, gw_tokenizer,
                                                              gw_worker):
    # Issue 13 (2): each gateway admitted against the whole cluster budget, so two gateways behind a
    # load balancer admitted twice what the cluster holds.
    limits = dict(max_batch_total_tokens=1000, max_input_tokens=100, max_total_tokens=500, max_queue_wait=20.0)
    gateways = [start_gateway(default_model_dir, gw_redis_url, gw_tokenizer, **limits) for _ in range(2)]
    try:
        assert wait_until(lambda: all(stats(g.url)["token_budget"]["gateways"] == 2 for g in gateways), timeout=10)
        gw_worker.hold = True
        before = len(gw_worker.requests)
        # 20 requests of about 100 tokens each, half to each gateway: twice the budget.
        threads = [t for g in gateways for t in hold_requests(g.url, 10, max_new_tokens=99)]
        assert wait_until(lambda: sum(stats(g.url)["requests"]["running"] + stats(g.url)["requests"]["waiting"]
                                      for g in gateways) == 20, timeout=10)
        time.sleep(0.5)  # a gateway that over-admitted would have done so by now
        budgets = [stats(g.url)["token_budget"] for g in gateways]
        running = [stats(g.url)["requests"]["running"] for g in gateways]
        assert sum(b["in_use"] for b in budgets) <= 1000, budgets
        cost = budgets[0]["in_use"] // running[0]
        assert running == [500 // cost] * 2  # each its half: the budget is used, not exceeded
        assert wait_until(lambda: len(gw_worker.requests) - before == sum(running))
        gw_worker.hold = False
        for t in threads:
            t.join(30)
        assert all(stats(g.url)["token_budget"]["in_use"] == 0 for g in gateways)
        assert len(gw_worker.requests) - before == 20  # the queued ones were all served in the end
    finally:
        gw_worker.hold = False
        for g in gateways:
            g.stop()
