"""Redis Cluster, the parts that need no cluster (issue 20, items 10 and 11; the whole system on a
cluster, a plain URL of one node and a master's failover: tests/test_redis_cluster.py).

A plain redis:// URL that names a Redis Cluster node is told apart when the client is made (`INFO
cluster`) and used as that cluster; a plain Redis, or one not reachable then, keeps the plain
client. A cluster client's lost connections are ConnectionErrors, and a worker's step keeps its
output when the read beside it fails (a failover once cost every stream a step's tokens).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
import types

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from baton.common import redis_client
from baton.cli.redis_server import child_preexec, find_redis_server
from baton.common.redis_client import connect, connect_sync
from kvstore.redis_backend import is_cluster
from tests.redis_cluster import cluster_ports


@pytest.fixture(scope="module")
def cluster_node(tmp_path_factory):
    """One redis-server in cluster mode (no slots: enough for INFO cluster), password s3cret; its port."""
    port = cluster_ports(1)[0]
    workdir = tmp_path_factory.mktemp("cluster-node")
    proc = subprocess.Popen(
        [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
         "--cluster-config-file", "nodes.conf", "--dir", str(workdir), "--save", "", "--appendonly", "no",
         "--requirepass", "s3cret"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=child_preexec(new_session=False, death_signal=signal.SIGKILL))
    try:
        client = redis.Redis(port=port, socket_timeout=5, password="s3cret")
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield port
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(autouse=True)
def fresh_probes():
    redis_client._probed.clear()
    yield
    redis_client._probed.clear()


def test_a_plain_url_of_a_cluster_node_is_used_as_the_cluster(cluster_node, caplog):
    url = f"redis://:s3cret@127.0.0.1:{cluster_node}"
    caplog.set_level(logging.INFO, logger="baton.common.redis_client")
    assert redis_client.cluster_url_of_node(url) == f"redis+cluster://:s3cret@127.0.0.1:{cluster_node}"
    client = connect(url, socket_timeout=3)
    assert type(client) is aioredis.RedisCluster and is_cluster(client)
    assert set(client.nodes_manager.startup_nodes) == {f"127.0.0.1:{cluster_node}"}
    # one INFO line, naming the URL without its password
    lines = [r.getMessage() for r in caplog.records if "is a Redis Cluster node" in r.getMessage()]
    assert lines == [f"redis://:***@127.0.0.1:{cluster_node} is a Redis Cluster node: using it as a cluster"]


def test_tls_and_query_parameters_carry_over(cluster_node):
    assert redis_client.cluster_url_of_node(f"redis://:s3cret@127.0.0.1:{cluster_node}/0?socket_timeout=2") == (
        f"redis+cluster://:s3cret@127.0.0.1:{cluster_node}?socket_timeout=2")  # db 0: a cluster's only one
    redis_client._probed[f"rediss://u:p@127.0.0.1:{cluster_node}?ssl_cert_reqs=none"] = True  # no TLS here
    tls = connect(f"rediss://u:p@127.0.0.1:{cluster_node}?ssl_cert_reqs=none")
    assert is_cluster(tls) and tls.connection_kwargs["connection_class"].__mro__[1].__name__ == "SSLConnection"
    assert tls.connection_kwargs["username"] == "u" and tls.connection_kwargs["password"] == "p"


def test_the_probe_uses_the_password_from_the_environment(cluster_node, monkeypatch):
    url = f"redis://127.0.0.1:{cluster_node}"
    assert type(connect(url)) is aioredis.Redis  # no password: the node cannot say (NOAUTH)
    monkeypatch.setenv("BATON_REDIS_PASSWORD", "s3cret")
    assert is_cluster(connect(url))


def test_a_cluster_node_url_with_another_database_is_refused_naming_it(cluster_node):
    with pytest.raises(ValueError, match=rf"redis://:\*\*\*@127.0.0.1:{cluster_node}/2 is a Redis Cluster node"):
        connect(f"redis://:s3cret@127.0.0.1:{cluster_node}/2")


def test_a_plain_redis_or_one_not_reachable_keeps_the_plain_client(redis_url):
    assert type(connect(redis_url)) is aioredis.Redis
    assert type(connect_sync(redis_url)) is redis.Redis
    assert redis_client._probed == {redis_url: False}
    down = f"redis://127.0.0.1:{cluster_ports(1)[0]}"
    assert type(connect(down)) is aioredis.Redis
    assert down not in redis_client._probed  # asked again by the next client
    # other schemes are never probed
    assert redis_client.cluster_url_of_node("redis+cluster://127.0.0.1:1") is None
    assert redis_client.cluster_url_of_node("unix:///tmp/none.sock") is None


def test_a_cluster_clients_lost_connections_are_connection_errors():
    """uvloop's RuntimeError on a send to a master just killed is ConnectionError on a cluster too
    (the client then refreshes its slots); MOVED stays MovedError there, for the client to follow."""
    client = connect("redis+cluster://127.0.0.1:7000,127.0.0.1:7001")
    lost = client.connection_kwargs["connection_class"]
    assert lost.__name__ == "LostIsConnectionErrorConnection"
    assert {node.connection_class for node in client.nodes_manager.startup_nodes.values()} == {lost}


async def test_a_failed_read_during_a_step_keeps_the_steps_output():
    """The decode worker reads new handoffs while the engine steps; when that read failed (the
    streams' master was just killed), the step's tokens were dropped with the raised error."""
    from baton.worker.thread_lending import StepCores
    from baton.worker.shell import WorkerShell

    class Engine:
        def step(self, loaded: list) -> list[str]:
            return ["the step's tokens"]

        def take_kv_loads(self) -> list:
            return []

    shell = object.__new__(WorkerShell)  # only what step() touches
    shell.engine, shell.loads, shell.refresh_stats = Engine(), [], lambda: None
    shell.stats = types.SimpleNamespace(num_batched_tokens=1)
    metric = types.SimpleNamespace(observe=lambda _value: None)
    gauge = types.SimpleNamespace(set=lambda _value: None)
    shell.metrics = types.SimpleNamespace(step_seconds=metric, iteration_tokens=metric, step_threads=gauge,
                                          core_reclaim_seconds=gauge)
    shell.cores = StepCores.from_args("decode", None, 0, threads=1)  # no ledger: its own threads

    async def read() -> None:
        raise RedisConnectionError("Error 111 connecting to 127.0.0.1:7000. Connection refused.")

    assert await shell.step(read()) == ["the step's tokens"]
    assert await shell.step(read()) == ["the step's tokens"]  # again: the next step reads again
