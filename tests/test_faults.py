"""Kill things while requests run: every stream still completes with the right tokens, nothing leaks."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from baton.common.protocol import DECODE_STREAM
from tests.cluster import Cluster

WORDS = "the quick brown fox jumps over a lazy dog while 東京 and café ☕ wait".split()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from baton import LLM

    return LLM(model=str(tiny_model_dir), dtype="float32", enable_prefix_caching=False)


async def stream_ids(client: httpx.AsyncClient, prompt: str, max_new_tokens: int, first_token: asyncio.Event,
                     counter: list[int]) -> list[int]:
    ids: list[int] = []
    async with client.stream("POST", "/generate_stream", json={
            "inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "do_sample": False,
                                             "details": True}}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            assert "error" not in event, event
            ids.append(event["token"]["id"])
            if event.get("details"):
                assert event["details"]["finish_reason"] in ("length", "eos_token")
                ids.append(-1)  # marks a proper end
            counter[0] += 1
            if counter[0] >= 16:
                first_token.set()
    return ids


def run_streams_and_kill(cluster: Cluster, prompts: list[str], max_new_tokens: int, victim: str,
                         after_tokens: int) -> list[list[int]]:
    async def run() -> list[list[int]]:
        started = asyncio.Event()
        counter = [0]
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=180) as client:
            tasks = [asyncio.create_task(stream_ids(client, p, max_new_tokens, started, counter)) for p in prompts]
            while counter[0] < after_tokens and not all(t.done() for t in tasks):
                await asyncio.sleep(0.01)
            cluster.kill(victim, signal.SIGKILL)
            return await asyncio.gather(*tasks)

    return asyncio.run(run())


def expected_ids(reference, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    from baton import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
    return [o.outputs[0].token_ids + [-1] for o in reference.generate(prompts, params)]


def test_sigkill_of_a_speculating_decode_worker_mid_stream(tiny_model_dir, reference):
    """16 streams over two decode workers, one killed mid-stream: every stream gets the plain greedy
    tokens (the survivor continues from the store's KV). Speculation is on (n-gram), so the takeover
    also replays through verify steps: the survivor's metrics show accepted proposals."""
    from baton.cli.redis_server import free_port

    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}'
    prompts = [" ".join(WORDS[: 3 + i % 10]) for i in range(16)]
    ports = [free_port(), free_port()]
    with Cluster(tiny_model_dir, prefill=2, decode=0,
                 decode_args=("--max-num-seqs", "8", "--speculative-config", spec)) as cluster:
        for i, port in enumerate(ports):
            cluster.start_worker("decode_worker", f"decode-{i}", args=("--metrics-port", str(port)))
        cluster.wait_ready(2, 2)
        got = run_streams_and_kill(cluster, prompts, 120, "decode-0", after_tokens=200)
        expected = expected_ids(reference, prompts, 120)
        for i, (g, e) in enumerate(zip(got, expected)):
            assert g == e, (i, len(g), len(e), next((k for k, (a, b) in enumerate(zip(g, e)) if a != b), None), g[-5:], e[-5:])
        assert cluster.procs["decode-0"].poll() is not None
        metrics = httpx.get(f"http://127.0.0.1:{ports[1]}/metrics", timeout=10).text
        accepted = [float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("baton:worker_spec_decode_num_accepted_tokens_total")]
        assert accepted and accepted[0] > 0, metrics[-2000:]
        cluster.wait_idle(timeout=30)


def test_sigkill_prefill_worker_mid_prompt(tiny_model_dir, reference):
    # Long prompts and a small prefill budget keep prefills in flight when the worker dies.
    prompts = [" ".join(WORDS * (20 + i)) for i in range(16)]
    with Cluster(tiny_model_dir, prefill=2, decode=2, prefill_args=("--max-num-batched-tokens", "32"),
                 gateway_args=("--max-input-tokens", "1500", "--max-total-tokens", "2000")) as cluster:
        got = run_streams_and_kill(cluster, prompts, 16, "prefill-0", after_tokens=1)
        assert got == expected_ids(reference, prompts, 16)
        cluster.wait_idle(timeout=30)


def wait_for_worker(cluster: Cluster, worker_id: str, timeout: float = 120) -> None:
    """Until `worker_id` has a live heartbeat (a frozen peer's may expire meanwhile: counts lie)."""
    deadline = time.time() + timeout
    kind = worker_id.split("-")[0]
    while not any(s.get("worker_id") == worker_id for s in cluster.worker_states(kind)):
        assert cluster.procs[worker_id].poll() is None, f"{worker_id} exited"
        assert time.time() < deadline, f"{worker_id} did not start"
        time.sleep(0.2)


def test_resume_on_a_worker_with_other_numerics_never_splices_two_texts(tiny_model_dir, reference):
    # Issue 11 (2f): decode-0 (float32) dies mid-stream; decode-1 (bfloat16) takes the request over
    # and regenerates it. A seeded sampled request then either continues exactly (the same tokens
    # again) or ends with a clear error: never a text no single worker produced.
    from baton import SamplingParams

    with Cluster(tiny_model_dir, prefill=1, decode=1) as cluster:
        prompt, n = "once upon a time", 400
        [ref] = reference.generate([prompt], SamplingParams(temperature=0.9, seed=7, max_tokens=n, ignore_eos=True))

        async def run() -> list[dict]:
            events: list[dict] = []
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as client:
                async with client.stream("POST", "/generate_stream", json={"inputs": prompt, "parameters": {
                        "max_new_tokens": n, "do_sample": True, "temperature": 0.9, "seed": 7,
                        "details": True}}) as response:
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        events.append(json.loads(line[5:]))
                        if len(events) == 20:
                            cluster.procs["decode-0"].send_signal(signal.SIGSTOP)  # frozen mid-request
                            cluster.start_worker("decode_worker", "decode-1", dtype="bfloat16")
                            await asyncio.to_thread(wait_for_worker, cluster, "decode-1")
                            cluster.kill("decode-0", signal.SIGKILL)
            return events

        events = asyncio.run(run())
        ids = [e["token"]["id"] for e in events if "token" in e]
        # What decode-0 sent is the float32 text; decode-1 regenerated from token 1, and the gateway
        # compared every token it had already sent: what follows continues that same prefix.
        assert ids[:20] == ref.outputs[0].token_ids[:20]
        last = events[-1]
        if "error" in last:
            assert "different tokens" in last["error"]
        else:
            assert len(ids) == n and last["details"]["finish_reason"] == "length"
        cluster.wait_idle()


def test_redis_outage_gives_503_then_recovers(tiny_model_dir):
    with Cluster(tiny_model_dir, prefill=1, decode=1) as cluster:
        body = {"inputs": "hello there", "parameters": {"max_new_tokens": 4}}
        assert httpx.post(cluster.base_url + "/generate", json=body, timeout=60).status_code == 200
        port = cluster.redis.port
        cluster.redis.process.kill()
        cluster.redis.process.wait()
        time.sleep(0.5)
        started = time.time()
        response = httpx.post(cluster.base_url + "/generate", json=body, timeout=30)
        assert response.status_code == 503 and time.time() - started < 5, response.text
        assert httpx.get(cluster.base_url + "/health", timeout=10).status_code == 503
        # Redis comes back (empty, as a restarted cache would) on the same port.
        from baton.cli.redis_server import start_private_redis

        cluster.redis = start_private_redis(port=port)
        deadline = time.time() + 60
        status = None
        while time.time() < deadline:
            try:
                status = httpx.post(cluster.base_url + "/generate", json=body, timeout=30).status_code
            except httpx.HTTPError:
                status = None
            if status == 200:
                break
            time.sleep(0.5)
        assert status == 200
        assert all(p.poll() is None for p in cluster.procs.values())  # nobody restarted


def test_sigterm_drains_in_flight_requests(tiny_model_dir):
    # decode-0 gets SIGTERM mid-stream: it finishes what it holds and exits 0; the handoffs it has
    # not taken go to decode-1. No request is lost.
    with Cluster(tiny_model_dir, prefill=1, decode=2) as cluster:
        async def run() -> list[int]:
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as client:
                started = asyncio.Event()
                counter = [0]
                tasks = [asyncio.create_task(stream_ids(client, "count with me", 200, started, counter))
                         for _ in range(8)]
                while counter[0] < 8:
                    await asyncio.sleep(0.01)
                cluster.kill("decode-0", signal.SIGTERM)
                return await asyncio.gather(*tasks)

        results = asyncio.run(run())
        assert all(ids[-1] == -1 and len(ids) > 8 for ids in results)  # drained: every request ended properly
        assert cluster.procs["decode-0"].wait(timeout=30) == 0


def test_a_draining_worker_stays_alive_to_peers_and_still_applies_cancels(tiny_model_dir):
    # Issue 11 (2a): the heartbeat and the cancel reader ran only until SIGTERM, so peers claimed a
    # draining worker's requests (decoding them twice) and cancels during the drain were lost.
    with Cluster(tiny_model_dir, prefill=1, decode=1) as cluster:
        def decode_state() -> dict:
            states = cluster.worker_states("decode")
            return states[0] if states else {}

        def wait_for(predicate, timeout: float = 10) -> dict:
            deadline = time.time() + timeout
            while time.time() < deadline:
                state = decode_state()
                if predicate(state):
                    return state
                time.sleep(0.1)
            raise AssertionError(f"decode worker state never matched: {decode_state()}")

        async def run() -> None:
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as client:
                started = asyncio.Event()
                counter = [0]
                tasks = [asyncio.create_task(stream_ids(client, f"story {i}", 1900, started, counter))
                         for i in range(8)]
                await asyncio.to_thread(wait_for, lambda s: s.get("num_requests_running") == 8, 60)
                cluster.kill("decode-0", signal.SIGTERM)
                state = await asyncio.to_thread(wait_for, lambda s: s.get("draining") is True, 5)
                assert state["num_requests_running"] == 8  # draining, alive, still holding its requests
                tasks[0].cancel()  # this client leaves during the drain: its request must stop there
                await asyncio.to_thread(wait_for, lambda s: s.get("num_requests_running") == 7, 5)
                assert cluster.procs["decode-0"].poll() is None
                for task in tasks[1:]:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(run())
        assert cluster.procs["decode-0"].wait(timeout=30) == 0
        assert not cluster.worker_states("decode")  # a clean exit withdraws its heartbeat
        assert cluster.client.xpending(DECODE_STREAM, "decode")["pending"] == 0  # cancels acked


def test_gateway_death_frees_its_requests_on_the_workers(tiny_model_dir):
    with Cluster(tiny_model_dir, prefill=1, decode=1, decode_args=("--gateway-grace", "3")) as cluster:
        async def start_streams() -> None:
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as client:
                async def one() -> None:
                    async with client.stream("POST", "/generate_stream", json={
                            "inputs": "a story", "parameters": {"max_new_tokens": 1500}}) as response:
                        async for line in response.aiter_lines():
                            if line.startswith("data:"):
                                return  # decoding has started
                await asyncio.gather(*(one() for _ in range(4)))
                cluster.kill("gateway", signal.SIGKILL)

        try:
            asyncio.run(start_streams())
        except httpx.HTTPError:
            pass
        # The gateway's heartbeat expires (5 s) and stays gone for the grace (3 s): the decode worker
        # drops its requests and frees their blocks.
        def idle() -> bool:
            states = cluster.worker_states("decode")
            return (bool(states) and all(s["num_requests_running"] == 0 and s["num_kv_blocks_used"] == 0
                                         for s in states)
                    and cluster.client.xpending(DECODE_STREAM, "decode")["pending"] == 0)

        deadline = time.time() + 30
        while time.time() < deadline and not idle():
            time.sleep(0.5)
        assert idle(), (cluster.worker_states("decode"), cluster.client.xpending(DECODE_STREAM, "decode"))
