"""Redis outage: generation answers 503 at once and /health says why; when Redis comes back the
token reader resumes by itself and requests succeed again. Redis losing its data (a restart of the
private one, a flush) ends the requests in flight at once with a clear, retryable error."""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import httpx
from redis import Redis
from tests.test_gateway_support import EchoWorker, start_gateway, wait_until

from baton.cli.redis_server import start_private_redis
from baton.common.protocol import token_stream


def stats(url: str) -> dict[str, Any]:
    return httpx.get(url + "/stats", timeout=5).json()


def test_redis_outage_and_recovery(default_model_dir, gw_tokenizer):
    redis = start_private_redis()
    port = redis.port
    worker = EchoWorker(redis.url, gw_tokenizer.hf).start()
    server = start_gateway(default_model_dir, redis.url, gw_tokenizer, max_queue_wait=2.0)
    try:
        assert httpx.post(server.url + "/generate", json={"inputs": "x"}).status_code == 200
        worker.stop()
        redis.stop()

        t0 = time.monotonic()
        r = httpx.post(server.url + "/generate", json={"inputs": "x"})
        assert r.status_code == 503 and r.json()["error_type"] == "unavailable"
        assert "redis" in r.json()["error"]
        assert time.monotonic() - t0 < 3
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert r.headers["retry-after"] == "1"
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "unreachable" in health.json()["error"]
        assert httpx.get(server.url + "/metrics").status_code == 200  # still scrapeable
        assert httpx.get(server.url + "/ready").status_code == 503
        assert httpx.get(server.url + "/live").status_code == 200  # a restart would not bring Redis back

        redis = start_private_redis(port=port)
        worker = EchoWorker(redis.url, gw_tokenizer.hf).start()
        assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 200, timeout=10)
        assert wait_until(lambda: httpx.get(server.url + "/health").json()["token_reader"] == "ok", timeout=10)
        r = httpx.post(server.url + "/generate", json={"inputs": "x"})
        assert r.status_code == 200, r.text
        assert r.json()["generated_text"]
    finally:
        server.stop()
        worker.stop()
        redis.stop()


def test_redis_losing_its_data_ends_requests_in_flight_at_once(default_model_dir, gw_redis_url, gw_tokenizer,
                                                                gw_worker):
    # Issue 11: `baton serve` restarts its private Redis empty. A request mid-decode then ended
    # with "token stream gap: expected token 283, got 312", one not yet picked up only after
    # event_timeout (120 s). Deleting the gateway's token stream is the same data loss, seen from
    # the gateway (the key it made at startup is gone).
    gateway_id = "lost-" + uuid.uuid4().hex[:8]
    server = start_gateway(default_model_dir, gw_redis_url, gw_tokenizer, gateway_id=gateway_id)
    client = Redis.from_url(gw_redis_url)
    answers: dict[str, httpx.Response] = {}

    def post(name: str, path: str, body: dict[str, Any]) -> threading.Thread:
        thread = threading.Thread(target=lambda: answers.update({name: httpx.post(server.url + path, json=body,
                                                                                  timeout=10)}))
        thread.start()
        return thread

    try:
        gw_worker.delay = 0.02
        with httpx.stream("POST", server.url + "/generate_stream", timeout=10,
                          json={"inputs": "x", "parameters": {"max_new_tokens": 200}}) as stream:
            lines = (line for line in stream.iter_lines() if line.startswith("data:"))
            first = json.loads(next(lines)[5:])
            assert first["token"]["id"] == gw_worker.reply_ids[0]
            gw_worker.hold = True  # the rest of this one, and all of the next two, wait
            before = len(gw_worker.requests)
            threads = [post("tgi", "/generate", {"inputs": "y"}),
                       post("openai", "/v1/chat/completions", {"messages": [{"role": "user", "content": "y"}]})]
            assert wait_until(lambda: len(gw_worker.requests) == before + 2)
            assert stats(server.url)["requests"]["running"] == 3

            t0 = time.monotonic()
            assert client.delete(token_stream(gateway_id)) == 1
            events = [json.loads(line[5:]) for line in lines]
        for thread in threads:
            thread.join(timeout=10)
        assert time.monotonic() - t0 < 5  # about one heartbeat interval, not event_timeout

        assert "redis restarted" in events[-1]["error"] and "retry" in events[-1]["error"]
        assert events[-1]["error_type"] == "unavailable"
        assert all("token" in e for e in events[:-1])  # whatever was decoded before the loss
        tgi, openai = answers["tgi"], answers["openai"]
        assert tgi.status_code == 503 and tgi.json()["error_type"] == "unavailable", tgi.text
        assert "redis restarted" in tgi.json()["error"]
        assert openai.status_code == 503, openai.text
        assert openai.json()["error"]["type"] == "service_unavailable"
        assert "redis restarted" in openai.json()["error"]["message"]
        assert openai.headers["retry-after"] == "1" and openai.headers["x-request-id"]
        # The usual end of a request ran: budget and slots back, the workers told to drop them.
        assert wait_until(lambda: stats(server.url)["token_budget"]["in_use"] == 0, timeout=3)
        assert stats(server.url)["requests"] == {"running": 0, "waiting": 0}
        lost = {req.request_id for req in gw_worker.requests[before - 1:]}
        assert wait_until(lambda: lost <= gw_worker.cancelled_ids())
        assert client.exists(token_stream(gateway_id))  # made again, and read from its start:
        gw_worker.reset()
        r = httpx.post(server.url + "/generate", json={"inputs": "z"}, timeout=10)
        assert r.status_code == 200 and r.json()["generated_text"], r.text
    finally:
        gw_worker.reset()
        server.stop()
        client.close()


async def test_the_token_reader_survives_a_connection_closed_under_it(gw_redis_url):
    # uvloop reports a command sent on a connection Redis has just closed as RuntimeError ("the
    # handler is closed"); the token reader died of it after a Redis restart, and every later
    # request hung. It must be retried like any lost connection (and other RuntimeErrors still raise).
    import asyncio

    import redis.asyncio as aioredis

    from baton.common import protocol
    from gateway.router import TokenRouter

    client = aioredis.from_url(gw_redis_url)
    router = TokenRouter(client, "reader-" + uuid.uuid4().hex[:8])
    real_xread = client.xread
    failures = [RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")]

    async def xread(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return await real_xread(*args, **kwargs)

    client.xread = xread  # type: ignore[method-assign]
    queue = router.register("r1")
    task = asyncio.create_task(router.run())
    try:
        await client.xadd(router.stream, {protocol.PAYLOAD_FIELD: protocol.encode_token_batch(
            [protocol.TokenEvent("r1", 0, [7], [-0.1])])})
        event = await asyncio.wait_for(queue.get(), 10)
        assert event.token_ids == [7] and not task.done()
        failures.append(RuntimeError("something else"))
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)
        assert isinstance(task.exception(), RuntimeError)  # not swallowed
    finally:
        router.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.delete(router.stream)
        await client.aclose()
