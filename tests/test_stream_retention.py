"""No work is ever trimmed from a stream (issue 38, item 2): a backlog of prefill requests or
decode handoffs past the old `MAXLEN ~10000` is delivered whole, acknowledged entries are trimmed
so a work stream holds what is not yet done, and cancels are trimmed by age, not count."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from baton.common import protocol
from baton.common.protocol import (CANCEL_RETENTION_S, CANCEL_STREAM, DECODE_GROUP, DECODE_STREAM, PAYLOAD_FIELD,
                                   PREFILL_GROUP, PREFILL_STREAM, Cancel, Handoff, PrefillRequest)
from baton.common.sampling_params import SamplingParams
from baton.worker.core import Effects
from baton.worker.runtime import ensure_group, trim_acknowledged
from baton.worker.writer import write_effects
from gateway.backend import RedisBackend

OLD_CAP = 10_000  # the MAXLEN every XADD carried
BACKLOG = OLD_CAP + 2_000
BATCH = 1_000


@pytest.fixture
async def client(redis_url):
    client = aioredis.from_url(redis_url)
    await client.flushall()
    yield client
    await client.aclose()


def prefill_request(i: int) -> PrefillRequest:
    return PrefillRequest(f"req-{i}", "gw-1", [1, 2, 3], SamplingParams(max_tokens=4), time.time())


def handoff(i: int) -> Handoff:
    return Handoff(f"req-{i}", "gw-1", [1, 2, 3], [4], ["b0"], None, SamplingParams(max_tokens=4),
                   time.time(), time.time())


async def read_all(client: aioredis.Redis, stream: str, group: str, consumer: str = "c1") -> list[tuple[bytes, dict]]:
    """Every entry the group delivers, in order."""
    out: list[tuple[bytes, dict]] = []
    while reply := await client.xreadgroup(group, consumer, {stream: ">"}, count=5_000):
        out += reply[0][1]
    return out


def request_ids(entries: list[tuple[bytes, dict]]) -> list[str]:
    return [protocol.decode(fields[PAYLOAD_FIELD]).request_id for _, fields in entries]


async def test_a_prefill_backlog_past_the_old_cap_is_delivered_whole(client):
    # 12k queued prompts: the oldest ~2k were deleted unread (other users' requests vanished and
    # waited out the event timeout holding their budget).
    await ensure_group(client, PREFILL_STREAM, PREFILL_GROUP)
    backend = RedisBackend(client)
    for start in range(0, BACKLOG, BATCH):
        await backend.send_prefill([prefill_request(i) for i in range(start, start + BATCH)])
    assert await client.xlen(PREFILL_STREAM) == BACKLOG
    assert request_ids(await read_all(client, PREFILL_STREAM, PREFILL_GROUP)) == [f"req-{i}" for i in range(BACKLOG)]


async def test_a_decode_backlog_past_the_old_cap_is_delivered_whole(client):
    await ensure_group(client, DECODE_STREAM, DECODE_GROUP)
    for start in range(0, BACKLOG, BATCH):
        await write_effects(client, Effects(handoffs=[handoff(i) for i in range(start, start + BATCH)]),
                            PREFILL_STREAM, PREFILL_GROUP)
    assert request_ids(await read_all(client, DECODE_STREAM, DECODE_GROUP)) == [f"req-{i}" for i in range(BACKLOG)]


async def add_raw(client: aioredis.Redis, stream: str, names: range) -> None:
    pipe = client.pipeline(transaction=False)
    for i in names:
        pipe.xadd(stream, {PAYLOAD_FIELD: f"req-{i}".encode()})
    await pipe.execute()


def payloads(entries: list[tuple[bytes, dict]]) -> list[str]:
    return [fields[PAYLOAD_FIELD].decode() for _, fields in entries]


async def test_only_what_every_group_acknowledged_is_trimmed(client):
    await ensure_group(client, PREFILL_STREAM, PREFILL_GROUP)
    await add_raw(client, PREFILL_STREAM, range(6_000))
    delivered = await read_all(client, PREFILL_STREAM, PREFILL_GROUP)
    # acked: all but 100 in the middle (a slow request holds its entry); then 500 not yet delivered
    held = [message_id for message_id, _ in delivered[3_000:3_100]]
    await client.xack(PREFILL_STREAM, PREFILL_GROUP, *(m for m, _ in delivered[:3_000] + delivered[3_100:]))
    await add_raw(client, PREFILL_STREAM, range(6_000, 6_500))

    # another group that has read nothing (an operator's tap) pins everything
    await client.xgroup_create(PREFILL_STREAM, "tap", id="0")
    assert await trim_acknowledged(client, PREFILL_STREAM) == 0
    await client.xgroup_destroy(PREFILL_STREAM, "tap")

    assert await trim_acknowledged(client, PREFILL_STREAM) == 3_000  # everything below the held entries
    assert await client.xlen(PREFILL_STREAM) == 6_500 - 3_000
    # the held entries are intact (a peer can still claim them) and the new ones are delivered
    claimed = await client.xclaim(PREFILL_STREAM, PREFILL_GROUP, "c2", 0, held)
    assert payloads(claimed) == [f"req-{i}" for i in range(3_000, 3_100)]
    [info] = await client.xinfo_groups(PREFILL_STREAM)
    assert info["lag"] == 500  # the dashboard's backlog stays exact (XDEL would have made it unknown)
    fresh = await read_all(client, PREFILL_STREAM, PREFILL_GROUP)
    assert payloads(fresh) == [f"req-{i}" for i in range(6_000, 6_500)]

    await client.xack(PREFILL_STREAM, PREFILL_GROUP, *held, *(message_id for message_id, _ in fresh))
    await trim_acknowledged(client, PREFILL_STREAM)
    assert await client.xlen(PREFILL_STREAM) == 0  # all done: nothing left


async def test_a_stream_without_a_group_is_not_trimmed(client):
    await RedisBackend(client).send_prefill([prefill_request(i) for i in range(10)])
    assert await trim_acknowledged(client, PREFILL_STREAM) == 0
    assert await trim_acknowledged(client, "{baton}:no-such-stream") == 0
    assert await client.xlen(PREFILL_STREAM) == 10


async def test_cancels_are_trimmed_by_age_not_by_count(client):
    backend = RedisBackend(client)
    now_ms = int(time.time() * 1000)
    await client.xadd(CANCEL_STREAM, {PAYLOAD_FIELD: b"old"}, id=f"{now_ms - (CANCEL_RETENTION_S + 60) * 1000}-0")
    await client.xadd(CANCEL_STREAM, {PAYLOAD_FIELD: b"recent"}, id=f"{now_ms - 60_000}-0")
    for start in range(0, BACKLOG, BATCH):
        await backend.send_cancels([Cancel(f"req-{i}", "gw-1") for i in range(start, start + BATCH)])
    entries = await client.xrange(CANCEL_STREAM)
    assert entries[0][1][PAYLOAD_FIELD] == b"recent"  # older than the retention: gone
    assert [protocol.decode(f[PAYLOAD_FIELD], Cancel).request_id for _, f in entries[1:]] == \
        [f"req-{i}" for i in range(BACKLOG)]


async def test_a_worker_trims_what_it_acknowledged(tiny_model_dir, redis_url, client, one_torch_thread):
    """The prefill worker's own loop: prompts done leave the stream; its handoffs wait for decode."""
    from prefill_worker.worker import PrefillWorker
    from tests.test_worker_shell import worker_args

    worker = PrefillWorker.from_args(worker_args(tiny_model_dir, redis_url), registry=CollectorRegistry())
    try:
        await ensure_group(worker.redis, worker.stream, worker.group)
        await ensure_group(client, DECODE_STREAM, DECODE_GROUP)
        gateway_id = "gw-live"
        await protocol.create_token_stream(client, gateway_id, 60)
        await RedisBackend(client).send_prefill([
            PrefillRequest(f"req-{i}", gateway_id, list(range(300, 320 + i)), SamplingParams(temperature=0, max_tokens=4),
                           time.time()) for i in range(3)])
        deadline = time.monotonic() + 60
        while await client.xlen(DECODE_STREAM) < 3 and time.monotonic() < deadline:
            await worker.iteration(accept_new=True)
        assert await client.xlen(DECODE_STREAM) == 3
        worker.last_claim = 0.0  # its once-a-second turn, now
        await worker.iteration(accept_new=True)
        assert await client.xlen(PREFILL_STREAM) == 0  # all three done: gone
        assert (await client.xpending(PREFILL_STREAM, PREFILL_GROUP))["pending"] == 0
        assert await client.xlen(DECODE_STREAM) == 3  # not read by any decode worker: kept
    finally:
        await worker.redis.aclose()
