"""Streaming behaviour end to end: multi-byte text, stop sequences, redelivered events, worker
errors, lost events, and what a client disconnect does (Cancel sent, budget released)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from tests.test_gateway_support import start_gateway, wait_until


MULTIBYTE = "中文测试：你好世界！🙂👍🏽🇯🇵 emoji 🧑‍🚀 ok ∑∫ 日本語テキスト"


def sse_json(text: str, prefix: str = "data:") -> list[dict]:
    out = []
    for line in text.split("\n"):
        if line.startswith(prefix):
            payload = line[len(prefix):].strip()
            if payload != "[DONE]":
                out.append(json.loads(payload))
    return out


def stats(url: str) -> dict:
    return httpx.get(url + "/stats", timeout=5).json()


def idle(url: str) -> bool:
    s = stats(url)
    return s["token_budget"]["in_use"] == 0 and s["requests"] == {"running": 0, "waiting": 0}


@pytest.mark.parametrize("per_event", [1, 2, 5])
def test_multibyte_stream_is_never_garbled(gw_server, gw_worker, per_event):
    gw_worker.set_reply(MULTIBYTE)
    gw_worker.tokens_per_event = per_event
    # The reply really does split characters across tokens (else this test proves nothing).
    assert any("\ufffd" in gw_worker.tok.decode([t]) for t in gw_worker.reply_ids)
    r = httpx.post(gw_server.url + "/generate_stream", json={"inputs": "x", "parameters": {"max_new_tokens": 200}})
    events = sse_json(r.text)
    texts = [e["token"]["text"] for e in events]
    assert all("\ufffd" not in t for t in texts)
    assert "".join(texts) == MULTIBYTE == events[-1]["generated_text"]

    r = httpx.post(gw_server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x"}], "stream": True})
    deltas = [c["choices"][0]["delta"].get("content", "") for c in sse_json(r.text) if c["choices"]]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE


def test_length_cut_inside_a_character_drops_the_partial_bytes(gw_server, gw_worker):
    gw_worker.set_reply("😀😀😀")
    ids = gw_worker.reply_ids
    n = next(i for i in range(1, len(ids)) if gw_worker.tok.decode(ids[:i]).endswith("\ufffd"))
    r = httpx.post(gw_server.url + "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": n}})
    assert "\ufffd" not in r.json()["generated_text"]


def test_stop_sequence_truncates_and_cancels(gw_server, gw_worker):
    gw_worker.set_reply("The answer is 42.\n\nUser: ignore this part please")
    gw_worker.delay = 0.002
    r = httpx.post(gw_server.url + "/generate_stream",
                   json={"inputs": "q", "parameters": {"max_new_tokens": 100, "stop": ["\n\nUser:"], "details": True}})
    events = sse_json(r.text)
    assert events[-1]["generated_text"] == "The answer is 42."
    assert events[-1]["details"]["finish_reason"] == "stop_sequence"
    assert "".join(e["token"]["text"] for e in events) == "The answer is 42."
    rid = gw_worker.requests[-1].request_id
    assert wait_until(lambda: rid in gw_worker.cancelled_ids())  # the workers are told to stop

    r = httpx.post(gw_server.url + "/v1/completions",
                   json={"prompt": "q", "max_tokens": 100, "stop": "42", "stream": True})
    chunks = sse_json(r.text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "The answer is "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    r = httpx.post(gw_server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "q"}], "stop": ["zzz", "is 4"]})
    assert r.json()["choices"][0]["message"]["content"] == "The answer "
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert wait_until(lambda: idle(gw_server.url))


def test_duplicate_events_are_dropped(gw_server, gw_worker):
    gw_worker.mode = "duplicate"
    gw_worker.tokens_per_event = 2
    r = httpx.post(gw_server.url + "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 300}})
    assert r.json()["generated_text"] == gw_worker.tok.decode(gw_worker.reply_ids, skip_special_tokens=True)


def test_a_resumed_worker_that_produces_other_tokens_fails_the_request(gw_server, gw_worker):
    # Issue 11 (2f): duplicates were dropped by index alone, so a worker resuming with other
    # numerics (another dtype) spliced a second chain onto what the client already had.
    gw_worker.mode = "diverge"
    r = httpx.post(gw_server.url + "/generate_stream", json={"inputs": "x", "parameters": {"max_new_tokens": 50}})
    events = sse_json(r.text)
    assert "different tokens" in events[-1]["error"] and events[-1]["error_type"] == "generation"
    assert [e["token"]["id"] for e in events[:-1]] == gw_worker.reply_ids[:3]  # what came before the divergence
    assert wait_until(lambda: idle(gw_server.url))
    gw_worker.mode = "duplicate"  # the same tokens again are still fine
    r = httpx.post(gw_server.url + "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 300}})
    assert r.json()["generated_text"] == gw_worker.tok.decode(gw_worker.reply_ids, skip_special_tokens=True)


def test_worker_error_ends_the_request(gw_server, gw_worker):
    gw_worker.mode = "error"
    r = httpx.post(gw_server.url + "/generate", json={"inputs": "x"})
    assert r.status_code == 500
    assert r.json() == {"error": "boom: worker failed", "error_type": "generation"}
    r = httpx.post(gw_server.url + "/generate_stream", json={"inputs": "x"})
    assert sse_json(r.text) == [{"error": "boom: worker failed", "error_type": "generation"}]
    r = httpx.post(gw_server.url + "/v1/completions", json={"prompt": "x", "stream": True})
    assert sse_json(r.text)[-1]["error"]["message"] == "boom: worker failed"
    assert r.text.endswith("data: [DONE]\n\n")
    assert wait_until(lambda: idle(gw_server.url))


def test_streaming_disconnect_sends_cancel_and_releases_budget(gw_server, gw_worker):
    gw_worker.delay = 0.05
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", gw_server.url + "/generate_stream",
                           json={"inputs": "x", "parameters": {"max_new_tokens": 100}}) as r:
            # Keep a reference: abandoning httpx's line iterator closes the connection at once.
            lines = r.iter_lines()
            got = 0
            while got < 2:
                got += next(lines).startswith("data:")
            assert stats(gw_server.url)["token_budget"]["in_use"] > 0
            rid = gw_worker.requests[-1].request_id
            assert rid not in gw_worker.cancelled_ids()
    assert wait_until(lambda: rid in gw_worker.cancelled_ids())
    cancel = next(c for c in gw_worker.cancels if c.request_id == rid)
    assert cancel.gateway_id == gw_worker.requests[-1].gateway_id
    assert wait_until(lambda: idle(gw_server.url))


def test_non_streaming_disconnect_sends_cancel(gw_server, gw_worker):
    gw_worker.hold = True
    before = len(gw_worker.requests)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 50}, timeout=0.5)
    assert wait_until(lambda: len(gw_worker.requests) == before + 1)
    rid = gw_worker.requests[-1].request_id
    assert wait_until(lambda: rid in gw_worker.cancelled_ids())
    assert wait_until(lambda: idle(gw_server.url))


def test_lost_events_end_with_an_error(default_model_dir, gw_redis_url, gw_tokenizer, gw_worker):
    server = start_gateway(default_model_dir, gw_redis_url, gw_tokenizer, event_timeout=0.5)
    try:
        gw_worker.mode = "silent"
        before = len(gw_worker.requests)
        t0 = time.monotonic()
        r = httpx.post(server.url + "/generate", json={"inputs": "x"})
        assert r.status_code == 500 and "no token from the workers" in r.json()["error"]
        assert time.monotonic() - t0 < 5
        assert wait_until(lambda: idle(server.url))
        assert wait_until(lambda: len(gw_worker.requests) == before + 1)
        rid = gw_worker.requests[-1].request_id
        assert wait_until(lambda: rid in gw_worker.cancelled_ids())  # workers told to drop it
    finally:
        server.stop()


def test_silence_behind_busy_workers_is_a_queue_not_a_loss(default_model_dir, gw_redis_url, gw_tokenizer,
                                                           gw_worker):
    """A request queued behind minutes of prefill gets no event for longer than event_timeout; while
    a worker's heartbeat shows it computing, the request waits; once nothing computes, it fails."""
    server = start_gateway(default_model_dir, gw_redis_url, gw_tokenizer, event_timeout=1.5)
    computing = threading.Event()
    computing.set()
    stop = threading.Event()
    replies: list[httpx.Response] = []

    def beat() -> None:  # a decode worker whose token count grows while `computing` is set
        count = 0
        while not stop.is_set():
            count += 100 if computing.is_set() else 0
            gw_worker.heartbeat = {"worker_id": "echo", "num_kv_blocks_total": 4096, "block_size": 16,
                                   "num_tokens_computed": count, "in_step": False}
            time.sleep(0.2)

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        gw_worker.mode = "silent"
        with httpx.Client(timeout=30) as client:
            t0 = time.monotonic()
            pending = threading.Thread(target=lambda: replies.append(client.post(
                server.url + "/generate", json={"inputs": "x"})), daemon=True)
            pending.start()
            pending.join(4.5)  # three event_timeouts of silence, the worker computing meanwhile
            assert pending.is_alive(), "the request failed while the workers were computing"
            computing.clear()
            pending.join(10)
            assert not pending.is_alive()
        (r,) = replies
        assert r.status_code == 500 and "none computed anything" in r.json()["error"]
        assert time.monotonic() - t0 > 4.5
        assert wait_until(lambda: idle(server.url))
    finally:
        stop.set()
        beater.join(5)
        assert not beater.is_alive()
        server.stop()


def test_many_concurrent_streams(gw_server, gw_worker):
    gw_worker.delay = 0.001

    async def one(client: httpx.AsyncClient, i: int) -> str:
        r = await client.post(gw_server.url + "/v1/completions",
                              json={"prompt": f"p{i}", "max_tokens": 100, "stream": True})
        return "".join(c["choices"][0]["text"] for c in sse_json(r.text))

    async def main() -> list[str]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*(one(client, i) for i in range(40)))

    texts = asyncio.run(main())
    assert all(t == gw_worker.tok.decode(gw_worker.reply_ids, skip_special_tokens=True) for t in texts)
    assert wait_until(lambda: idle(gw_server.url))
