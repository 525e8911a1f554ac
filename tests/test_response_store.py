"""Stored Responses are bounded and kept apart from the KV cache's eviction (issue 38, item 5):
a cap in bytes (the oldest dropped to make room; one larger than the cap answered with
`store: false`), expiry the gateway enforces itself, and no Redis TTL on them, so that under the
store's `volatile-lru` a flood of responses never evicts KV blocks and KV pressure never evicts a
response before its time."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from baton.cli.redis_server import start_private_redis
from gateway.errors import ApiError
from gateway.responses.store import INDEX, KEY_PREFIX, SIZES, USED, ResponseStore, response_key
from kvstore.redis_backend import RedisBlockStore, block_key
from tests.test_gateway_api import MODEL
from tests.test_gateway_support import start_gateway


async def clear_responses(client: aioredis.Redis) -> None:
    """Other modules' gateways store responses in the same session Redis: start from none."""
    keys = [key async for key in client.scan_iter(match=KEY_PREFIX + "*", count=1000)]
    await client.delete(INDEX, SIZES, USED, *keys)


@pytest.fixture
async def client(redis_url):
    client = aioredis.from_url(redis_url)
    await clear_responses(client)
    yield client
    await clear_responses(client)
    await client.aclose()


def response(i: int, text: str = "") -> dict:
    return {"id": f"resp_{i:032d}", "object": "response", "output_text": text}


async def record_size(store: ResponseStore, i: int, text: str) -> int:
    """The bytes one response is counted for (the JSON the store writes, plus its overhead)."""
    await store.save(response(i, text), [])
    size = int(await store.redis.hget(SIZES, response(i)["id"]))
    await store.delete(response(i)["id"])
    return size


async def test_the_oldest_are_dropped_past_the_cap(client):
    text = "x" * 1000
    size = await record_size(ResponseStore(client, 60, 1 << 20, 1), 999, text)
    store = ResponseStore(client, 60, 4 * size, 1)  # room for four
    for i in range(10):
        assert await store.save(response(i, text), [])
    for i in range(6):
        with pytest.raises(ApiError) as err:
            await store.load(response(i)["id"], "response_id")
        assert err.value.status == 404 and "--responses-max-bytes" in err.value.message
        assert not await client.exists(response_key(response(i)["id"]))  # its memory is freed too
    assert [(await store.load(response(i)["id"], "response_id"))["response"]["output_text"] for i in range(6, 10)] \
        == [text] * 4
    assert int(await client.get(USED)) == 4 * size


async def test_one_larger_than_the_cap_is_not_stored_and_nothing_is_dropped(client):
    store = ResponseStore(client, 60, 4096, 1)
    assert await store.save(response(1, "small"), [])
    assert not await store.save(response(2, "y" * 5000), [])
    assert not await client.exists(response_key(response(2)["id"]))
    assert (await store.load(response(1)["id"], "response_id"))["response"]["output_text"] == "small"


async def test_expired_responses_are_gone_and_swept(client):
    store = ResponseStore(client, 1, 1 << 20, 1)
    for i in range(3):
        await store.save(response(i, "soon gone"), [])
    assert (await store.load(response(0)["id"], "response_id"))["response"]["output_text"] == "soon gone"
    for key in (response_key(response(0)["id"]), INDEX, SIZES, USED):
        assert await client.ttl(key) == -1  # no Redis TTL: volatile-lru can never evict them
    await asyncio.sleep(1.1)
    with pytest.raises(ApiError) as err:
        await store.load(response(0)["id"], "response_id")
    assert err.value.status == 404
    assert not await store.delete(response(1)["id"])  # expired: as if it was never there
    assert await store.sweep() == 1  # the third, never touched again
    assert not [key async for key in client.scan_iter(match=KEY_PREFIX + "*")]
    assert int(await client.get(USED)) == 0 and not await client.zcard(INDEX) and not await client.hlen(SIZES)


async def test_gateways_sharing_a_redis_keep_one_exact_count(client, redis_url):
    other = aioredis.from_url(redis_url)
    try:
        size = await record_size(ResponseStore(client, 60, 1 << 20, 1), 999, "z" * 500)
        stores = [ResponseStore(c, 60, 20 * size, 1) for c in (client, other)]
        await asyncio.gather(*(stores[i % 2].save(response(i, "z" * 500), []) for i in range(200)))
        ids = await client.zrange(INDEX, 0, -1)
        sizes = await client.hgetall(SIZES)
        assert len(ids) == 20 and set(ids) == set(sizes)
        assert int(await client.get(USED)) == sum(int(v) for v in sizes.values()) == 20 * size
        assert len([key async for key in client.scan_iter(match=KEY_PREFIX + "*")]) == 20
    finally:
        await other.aclose()


async def test_responses_and_kv_blocks_do_not_evict_each_other():
    # A private Redis with a small maxmemory under the store's policy (volatile-lru). Before: each
    # response had a 1-hour TTL, so a flood of responses evicted the prefix cache's blocks, and a
    # flood of blocks evicted stored responses long before their hour.
    server = start_private_redis(maxmemory="24mb")
    client = aioredis.from_url(server.url)
    try:
        blocks = RedisBlockStore(client)
        block = b"\1" * (64 << 10)

        async def put_blocks(names: range) -> None:
            pipe = client.pipeline(transaction=False)
            blocks.queue_writes(pipe, [(f"blk-{n}", block) for n in names], [], [])
            await pipe.execute()

        await put_blocks(range(64))  # 4 MiB of prefix cache
        store = ResponseStore(client, 3600, 4 << 20, 1)
        for i in range(300):  # 30 MB of responses, more than the whole maxmemory
            await store.save(response(i, "r" * 100_000), [])
        assert await client.exists(*(block_key(f"blk-{n}") for n in range(64))) == 64, "a response evicted a KV block"
        assert int(await client.get(USED)) <= 4 << 20

        kept = [i for i in range(300) if await client.exists(response_key(response(i)["id"]))]
        assert kept == list(range(300 - len(kept), 300)) and len(kept) >= 30  # the newest, within the cap
        for start in range(64, 64 + 800, 100):  # 50 MB of blocks: they evict each other
            await put_blocks(range(start, start + 100))
        assert (await client.info("stats"))["evicted_keys"] > 0
        for i in kept:
            assert (await store.load(response(i)["id"], "response_id"))["response"]["id"] == response(i)["id"]
    finally:
        await client.aclose()
        server.stop()


def test_the_flag_caps_what_a_gateway_stores(default_model_dir, gw_redis_url, gw_tokenizer, gw_echo_worker):
    """Through HTTP: the oldest answer is dropped for the newest; one larger than the cap is
    answered all the same, with `store: false`."""
    asyncio.run(_clear(gw_redis_url))
    server = start_gateway(default_model_dir, gw_redis_url, gw_tokenizer, max_queue_wait=5.0,
                           responses_max_bytes=6000, max_input_tokens=4096, max_total_tokens=8192)
    try:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        gw_echo_worker.set_reply("Noted.")
        first = c.responses.create(model=MODEL, input="a" * 1500)
        size = int(stored_size(gw_redis_url, first.id))
        assert 2 * size <= 6000 < 3 * size  # room for two
        second = c.responses.create(model=MODEL, input="b" * 1500)
        assert c.responses.retrieve(first.id).output_text == "Noted."
        third = c.responses.create(model=MODEL, input="c" * 1500)  # no room for three: the first goes
        assert c.responses.retrieve(second.id).output_text == "Noted."
        with pytest.raises(openai.NotFoundError) as err:
            c.responses.retrieve(first.id)
        assert "--responses-max-bytes" in err.value.message
        assert c.responses.retrieve(third.id).store is True
        huge = c.responses.create(model=MODEL, input="d" * 7000)
        assert huge.output_text == "Noted." and huge.store is False
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(huge.id)
        events = [e for e in _stream_events(server.url, {"model": MODEL, "input": "e" * 7000})]
        assert events[-1]["type"] == "response.completed" and events[-1]["response"]["store"] is False
        assert c.responses.retrieve(third.id).id == third.id  # the too-large ones dropped nothing
    finally:
        server.stop()
        asyncio.run(_clear(gw_redis_url))


def stored_size(url: str, response_id: str) -> int:
    """The bytes a stored response is counted for (read off Redis)."""
    async def read() -> int:
        client = aioredis.from_url(url)
        try:
            return int(await client.hget(SIZES, response_id))
        finally:
            await client.aclose()
    return asyncio.run(read())


async def _clear(url: str) -> None:
    client = aioredis.from_url(url)
    await clear_responses(client)
    await client.aclose()


def _stream_events(url: str, body: dict) -> list[dict]:
    r = httpx.post(url + "/v1/responses", json={**body, "stream": True}, timeout=30)
    assert r.status_code == 200, r.text
    return [json.loads(frame.split("\n")[1].removeprefix("data: ")) for frame in r.text.strip().split("\n\n")]


def test_the_flag_reaches_the_gateway_from_baton_serve_and_its_variable(monkeypatch):
    from pathlib import Path

    from baton.cli.serve import ThreadPlan, build_child_specs
    from gateway.__main__ import parse_args
    from tests.test_cli import _serve_args, child_config

    monkeypatch.setattr("baton.common.model_files.resolve_model", lambda model: Path("/m"))
    monkeypatch.delenv("BATON_RESPONSES_MAX_BYTES", raising=False)
    specs = build_child_specs(_serve_args("--responses-max-bytes", "256MiB"), Path("/m"), "redis://127.0.0.1:1/0",
                              ThreadPlan([1], [1], cpus=2), python="py")
    assert child_config(specs[-1]).responses_max_bytes == 256 << 20
    assert parse_args([]).responses_max_bytes == 64 << 20
    monkeypatch.setenv("BATON_RESPONSES_MAX_BYTES", "1MB")
    assert parse_args([]).responses_max_bytes == 1_000_000
