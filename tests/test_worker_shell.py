"""A worker's I/O shell in-process, against the private Redis, when Redis fails under it."""

from __future__ import annotations

import argparse
import asyncio
import time

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.exceptions import ConnectionError as RedisConnectionError

from baton.common import heartbeats, protocol
from baton.common.sampling_params import SamplingParams
from baton.worker.args import add_common_args
from baton.worker.config import WorkerConfig
from baton.worker.runtime import ensure_group
from prefill_worker.worker import PrefillWorker

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def worker_args(model_dir, redis_url: str, *extra: str) -> WorkerConfig:
    parser = argparse.ArgumentParser()
    add_common_args(parser, "prefill")
    return WorkerConfig.from_args(parser.parse_args(
        ["--model", str(model_dir), "--redis-url", redis_url, "--dtype", "float32", "--threads", "1",
         "--num-kv-blocks", "64", "--worker-id", f"prefill-{time.time_ns()}", *extra]))


def fail_transactions(client, count: int) -> list[int]:
    """The next `count` MULTI/EXEC executes of `client` fail as a dropped connection would."""
    left = [count]
    real_pipeline = client.pipeline

    def pipeline(*args, **kwargs):
        pipe = real_pipeline(*args, **kwargs)
        real_execute = pipe.execute

        async def execute(*a, **k):
            if pipe.is_transaction and left[0] > 0:
                left[0] -= 1
                await pipe.reset()
                raise RedisConnectionError("connection reset by peer")
            return await real_execute(*a, **k)

        pipe.execute = execute
        return pipe

    client.pipeline = pipeline
    return left


async def test_a_failed_prefill_write_is_retried_and_nothing_is_lost(tiny_model_dir, redis_url):
    # Issue 11 (2c): the step's state changed before the MULTI/EXEC; one failed execute() lost the
    # first token and the handoff, and the prompt stayed pending under a live consumer forever.
    client = aioredis.from_url(redis_url)
    await client.flushall()
    worker = PrefillWorker.from_args(worker_args(tiny_model_dir, redis_url), registry=CollectorRegistry())
    try:
        await ensure_group(worker.redis, worker.stream, worker.group)
        gateway_id = f"gw-{time.time_ns()}"
        await protocol.create_token_stream(client, gateway_id, 60)
        request = protocol.PrefillRequest("req-1", gateway_id, list(range(300, 340)),
                                          SamplingParams(temperature=0, max_tokens=8), time.time())
        await client.xadd(protocol.PREFILL_STREAM, {protocol.PAYLOAD_FIELD: protocol.encode(request)})
        left = fail_transactions(worker.redis, 2)
        for _ in range(20):
            await worker.iteration(accept_new=True)
            if await client.xlen(protocol.DECODE_STREAM):
                break
        assert left == [0], "the failures happened"
        [(_, fields)] = await client.xrange(protocol.DECODE_STREAM)
        handoff = protocol.decode(fields[protocol.PAYLOAD_FIELD], protocol.Handoff)
        assert handoff.request_id == "req-1" and len(handoff.output_token_ids) == 1
        entries = await client.xrange(protocol.token_stream(gateway_id))
        events = [e for _, f in entries for e in protocol.decode(f[protocol.PAYLOAD_FIELD]).events]
        assert [(e.index, e.token_ids) for e in events] == [(0, handoff.output_token_ids)]  # once, not lost
        assert (await client.xpending(protocol.PREFILL_STREAM, protocol.PREFILL_GROUP))["pending"] == 0
        assert worker.engine.stats().num_kv_blocks_used == 0
    finally:
        await worker.redis.aclose()
        await client.aclose()


async def test_a_dead_gateways_backlog_is_not_prefilled(tiny_model_dir, redis_url):
    # Issue 11 (2h): the prefill worker prefilled the whole backlog of a gateway that had died.
    client = aioredis.from_url(redis_url)
    await client.flushall()
    worker = PrefillWorker.from_args(worker_args(tiny_model_dir, redis_url, "--gateway-grace", "2"), registry=CollectorRegistry())
    try:
        await ensure_group(worker.redis, worker.stream, worker.group)
        live = f"gw-{time.time_ns()}"
        pipe = client.pipeline(transaction=False)
        heartbeats.queue_beat(pipe, "gateway", live, {"worker_id": live}, 60)
        await pipe.execute()
        await protocol.create_token_stream(client, live, 60)
        for request_id, gateway_id in (("orphan", "gw-dead"), ("kept", live)):
            request = protocol.PrefillRequest(request_id, gateway_id, list(range(300, 340)),
                                              SamplingParams(temperature=0, max_tokens=8), time.time())
            await client.xadd(protocol.PREFILL_STREAM, {protocol.PAYLOAD_FIELD: protocol.encode(request)})
        await asyncio.sleep(2.2)  # longer than the grace: "gw-dead" has had no heartbeat all along
        for _ in range(20):
            await worker.iteration(accept_new=True)
            if await client.xlen(protocol.DECODE_STREAM):
                break
        handoffs = [protocol.decode(f[protocol.PAYLOAD_FIELD]) for _, f in await client.xrange(protocol.DECODE_STREAM)]
        assert [h.request_id for h in handoffs] == ["kept"]
        assert worker.engine.num_generated_tokens == 1  # the orphan was never computed
        assert (await client.xpending(protocol.PREFILL_STREAM, protocol.PREFILL_GROUP))["pending"] == 0
        assert not await client.exists(protocol.token_stream("gw-dead"))
    finally:
        await worker.redis.aclose()
        await client.aclose()
