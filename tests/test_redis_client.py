"""One URL picks the client: a single Redis, a Redis Cluster, a Sentinel's master (TLS and passwords
through the URL); passwords never reach a log line; a cluster gets the effects in their safe order."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from baton.common import protocol
from baton.cli.redis_server import child_preexec, find_redis_server, free_port, start_private_redis
from baton.common.redis_client import connect, connect_sync, is_cluster_url
from kvstore.redis_backend import is_cluster
from baton.common.urls import redact_url
from baton.worker import writer
from baton.worker.core import Effects


def test_the_scheme_picks_the_client():
    assert type(connect("redis://127.0.0.1:6379/0")) is aioredis.Redis
    assert not is_cluster_url("rediss://u:p@example.com:6380")
    cluster = connect("redis+cluster://user:s3cret@10.0.0.1:7000,10.0.0.2:7001")
    assert is_cluster(cluster) and is_cluster(cluster.pipeline())
    assert set(cluster.nodes_manager.startup_nodes) == {"10.0.0.1:7000", "10.0.0.2:7001"}
    assert cluster.connection_kwargs["username"] == "user" and cluster.connection_kwargs["password"] == "s3cret"
    tls = connect("rediss+cluster://:pw@10.0.0.1:7000?ssl_cert_reqs=none")
    assert tls.connection_kwargs["connection_class"].__mro__[1].__name__ == "SSLConnection"
    assert tls.connection_kwargs["ssl_cert_reqs"] == "none"


def test_managed_redis_url_with_tls_and_password():
    """rediss://user:pass@host:port goes to redis-py as TLS with those credentials."""
    client = connect("rediss://app:p%40ss@redis.example.com:6380/2", socket_timeout=3)
    kwargs = client.connection_pool.connection_kwargs
    # TLS, with sends on a connection Redis closed raising ConnectionError as on plain clients
    tls_class = client.connection_pool.connection_class
    assert tls_class.__name__ == "LostIsConnectionErrorSSLConnection"
    assert tls_class.__mro__[1].__name__ == "SSLConnection"
    assert (kwargs["username"], kwargs["password"], kwargs["host"], kwargs["port"], kwargs["db"]) == (
        "app", "p@ss", "redis.example.com", 6380, 2)


def test_a_sentinel_url_needs_its_service_name():
    with pytest.raises(ValueError, match="service"):
        connect("redis+sentinel://127.0.0.1:26379")
    with pytest.raises(ValueError, match="host:port"):
        connect("redis+cluster://127.0.0.1")


@pytest.mark.parametrize("url, shown", [
    ("redis://:s3cret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    ("rediss://app:s3cret@redis.example.com:6380", "rediss://app:***@redis.example.com:6380"),
    ("redis+cluster://app:s3cret@h1:7000,h2:7001", "redis+cluster://app:***@h1:7000,h2:7001"),
    ("redis+sentinel://:s3cret@h1:26379,h2:26379/main?sentinel_password=s3cret&socket_timeout=2",
     "redis+sentinel://:***@h1:26379,h2:26379/main?sentinel_password=***&socket_timeout=2"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("unix:///run/redis.sock?password=s3cret", "unix:///run/redis.sock?password=***"),
])
def test_passwords_are_redacted(url, shown):
    assert redact_url(url) == shown


@pytest.fixture
def sentinel(tmp_path: Path):
    """A password-protected Redis and one Sentinel that monitors it as `main`."""
    server = start_private_redis(password="m4ster")
    port = free_port()
    config = tmp_path / "sentinel.conf"
    config.write_text(f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
                      f"sentinel monitor main 127.0.0.1 {server.port} 1\nsentinel auth-pass main m4ster\n")
    proc = subprocess.Popen([find_redis_server(), str(config), "--sentinel"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                            preexec_fn=child_preexec(new_session=False, death_signal=signal.SIGKILL))
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                if redis.Redis(port=port, socket_timeout=2).sentinel_get_master_addr_by_name("main"):
                    break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "sentinel did not start"
                time.sleep(0.05)
        yield f"redis+sentinel://:m4ster@127.0.0.1:{port}/main"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        server.stop()


def test_sentinel_url_reaches_the_master(sentinel):
    sync = connect_sync(sentinel, socket_timeout=5)
    assert sync.set("baton:sentinel-check", b"1") and sync.get("baton:sentinel-check") == b"1"

    async def read() -> bytes | None:
        client = connect(sentinel, socket_timeout=5)
        try:
            return await client.get("baton:sentinel-check")
        finally:
            await client.aclose()

    assert asyncio.run(read()) == b"1"
    assert redact_url(sentinel).startswith("redis+sentinel://:***@")


class _RecordingPipeline:
    def __init__(self, log: list, transaction: bool) -> None:
        self.log, self.transaction, self.commands = log, transaction, []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.commands.append((name, args[0]))

    async def execute(self):
        self.log.append((self.transaction, self.commands))


def test_on_a_cluster_data_goes_before_the_handoff_and_its_ack(monkeypatch):
    """Across slots a pipeline is unordered: blocks and the first token are written (and answered)
    before the handoff + ack's single-slot MULTI/EXEC; partial-block deletes come last."""
    rounds: list = []

    class FakeCluster:
        def pipeline(self, transaction: bool):
            return _RecordingPipeline(rounds, transaction)

    monkeypatch.setattr(writer, "is_cluster", lambda client: True)
    handoff = protocol.Handoff("r1", "g1", [1, 2], [3], ["h1"], None, protocol.SamplingParams(), 0.0, 0.0)
    effects = Effects(block_puts=[("h1", b"kv")], partial_puts=[("baton:kv:partial:r1", b"p")],
                      handoffs=[handoff], acks=[b"1-0"], deletes=["baton:kv:partial:r0"])
    effects.add_event("g1", protocol.TokenEvent("r1", 0, [3], [0.0]))
    asyncio.run(writer.write_effects(FakeCluster(), effects, protocol.PREFILL_STREAM, protocol.PREFILL_GROUP,
                                     transaction=True))
    assert [(tx, [name for name, _ in cmds]) for tx, cmds in rounds] == [
        (False, ["set", "set", "xadd"]), (True, ["xadd", "xack"]), (False, ["delete"])]
    assert {key for _, key in rounds[1][1]} == {protocol.DECODE_STREAM, protocol.PREFILL_STREAM}


def test_a_send_on_a_connection_redis_closed_is_a_connection_error(redis_url):
    """uvloop's RuntimeError for a write on a closed transport surfaces as ConnectionError (what
    every retry loop handles), and the client's next command reconnects."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    async def scenario() -> None:
        client = connect(redis_url, retry_on_error=[])
        try:
            assert await client.ping()
            connection = await client.connection_pool.get_connection()

            def closed(*_args: object) -> None:
                raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

            connection._writer.writelines = closed
            with pytest.raises(RedisConnectionError, match="connection to Redis lost"):
                await connection.send_command("PING")
            await client.connection_pool.release(connection)
            assert await client.ping()  # a fresh connection
            other = await client.connection_pool.get_connection()
            other._writer.writelines = lambda *_: (_ for _ in ()).throw(RuntimeError("a bug"))
            with pytest.raises(RuntimeError, match="a bug"):  # other RuntimeErrors are not hidden
                await other.send_command("PING")
            await client.connection_pool.release(other)
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_the_password_can_come_from_the_environment(monkeypatch):
    """Issue 20 (6): Kubernetes hands the Redis password from a Secret as BATON_REDIS_PASSWORD;
    a URL without one uses it, a URL's own password wins, on every kind of URL."""
    server = start_private_redis(password="from-the-secret")
    try:
        url = f"redis://127.0.0.1:{server.port}/0"
        with pytest.raises(redis.AuthenticationError):
            connect_sync(url).ping()
        monkeypatch.setenv("BATON_REDIS_PASSWORD", "from-the-secret\n")  # a file's newline is no part of it
        assert connect_sync(url).ping()
        assert asyncio.run(_ping(url))
        monkeypatch.setenv("BATON_REDIS_PASSWORD", "wrong")
        assert connect_sync(f"redis://:from-the-secret@127.0.0.1:{server.port}/0").ping()  # the URL wins
        cluster = connect("redis+cluster://10.0.0.1:7000")
        assert cluster.connection_kwargs["password"] == "wrong"
        assert connect("redis+cluster://:url-pw@10.0.0.1:7000").connection_kwargs["password"] == "url-pw"
    finally:
        server.stop()


async def _ping(url: str) -> bool:
    client = connect(url)
    try:
        return bool(await client.ping())
    finally:
        await client.aclose()
