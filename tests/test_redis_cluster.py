"""Baton on a 3-master Redis Cluster: 2 gateways, 2 prefill and 2 decode workers (issue 13, item 1).

Streams answer what the offline engine answers, a decode worker killed by SIGKILL mid-stream costs
no stream its tokens, KV blocks spread over the masters, and everything stops at the end.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import time

import httpx
import pytest

from baton.protocol import DECODE_GROUP, DECODE_STREAM
from tests.cluster import Cluster
from tests.redis_cluster import RedisClusterServers, cluster_ports
from tests.test_gateway_support import start_gateway, wait_until
from tests.test_faults import WORDS, expected_ids, stream_ids

pytestmark = pytest.mark.skipif(not (shutil.which("redis-cli") or shutil.which("valkey-cli")),
                                reason="redis-cli is needed to create a Redis Cluster")

MAX_NEW_TOKENS = 48


@pytest.fixture(scope="module")
def servers():
    with RedisClusterServers(masters=3) as servers:
        yield servers


@pytest.fixture(scope="module")
def system(servers, tiny_model_dir):
    with Cluster(tiny_model_dir, prefill=2, decode=2, gateways=2, redis_url=servers.url,
                 decode_args=("--max-num-seqs", "8")) as system:
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


def test_streams_match_the_reference_on_a_cluster(system, reference):
    texts = prompts(6, offset=0)
    assert stream_all(system, texts) == expected_ids(reference, texts, MAX_NEW_TOKENS)


def test_the_dashboard_samples_the_streams_on_a_cluster(system):
    """The gateways' stream backlog gauges (XLEN, XINFO GROUPS in one pipeline) work on a cluster:
    the decode stream holds the 6 handoffs of the test above."""
    deadline = time.monotonic() + 10
    while True:  # sampled every 2 s
        lines = [line for line in httpx.get(system.base_urls[1] + "/metrics", timeout=5).text.splitlines()
                 if line.startswith("baton:stream_length{") and 'stream="decode"' in line]
        if lines and float(lines[0].split()[-1]) >= 6:
            break
        assert time.monotonic() < deadline, lines
        time.sleep(0.5)


def test_kv_blocks_spread_over_the_masters(system, servers):
    holders = {port: sum(1 for key in servers.node(port).scan_iter(match="baton:kv:*", count=1000)
                         if not key.startswith(b"baton:kv:partial:"))
               for port in servers.ports}
    assert sum(1 for n in holders.values() if n > 0) > 1, holders
    # the pipeline streams share one slot (their MULTI/EXEC): one master holds them all
    stream_nodes = [port for port in servers.ports if any(servers.node(port).scan_iter(match="{baton}:*"))]
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


def test_everything_stops(system, servers):
    system.stop()
    assert all(proc.poll() is not None for proc in system.procs.values())
    servers.stop()
    assert servers.all_stopped()
