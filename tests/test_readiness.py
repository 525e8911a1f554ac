"""Issue 13 (5, 6): readiness vs liveness, a worker whose loop is stuck, the client's x-request-id
on every response and in every process's log lines, JSON logs."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
import time

import httpx
import pytest
import redis
from prometheus_client import CollectorRegistry
from tests.test_gateway_support import private_db, start_gateway, wait_until

from baton.common import heartbeats, logs, protocol
from baton.cli.redis_server import free_port
from baton.common.sampling_params import SamplingParams


def beat(client: redis.Redis, kind: str, worker_id: str, **state: object) -> None:
    pipe = client.pipeline(transaction=False)
    heartbeats.queue_beat(pipe, kind, worker_id, {"worker_id": worker_id, "kind": kind, **state}, 5)
    pipe.execute()


def withdraw(client: redis.Redis, kind: str, worker_id: str) -> None:
    pipe = client.pipeline(transaction=False)
    heartbeats.queue_withdraw(pipe, kind, worker_id)
    pipe.execute()


def test_ready_only_with_a_live_prefill_and_decode_worker(default_model_dir, redis_url, gw_tokenizer):
    url = private_db(redis_url, 13)  # no other test's workers in this database
    client = redis.Redis.from_url(url)
    client.flushdb()
    server = start_gateway(default_model_dir, url, gw_tokenizer)
    try:
        r = httpx.get(server.url + "/ready")
        assert r.status_code == 503
        assert r.json()["missing"] == ["a live prefill worker", "a live decode worker"]
        assert httpx.get(server.url + "/health").status_code == 200  # healthy, just not ready
        assert httpx.get(server.url + "/live").json() == {"status": "ok"}
        beat(client, "prefill", "p1")
        assert wait_until(lambda: httpx.get(server.url + "/ready").json().get("missing") == ["a live decode worker"])
        beat(client, "decode", "d1", draining=True)  # finishing its work, taking none: not enough
        time.sleep(0.5)
        assert httpx.get(server.url + "/ready").status_code == 503
        beat(client, "decode", "d1", draining=False)
        assert wait_until(lambda: httpx.get(server.url + "/ready").status_code == 200)
        assert httpx.get(server.url + "/ready").json()["status"] == "ready"
        withdraw(client, "prefill", "p1")
        assert wait_until(lambda: httpx.get(server.url + "/ready").status_code == 503)
    finally:
        withdraw(client, "decode", "d1")
        server.stop()
        client.close()


def test_client_request_id_is_echoed_on_every_response_and_sent_to_the_workers(gw_server, gw_worker):
    r = httpx.post(gw_server.url + "/generate", json={"inputs": "hi"}, headers={"x-request-id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    assert gw_worker.requests[-1].client_request_id == "trace-42"
    assert gw_worker.requests[-1].request_id != "trace-42"  # the internal id stays Baton's own
    with httpx.stream("POST", gw_server.url + "/v1/completions", json={"prompt": "hi", "stream": True},
                      headers={"x-request-id": "trace-43"}) as stream:
        assert stream.headers["x-request-id"] == "trace-43"
    # Errors too: a validation error, an unknown route, an unknown model.
    for method, path, body in [("POST", "/v1/completions", {"prompt": "hi", "max_tokens": -1}),
                               ("GET", "/nope", None),
                               ("POST", "/v1/completions", {"prompt": "hi", "model": "other"})]:
        r = httpx.request(method, gw_server.url + path, json=body, headers={"x-request-id": "err-1"})
        assert r.status_code >= 400 and r.headers["x-request-id"] == "err-1", (path, r.status_code)
    # No id, or one that cannot go in a header or a log line as is: the gateway makes one up.
    for sent in [None, "has space", "x" * 129, "tab\there"]:
        headers = {"x-request-id": sent} if sent is not None else {}
        got = httpx.post(gw_server.url + "/generate", json={"inputs": "hi"}, headers=headers).headers["x-request-id"]
        assert got != sent and len(got) == 32 and got.isalnum()


def test_json_log_lines_name_the_clients_request_id():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.formatter("json"))
    handler.addFilter(logs.RequestIdFilter())
    logger = logging.getLogger("test.readiness.json")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        logs.remember("internal-1", "client-1")
        logger.info("request %s dropped", "internal-1", extra=logs.request_extra("internal-1"))
        logger.info("not about a request")
    finally:
        logger.removeHandler(handler)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "request internal-1 dropped" and first["level"] == "info"
    assert first["request_id"] == "internal-1" and first["client_request_id"] == "client-1"
    assert first["logger"] == "test.readiness.json" and first["time"].endswith("Z")
    assert "client_request_id" not in second


async def test_a_worker_whose_loop_is_stuck_fails_its_health_check(tiny_model_dir, redis_url, one_torch_thread):
    from tests.test_worker_shell import worker_args
    from prefill_worker.worker import PrefillWorker

    port = free_port()
    worker = PrefillWorker.from_args(worker_args(tiny_model_dir, redis_url, "--metrics-port", str(port), "--stall-timeout", "1"),
                           registry=CollectorRegistry())
    release = threading.Event()
    real_step = worker.engine.step

    def stuck_step(loaded=()):  # a step that never returns (until the test lets it)
        release.wait(30)
        return real_step(loaded)

    worker.engine.step = stuck_step
    health = f"http://127.0.0.1:{port}/health"
    task = asyncio.create_task(worker.run())
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            async def status() -> tuple[int, dict]:
                r = await http.get(health)
                return r.status_code, r.json()

            for _ in range(200):  # the idle loop turns: healthy
                try:
                    if (await status())[0] == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.5)
            assert (await status())[0] == 200  # idle for longer than the stall timeout is not stuck
            assert (await http.get(f"http://127.0.0.1:{port}/metrics")).status_code == 200
            gateway_id = f"gw-{time.time_ns()}"
            await protocol.create_token_stream(worker.redis, gateway_id, 60)
            request = protocol.PrefillRequest("stuck-1", gateway_id, list(range(300, 340)),
                                              SamplingParams(temperature=0, max_tokens=2), time.time())
            await worker.redis.xadd(protocol.PREFILL_STREAM, {protocol.PAYLOAD_FIELD: protocol.encode(request)})
            for _ in range(100):
                code, body = await status()
                if code == 503:
                    break
                await asyncio.sleep(0.1)
            assert code == 503 and body["error"].startswith("loop stuck for"), body
            assert (await http.get(f"http://127.0.0.1:{port}/metrics")).status_code == 200  # still answers
            release.set()
            for _ in range(100):
                if (await status())[0] == 200:
                    break
                await asyncio.sleep(0.1)
            assert (await status())[0] == 200
            worker.watch.draining = True  # as on SIGTERM
            code, body = await status()
            assert code == 503 and body["status"] == "draining"
            assert (await http.get(f"http://127.0.0.1:{port}/live")).status_code == 200  # not to be killed
            worker.watch.draining = False
    finally:
        release.set()
        worker.stopping.set()
        await asyncio.wait_for(task, 30)


@pytest.mark.usefixtures("one_torch_thread")
def test_the_clients_request_id_is_on_every_processs_log_lines(tiny_model_dir):
    from tests.cluster import Cluster

    json_debug = ("--log-format", "json", "--log-level", "DEBUG")
    with Cluster(tiny_model_dir, gateway_args=("--log-format", "json"), prefill_args=json_debug,
                 decode_args=json_debug) as cluster:
        r = httpx.post(cluster.base_url + "/v1/completions", headers={"x-request-id": "follow-me-7"},
                       json={"prompt": "hello there", "max_tokens": 4, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.headers["x-request-id"] == "follow-me-7"

        def lines(name: str) -> list[dict]:
            text = (cluster.log_dir / f"{name}-{cluster.port}.log").read_text()
            return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

        def tagged(name: str) -> list[dict]:
            return [line for line in lines(name) if line.get("client_request_id") == "follow-me-7"]

        assert wait_until(lambda: tagged("prefill-0") and tagged("decode-0") and tagged("gateway"), timeout=10)
        assert any("prefilling request" in line["message"] for line in tagged("prefill-0"))
        assert any("decoding request" in line["message"] for line in tagged("decode-0"))
        assert all(set(line) >= {"time", "level", "logger", "message"} for line in lines("gateway"))


def _gateway_process(model_dir, redis_url: str, *args: str):
    import os
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--model", str(model_dir), "--port", str(port), "--redis-url", redis_url,
         "--max-batch-total-tokens", "100000", *args],
        env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/live", timeout=1).status_code == 200
        except httpx.TransportError:
            return proc.poll() is not None

    assert wait_until(up, timeout=60) and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else ""
    return proc, url


@pytest.mark.parametrize("grace, finishes", [(None, True), ("1", False)])
def test_sigterm_lets_streams_in_flight_finish_within_the_shutdown_grace(default_model_dir, gw_redis_url,
                                                                           gw_worker, grace, finishes):
    # Issue 13 (5): the gateway's graceful shutdown was 5 s, shorter than a worker's drain, and cut
    # streams a draining worker was still finishing.
    import signal

    gw_worker.set_reply(" ".join(["word"] * 24))
    gw_worker.delay = 0.3  # ~7 s of tokens: longer than the old 5 s
    proc, url = _gateway_process(default_model_dir, gw_redis_url, *(["--shutdown-grace", grace] if grace else []))
    events: list[str] = []
    try:
        with httpx.stream("POST", url + "/generate_stream", json={"inputs": "hi", "parameters": {"max_new_tokens": 100}},
                          timeout=30) as stream:
            for line in stream.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
                    if len(events) == 2:
                        proc.send_signal(signal.SIGTERM)  # mid-stream
    except httpx.HTTPError:
        pass  # the connection cut mid-stream: what a too short grace does
    finally:
        if len(events) < 2:  # never got to the signal: do not leave the process behind
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)  # it stops on its own once its streams are done (or cut)
    last = json.loads(events[-1][5:])
    if finishes:
        assert last["generated_text"] == " ".join(["word"] * 24).strip() and len(events) == 25, (len(events), events[-1])
    else:
        assert len(events) < 25 and last.get("generated_text") is None, (len(events), events[-1])


def test_probe_requests_leave_no_access_log_line_and_the_others_do():
    """`baton serve` polls /ready twice a second while the workers load: those lines (and probes'
    and scrapes' for ever after) would bury the workers' progress lines; a request's line stays."""
    import logging.config

    logging.config.dictConfig(logs.uvicorn_log_config("info"))
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    access = logging.getLogger("uvicorn.access")
    access.addHandler(handler)
    try:
        for path in ("/ready", "/health?x=1", "/metrics", "/v1/completions", "/generate"):
            access.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", path, "1.1", 200)
    finally:
        access.removeHandler(handler)
        access.filters.clear()
    assert [line.split('"')[1] for line in seen] == ["GET /v1/completions HTTP/1.1", "GET /generate HTTP/1.1"]
