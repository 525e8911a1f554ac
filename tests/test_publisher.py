"""Worker I/O: token output batched per gateway, in order, retried; heartbeats by index; boot ids."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from baton.common import heartbeats, protocol
from baton.worker.core import Effects
from baton.worker.publisher import EventPublisher


def event(request_id: str, index: int, finish: str | None = None) -> protocol.TokenEvent:
    return protocol.TokenEvent(request_id, index, [index + 100], [-0.5], finish_reason=finish, worker_id="w")


def test_token_batch_round_trip_and_strict_decoding():
    events = [event("a", 0), event("b", 3, "length")]
    decoded = protocol.decode(protocol.encode_token_batch(events))
    assert isinstance(decoded, protocol.TokenBatch) and decoded.events == events
    bad = msgpack.packb({"v": protocol.SCHEMA_VERSION, "kind": "token_batch", "events": [{"request_id": 1}]})
    with pytest.raises(protocol.MalformedMessage):
        protocol.decode(bad)
    nested = msgpack.packb({"v": protocol.SCHEMA_VERSION, "kind": "token_batch",
                            "events": [{"kind": "cancel", "request_id": "x", "gateway_id": "g"}]})
    with pytest.raises(protocol.MalformedMessage):
        protocol.decode(nested)


async def read_stream(client: aioredis.Redis, gateway: str) -> list[list[protocol.TokenEvent]]:
    entries = await client.xrange(protocol.token_stream(gateway))
    return [protocol.decode(fields[protocol.PAYLOAD_FIELD]).events for _, fields in entries]


async def test_publisher_writes_one_entry_per_gateway_per_step_in_order_then_acks(redis_url):
    client = aioredis.from_url(redis_url)
    stream, group = "test:pub:" + str(time.time_ns()), "g"
    await client.xgroup_create(stream, group, id="0", mkstream=True)
    ids = [await client.xadd(stream, {"m": b"x"}) for _ in range(2)]
    await client.xreadgroup(group, "me", {stream: ">"})
    publisher = EventPublisher(client, stream, group)
    task = asyncio.create_task(publisher.run())
    try:
        gw1, gw2 = f"gw1-{time.time_ns()}", f"gw2-{time.time_ns()}"
        for gw in (gw1, gw2):
            await protocol.create_token_stream(client, gw, 60)
        first = Effects()
        first.add_event(gw1, event("a", 0))
        first.add_event(gw1, event("b", 0))
        first.add_event(gw2, event("c", 0))
        second = Effects()
        second.add_event(gw1, event("a", 1, "length"))
        second.acks.append(ids[0])
        second.deletes.append("baton:kv:partial:a")
        publisher.submit(first)
        publisher.submit(second)
        publisher.submit(Effects())  # empty: nothing written
        assert await publisher.flush(5)
        assert [[(e.request_id, e.index) for e in batch] for batch in await read_stream(client, gw1)] == \
            [[("a", 0), ("b", 0)], [("a", 1)]]
        assert [[e.request_id for e in batch] for batch in await read_stream(client, gw2)] == [["c"]]
        pending = await client.xpending(stream, group)
        assert pending["pending"] == 1  # the finished request's handoff is acked, the other is not
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()


async def test_a_failed_write_is_retried_and_nothing_is_lost(redis_url, monkeypatch):
    client = aioredis.from_url(redis_url)
    publisher = EventPublisher(client, "test:pub:none", "g")
    failures = [2]
    real_pipeline = client.pipeline

    def flaky_pipeline(*args, **kwargs):
        pipe = real_pipeline(*args, **kwargs)
        real_execute = pipe.execute

        async def execute(*a, **k):
            if failures[0] > 0:  # the connection drops before the write reaches Redis
                failures[0] -= 1
                await pipe.reset()
                raise RedisConnectionError("connection reset by peer")
            return await real_execute(*a, **k)

        pipe.execute = execute
        return pipe

    monkeypatch.setattr(client, "pipeline", flaky_pipeline)
    task = asyncio.create_task(publisher.run())
    try:
        gw = f"gw-{time.time_ns()}"
        await protocol.create_token_stream(client, gw, 60)
        for i in range(3):
            step = Effects()
            step.add_event(gw, event("r", i))
            publisher.submit(step)
        assert await publisher.flush(10)
        assert publisher.num_retries == 2
        assert [[e.index for e in batch] for batch in await read_stream(client, gw)] == [[0], [1], [2]]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()


async def test_heartbeats_are_found_through_the_index_not_by_scanning(redis_url):
    client = aioredis.from_url(redis_url)
    suffix = str(time.time_ns())
    try:
        pipe = client.pipeline(transaction=False)
        heartbeats.queue_beat(pipe, "decode", "d" + suffix, {"num_requests_running": 3}, 5)
        heartbeats.queue_beat(pipe, "prefill", "p" + suffix, {}, 5)
        heartbeats.queue_beat(pipe, "decode", "short" + suffix, {}, 0.2)
        await pipe.execute()
        await client.set(protocol.heartbeat_key("decode", "unindexed" + suffix), b"x")  # not registered: unseen
        decode_ids = {heartbeats.worker_id_of(k) for k, _ in await heartbeats.live(client, "decode")}
        assert {"d" + suffix, "short" + suffix} <= decode_ids and "unindexed" + suffix not in decode_ids
        assert "p" + suffix not in decode_ids
        await asyncio.sleep(0.4)  # the short one expired (on the Redis server's clock): skipped
        beats = dict(await heartbeats.live(client, "decode"))
        ids = {heartbeats.worker_id_of(k) for k in beats}
        assert "short" + suffix not in ids and "d" + suffix in ids
        assert msgpack.unpackb(beats[protocol.heartbeat_key("decode", "d" + suffix).encode()]) == \
            {"num_requests_running": 3}
        # Nothing of a heartbeat has a TTL, so the store's volatile-lru eviction never takes one.
        assert await client.ttl(heartbeats.REGISTRY) == -1 and await client.ttl(heartbeats.DATA) == -1
        pipe = client.pipeline(transaction=False)
        heartbeats.queue_withdraw(pipe, "decode", "d" + suffix)
        await pipe.execute()
        assert "d" + suffix not in {heartbeats.worker_id_of(k) for k, _ in await heartbeats.live(client, "decode")}
    finally:
        await client.aclose()


def test_each_boot_gets_its_own_worker_id(monkeypatch):
    from baton.worker.runtime import default_worker_id

    monkeypatch.setattr("os.getpid", lambda: 1)  # a container restarted under an init: same pid
    first, second = default_worker_id("decode"), default_worker_id("decode")
    assert first != second and first.startswith("decode-") and second.startswith("decode-")


async def test_a_dead_consumers_message_is_claimed_behind_a_live_peers_many(redis_url):
    # Issue 11 (2g): the claim scan read the 50 oldest pending entries of all consumers; a live
    # peer's older entries hid a dead worker's, which then stayed pending forever.
    from baton.worker.runtime import claim_from_dead, remove_dead_consumers

    client = aioredis.from_url(redis_url)
    suffix = str(time.time_ns())
    stream, group, live, dead = "test:claim:" + suffix, "g", "live-" + suffix, "dead-" + suffix
    try:
        await client.xgroup_create(stream, group, id="0", mkstream=True)
        for _ in range(60):
            await client.xadd(stream, {"m": b"live"})
        await client.xreadgroup(group, live, {stream: ">"})
        dead_id = await client.xadd(stream, {"m": b"dead"})
        await client.xreadgroup(group, dead, {stream: ">"})
        pipe = client.pipeline(transaction=False)
        heartbeats.queue_beat(pipe, "decode", live, {}, 30)  # only the live one beats
        await pipe.execute()
        await asyncio.sleep(0.05)
        claimed = await claim_from_dead(client, stream, group, "me-" + suffix, "decode", min_idle_ms=10)
        assert [(mid, fields, n) for mid, fields, n in claimed] == [(dead_id, {b"m": b"dead"}, 1)]
        # The dead consumer now holds nothing: it is removed from the group; the live one stays.
        removed = await remove_dead_consumers(client, stream, group, "decode", min_idle_ms=0)
        assert removed == [dead]
        names = {c["name"] for c in await client.xinfo_consumers(stream, group)}
        assert names == {live.encode(), ("me-" + suffix).encode()}
    finally:
        await client.delete(stream)
        await client.aclose()


async def test_events_for_a_gateway_without_a_stream_do_not_recreate_it(redis_url):
    # Issue 11 (2h): workers re-created a dead gateway's expired token stream, without a TTL.
    client = aioredis.from_url(redis_url)
    publisher = EventPublisher(client, "test:pub:gone", "g")
    task = asyncio.create_task(publisher.run())
    try:
        gone, alive = f"gone-{time.time_ns()}", f"alive-{time.time_ns()}"
        await protocol.create_token_stream(client, alive, 60)
        effects = Effects()
        effects.add_event(gone, event("a", 0))
        effects.add_event(alive, event("b", 0))
        publisher.submit(effects)
        assert await publisher.flush(5)
        assert not await client.exists(protocol.token_stream(gone))
        assert [[e.request_id for e in batch] for batch in await read_stream(client, alive)] == [["b"]]
        assert 0 < await client.ttl(protocol.token_stream(alive)) <= 60
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()


async def test_an_out_of_memory_redis_delays_the_output_but_loses_nothing():
    # Issue 11 (2d): an OOM reply was re-raised and the worker exited.
    from baton.cli.redis_server import start_private_redis

    server = start_private_redis()
    client = aioredis.from_url(server.url)
    publisher = EventPublisher(client, "test:pub:oom", "g")
    task = asyncio.create_task(publisher.run())
    try:
        gw = f"gw-{time.time_ns()}"
        await protocol.create_token_stream(client, gw, 600)
        await client.config_set("maxmemory-policy", "noeviction")
        await client.config_set("maxmemory", 1)  # full: every write that needs memory is refused
        with pytest.raises(Exception, match="maxmemory"):
            await client.set("probe", b"x")
        effects = Effects()
        effects.add_event(gw, event("a", 0))
        publisher.submit(effects)
        await asyncio.sleep(0.5)
        assert publisher.num_retries > 0 and not task.done()  # refused, retried, still alive
        await client.config_set("maxmemory", 0)
        assert await publisher.flush(10)
        assert [[e.request_id for e in batch] for batch in await read_stream(client, gw)] == [["a"]]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
        server.stop()


def test_worker_metrics_bind_loopback_unless_told_otherwise():
    # Issue 11 (2l): every worker's metrics port listened on all interfaces.
    import argparse
    import socket

    from baton.cli.redis_server import free_port
    from baton.worker.args import add_common_args
    from baton.worker.health import serve_metrics

    parser = argparse.ArgumentParser()
    add_common_args(parser, "decode")
    args = parser.parse_args(["--metrics-port", str(free_port())])
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outward address
    outward = probe.getsockname()[0]
    probe.close()
    if outward.startswith("127."):
        pytest.skip("this machine has no address besides loopback")
    server = serve_metrics(args.metrics_port, args.metrics_host)
    try:
        socket.create_connection(("127.0.0.1", args.metrics_port), timeout=2).close()
        with pytest.raises(OSError):
            socket.create_connection((outward, args.metrics_port), timeout=2).close()
    finally:
        server.shutdown()
        server.server_close()
