"""Redis outage: generation answers 503 at once and /health says why; when Redis comes back the
token reader resumes by itself and requests succeed again."""

from __future__ import annotations

import time

import httpx
from tests.test_gateway_support import EchoWorker, start_gateway, wait_until

from baton.ops.redis_server import start_private_redis



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
