"""Baton on a Redis Cluster of 3 masters, each with a replica: 2 gateways, 2 prefill and 2 decode
workers (issue 13, item 1).

Streams answer what the offline engine answers, a decode worker killed by SIGKILL mid-stream costs
no stream its tokens, KV blocks spread over the masters, and everything stops at the end. Half the
processes take a plain redis:// URL of one node, which works as the cluster (issue 20, item 11). The
master of the work streams killed by SIGKILL under streaming load: every stream ends, with its tokens
or a retryable error, and the system serves again once the replica took over (issue 20, item 10).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import time

import httpx
import pytest

from baton.common import redis_client
from baton.common.protocol import DECODE_GROUP, DECODE_STREAM, PREFILL_STREAM
from tests.cluster import Cluster
from tests.redis_cluster import NODE_TIMEOUT_MS, RedisClusterServers, cluster_ports
from tests.test_gateway_support import start_gateway, wait_until
from tests.test_faults import WORDS, expected_ids, stream_ids

pytestmark = pytest.mark.skipif(not (shutil.which("redis-cli") or shutil.which("valkey-cli")),
                                reason="redis-cli is needed to create a Redis Cluster")

MAX_NEW_TOKENS = 48


@pytest.fixture(scope="module")
def servers():
    with RedisClusterServers(masters=3, replicas=1) as servers:
        yield servers


class MixedUrlCluster(Cluster):
    """prefill-1, decode-1 and gateway-1 take `plain_url`, the others the cluster's URL."""

    def __init__(self, *args, plain_url: str, **kwargs) -> None:
        self.plain_url = plain_url
        super().__init__(*args, **kwargs)

    def _spawn(self, name, cmd):
        if name.endswith("-1"):
            cmd = [self.plain_url if arg == self.redis_url else arg for arg in cmd]
        return super()._spawn(name, cmd)


@pytest.fixture(scope="module")
def plain_url(servers) -> str:
    """redis://host:port of one master, not the work streams' one: its MOVED replies matter."""
    return f"redis://127.0.0.1:{next(p for p in servers.masters() if p != servers.master_of(PREFILL_STREAM))}"


@pytest.fixture(scope="module")
def system(servers, tiny_model_dir, plain_url):
    with MixedUrlCluster(tiny_model_dir, prefill=2, decode=2, gateways=2, redis_url=servers.url,
                         decode_args=("--max-num-seqs", "8"), plain_url=plain_url) as system:
        yield system


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from baton import LLM

    return LLM(model=str(tiny_model_dir), dtype="float32", enable_prefix_caching=False)


def prompts(n: int, offset: int) -> list[str]:
    # Several full blocks each, so the prefill workers write KV blocks to the store.
    return [" ".join(WORDS[(i + offset) % len(WORDS):] + WORDS * (2 + i % 3)) for i in range(n)]


def stream_all(system: Cluster, texts: list[str], kill: str | None = None, after_tokens: int = 0,
               held: list[int] | None = None) -> list[list[int]]:
    """Stream every prompt (alternating between the gateways); SIGKILL `kill` once `after_tokens`
    tokens have arrived in all, noting in `held` how many handoffs it held then."""
    async def run() -> list[list[int]]:
        started, counter = asyncio.Event(), [0]
        clients = [httpx.AsyncClient(base_url=url, timeout=120) for url in system.base_urls]
        try:
            tasks = [asyncio.create_task(stream_ids(clients[i % len(clients)], text, MAX_NEW_TOKENS, started, counter))
                     for i, text in enumerate(texts)]
            if kill is not None:
                while counter[0] < after_tokens and not all(t.done() for t in tasks):
                    await asyncio.sleep(0.01)
                assert not all(t.done() for t in tasks), "every stream ended before the kill"
                if held is not None:
                    held.append(len(system.client.xpending_range(DECODE_STREAM, DECODE_GROUP, "-", "+", 100,
                                                                 consumername=kill)))
                system.kill(kill, signal.SIGKILL)
            return await asyncio.gather(*tasks)
        finally:
            for client in clients:
                await client.aclose()

    return asyncio.run(run())


def test_a_plain_client_of_a_cluster_node_names_the_url_on_moved(servers):
    """A node that was not reachable when the client was made got a plain client: its first MOVED
    reply says what the URL is and what to do (a worker exits on it; its restart detects it)."""
    node = servers.masters()[0]
    url = f"redis://127.0.0.1:{node}"
    key = next(f"k{i}" for i in range(1000) if servers.master_of(f"k{i}") != node)

    async def scenario() -> None:
        redis_client._probed[url] = False  # as if it had not answered
        client = redis_client.connect(url)
        try:
            with pytest.raises(redis_client.ClusterNodeError, match=rf"redis://127.0.0.1:{node} is a Redis Cluster "
                                                                    "node .*redis\\+cluster://"):
                await client.get(key)
        finally:
            await client.aclose()
            redis_client._probed.pop(url, None)

    asyncio.run(scenario())


def test_streams_match_the_reference_on_a_cluster(system, reference):
    texts = prompts(6, offset=0)
    assert stream_all(system, texts) == expected_ids(reference, texts, MAX_NEW_TOKENS)


def test_the_dashboard_samples_the_streams_on_a_cluster(system):
    """The gateways' stream backlog gauges (XLEN, XINFO GROUPS in one pipeline) work on a cluster
    (a gauge has a value only once sampled), and the decode workers trimmed the 6 handoffs of the
    test above once acknowledged (issue 38: a work stream holds what is not yet done)."""
    deadline = time.monotonic() + 10
    while True:  # sampled every 2 s
        values = {line.split("{")[0]: float(line.split()[-1])
                  for line in httpx.get(system.base_urls[1] + "/metrics", timeout=5).text.splitlines()
                  if line.startswith("baton:stream_") and 'stream="decode"' in line}
        if values == {"baton:stream_length": 0, "baton:stream_pending": 0, "baton:stream_lag": 0}:
            break
        assert time.monotonic() < deadline, values
        time.sleep(0.5)


def test_work_streams_are_trimmed_and_responses_stored_on_a_cluster(servers):
    """Issue 38's storage commands on a cluster: trimming what a group acknowledged (XINFO GROUPS,
    XPENDING, XTRIM MINID on the `{baton}` slot), the cancels' script, and the stored responses'
    scripts (on their own `{baton:responses}` slot, the keys of the responses they drop included)."""
    from baton.common.protocol import CANCEL_STREAM, PIPELINE_TAG, Cancel
    from baton.worker.runtime import ensure_group, trim_acknowledged
    from gateway.backend import RedisBackend
    from gateway.errors import ApiError
    from gateway.responses.store import ResponseStore

    async def scenario() -> None:
        client = redis_client.connect(servers.url)
        try:
            stream = PIPELINE_TAG + ":test-trim"
            await ensure_group(client, stream, "g")
            for i in range(20):
                await client.xadd(stream, {"m": str(i)})
            [(_, entries)] = await client.xreadgroup("g", "c", {stream: ">"}, count=20)
            await client.xack(stream, "g", *(message_id for message_id, _ in entries[:15]))
            assert await trim_acknowledged(client, stream) == 15 and await client.xlen(stream) == 5
            await client.delete(stream)

            before = await client.xlen(CANCEL_STREAM)
            await RedisBackend(client).send_cancels([Cancel("no-such-request", "gw-test")])  # a no-op to the workers
            assert await client.xlen(CANCEL_STREAM) == before + 1

            store = ResponseStore(client, 60, 3000, 1)  # room for two of these
            for i in range(4):
                assert await store.save({"id": f"resp_cluster{i}", "text": "x" * 1000}, [])
            for i in range(2):
                with pytest.raises(ApiError):
                    await store.load(f"resp_cluster{i}", "response_id")
            assert (await store.load("resp_cluster3", "response_id"))["response"]["text"] == "x" * 1000
            assert await store.delete("resp_cluster2") and await store.delete("resp_cluster3")
            assert await store.sweep() == 0
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_kv_blocks_spread_over_the_masters(system, servers):
    masters = servers.masters()
    holders = {port: sum(1 for key in servers.node(port).scan_iter(match="baton:kv:*", count=1000)
                         if not key.startswith(b"baton:kv:partial:"))
               for port in masters}
    assert sum(1 for n in holders.values() if n > 0) > 1, holders
    # the pipeline streams share one slot (their MULTI/EXEC): one master holds them all
    stream_nodes = [port for port in masters if any(servers.node(port).scan_iter(match="{baton}:*"))]
    assert len(stream_nodes) == 1, stream_nodes


def test_sigkill_of_a_decode_worker_mid_stream(system, reference):
    texts = prompts(8, offset=3)
    held: list[int] = []
    got = stream_all(system, texts, kill="decode-0", after_tokens=60, held=held)
    assert held[0] > 0  # it died holding requests: the survivor claimed and finished them
    assert got == expected_ids(reference, texts, MAX_NEW_TOKENS)
    assert system.procs["decode-0"].poll() is not None
    system.wait_idle(timeout=30)
    assert httpx.get(system.base_urls[1] + "/stats", timeout=5).json()["requests"]["running"] == 0


def test_processes_given_a_plain_url_of_one_node_use_it_as_the_cluster(system, plain_url):
    """redis://host:port of one cluster node (the URL users try first): prefill-1, decode-1 and
    gateway-1 detect the cluster and use it as one. Before, the workers died on MOVED in a loop and
    /ready stayed 503. decode-1 served every stream since decode-0 was killed above."""
    line = f"{plain_url} is a Redis Cluster node: using it as a cluster"
    for name in ("prefill-1", "decode-1", "gateway-1"):
        assert system.procs[name].poll() is None, name
        assert line in (system.log_dir / f"{name}-{system.port}.log").read_text(), name
    assert httpx.get(system.base_urls[1] + "/ready", timeout=5).status_code == 200
    states = {s["worker_id"]: s for kind in ("prefill", "decode") for s in system.fresh_worker_states(kind)}
    assert {"prefill-1", "decode-1"} <= set(states), states
    assert states["decode-1"]["num_requests_finished"] > 0


def test_a_gateway_started_before_its_cluster_answers_503_then_serves(default_model_dir, gw_tokenizer):
    """No node answers: the cluster client raises RedisClusterException, no RedisError; the gateway
    must say "unreachable" (not crash a task) and recover once the cluster is up."""
    ports = cluster_ports(3)
    server = start_gateway(default_model_dir, "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports),
                           gw_tokenizer)
    try:
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503 and "unreachable" in health.json()["error"], health.text
        assert httpx.post(server.url + "/generate", json={"inputs": "x"}, timeout=5).status_code == 503
        with RedisClusterServers(ports=ports):
            assert wait_until(lambda: httpx.get(server.url + "/health", timeout=5).status_code == 200, timeout=15)
    finally:
        server.stop()


async def stream_outcome(client: httpx.AsyncClient, prompt: str, counter: list[int]) -> tuple[list[int], dict | None]:
    """(token ids, -1 after a proper end; the error that ended the stream, None if none)."""
    ids: list[int] = []
    async with client.stream("POST", "/generate_stream", json={
            "inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False,
                                             "details": True}}) as response:
        if response.status_code != 200:
            return ids, {"status": response.status_code, **json.loads(await response.aread())}
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                return ids, event
            ids.append(event["token"]["id"])
            counter[0] += 1
            if event.get("details"):
                ids.append(-1)
    return ids, None


def test_failover_of_the_streams_master_under_streaming_load(system, servers, reference):
    """SIGKILL the master of the work streams' slot while 6 streams run: each ends within a bound
    with its whole greedy output or a retryable error (a 503 `unavailable`), its tokens so far a
    prefix of that output; once the replica took over, both gateways serve again, and every budget
    is released."""
    texts = prompts(6, offset=7)
    want = expected_ids(reference, texts, MAX_NEW_TOKENS)
    victim = servers.master_of(PREFILL_STREAM)
    failover_bound_s = 5 * NODE_TIMEOUT_MS / 1000  # detection (node timeout), election, promotion
    streams_bound_s = failover_bound_s + 20

    async def run() -> tuple[float, float, float, list[tuple[list[int], dict | None]]]:
        counter = [0]
        clients = [httpx.AsyncClient(base_url=url, timeout=120) for url in system.base_urls]
        try:
            tasks = [asyncio.create_task(stream_outcome(clients[i % len(clients)], text, counter))
                     for i, text in enumerate(texts)]
            while counter[0] < 30 and not all(t.done() for t in tasks):
                await asyncio.sleep(0.01)
            assert not all(t.done() for t in tasks), "every stream ended before the kill"
            killed = time.monotonic()
            servers.kill(victim)
            failover_s = await asyncio.to_thread(servers.wait_failover, victim, failover_bound_s)
            done, pending = await asyncio.wait(tasks, timeout=streams_bound_s - (time.monotonic() - killed))
            for task in pending:
                task.cancel()
            assert not pending, f"{len(pending)} streams still open {streams_bound_s:.0f}s after the kill"
            return killed, failover_s, time.monotonic() - killed, [t.result() for t in tasks]
        finally:
            for client in clients:
                await client.aclose()

    killed, failover_s, streams_s, outcomes = asyncio.run(run())
    for (ids, error), expected in zip(outcomes, want):
        if error is None:
            assert ids == expected
        else:
            assert error.get("error_type") == "unavailable" and error.get("status", 503) == 503, error
            assert ids == expected[:len(ids)], (ids, expected)
    # serving again: the first request that succeeds after the kill, then every prompt, both gateways
    for base_url in system.base_urls:
        while True:
            ids, error = asyncio.run(_one(base_url, texts[0]))
            if error is None:
                break
            assert error.get("error_type") == "unavailable", error
            assert time.monotonic() - killed < failover_bound_s + 10, f"{base_url} not serving again: {error}"
            time.sleep(0.2)
        assert ids == want[0]
    serving_s = time.monotonic() - killed
    assert stream_all(system, texts) == want
    system.wait_idle(timeout=30)
    for url in system.base_urls:
        stats = httpx.get(url + "/stats", timeout=5).json()
        assert stats["token_budget"]["in_use"] == 0 and stats["requests"]["running"] == 0, stats
    print(f"failover: cluster ok again {failover_s:.1f}s after the kill, streams ended {streams_s:.1f}s after, "
          f"serving {serving_s:.1f}s after; {sum(e is not None for _, e in outcomes)}/{len(outcomes)} streams "
          "ended with an error")


async def _one(base_url: str, text: str) -> tuple[list[int], dict | None]:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        return await stream_outcome(client, text, [0])


def test_everything_stops(system, servers):
    system.stop()
    assert all(proc.poll() is not None for proc in system.procs.values())
    servers.stop()
    assert servers.all_stopped()
