"""The HTTP layer over the in-memory backend: real routes, validation, tokenizer, admission, router,
lifecycle and response formatting, with no Redis server and no worker. `InMemoryBackend` records
what the gateway sent and answers prefills as a worker would (first token alone, then the rest);
these tests check what a client sees (text, usage, stream events, status codes) and that every
exit path gives the budget back and cancels what the workers would still be running.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from baton.common.finish_reason import FinishReason
from baton.common.protocol import PrefillRequest, TokenEvent
from gateway.app import create_app, in_memory_runtime
from gateway.backend import InMemoryBackend
from gateway.config import Settings
from gateway.lifecycle import ALLOWED, IllegalTransition, State, transition
from gateway.services import Services

REPLY = "Hello there, wide world."


class Gateway:
    """An app on the in-memory backend, and a client for it."""

    def __init__(self, app: Any, client: httpx.AsyncClient, backend: InMemoryBackend, reply_ids: list[int]) -> None:
        self.app = app
        self.client = client
        self.backend = backend
        self.reply_ids = reply_ids

    @property
    def svc(self) -> Services:
        return self.app.state.services

    async def budget_released(self, timeout: float = 5.0) -> bool:
        """Whether the token budget goes back to nothing in use, nothing waiting (admission applies
        `done` in its own task, so give it a few turns)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            snap = self.svc.admission.snapshot()
            if snap["token_budget"]["in_use"] == 0 and snap["requests"] == {"running": 0, "waiting": 0}:
                return True
            await asyncio.sleep(0.01)
        return False


def worker_reply(reply_ids: list[int]) -> Any:
    """A worker's answer to each prefill: the reply cut at max_tokens, first token alone."""

    def respond(req: PrefillRequest) -> Sequence[TokenEvent]:
        ids = reply_ids[:req.sampling.max_tokens]
        finish = FinishReason.STOP if len(ids) == len(reply_ids) else FinishReason.LENGTH
        n = len(req.prompt_token_ids)
        return [TokenEvent(req.request_id, 0, ids[:1], [-0.5], None if len(ids) > 1 else finish, num_prompt_tokens=n),
                *([TokenEvent(req.request_id, 1, ids[1:], [-0.5] * (len(ids) - 1), finish, num_prompt_tokens=n)]
                  if len(ids) > 1 else [])]

    return respond


@pytest.fixture
async def gw(default_model_dir: Path, gw_tokenizer: Any) -> AsyncIterator[Gateway]:
    reply_ids = gw_tokenizer.encode_text(REPLY, add_special_tokens=False) + [gw_tokenizer.eos_token_id]
    backend = InMemoryBackend(worker_reply(reply_ids))
    settings = Settings(model_dir=default_model_dir, max_batch_total_tokens=100_000, event_timeout=10.0)
    app = create_app(settings, tokenizer=gw_tokenizer, runtime=in_memory_runtime(backend))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            yield Gateway(app, client, backend, reply_ids)


async def test_a_completion_answers_the_workers_text_and_usage(gw: Gateway) -> None:
    r = await gw.client.post("/v1/completions", json={"prompt": "Say hello", "max_tokens": 50})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == REPLY and body["choices"][0]["finish_reason"] == "stop"
    [sent] = gw.backend.prefills
    assert body["usage"]["prompt_tokens"] == len(sent.prompt_token_ids) > 0
    assert body["usage"]["completion_tokens"] == len(gw.reply_ids)
    assert sent.sampling.max_tokens == 50
    assert await gw.budget_released()
    assert gw.backend.cancels == []  # the worker ended it itself: nothing to cancel


async def test_a_tgi_stream_sends_each_token_then_the_generated_text(gw: Gateway) -> None:
    r = await gw.client.post("/generate_stream", json={"inputs": "Say hello",
                                                       "parameters": {"max_new_tokens": 50, "details": True}})
    assert r.status_code == 200, r.text
    events = [json.loads(line[len("data:"):]) for line in r.text.splitlines() if line.startswith("data:")]
    assert [e["index"] for e in events] == list(range(1, len(gw.reply_ids) + 1))
    assert "".join(e["token"]["text"] for e in events if not e["token"]["special"]) == REPLY
    assert events[-1]["generated_text"] == REPLY
    assert events[-1]["details"]["finish_reason"] == "eos_token" and events[-1]["details"]["seed"] is None
    assert await gw.budget_released()


async def test_bad_input_is_a_4xx_and_reaches_no_worker(gw: Gateway) -> None:
    r = await gw.client.post("/v1/completions", json={"prompt": "Hi", "temperature": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    r = await gw.client.post("/generate", json={"parameters": {}})
    assert r.status_code == 422 and "`inputs` is required" in r.json()["error"], r.text
    assert gw.backend.prefills == [] and await gw.budget_released()


async def test_a_stop_sequence_ends_the_answer_and_cancels_the_workers(gw: Gateway) -> None:
    r = await gw.client.post("/v1/completions", json={"prompt": "Say hello", "max_tokens": 50, "stop": ["wide"]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "Hello there, " and r.json()["choices"][0]["finish_reason"] == "stop"
    [sent] = gw.backend.prefills
    await gw.backend.wait_for(lambda: len(gw.backend.cancels) == 1)  # written on the next loop turn
    assert (gw.backend.cancels[0].request_id, gw.backend.cancels[0].reason) == (sent.request_id, "stop sequence")
    assert await gw.budget_released()


async def test_n_choices_share_a_prompt_and_draw_with_consecutive_seeds(gw: Gateway) -> None:
    r = await gw.client.post("/v1/completions", json={"prompt": "Say hello", "max_tokens": 50, "n": 3, "seed": 41})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2] and all(c["text"] == REPLY for c in choices)
    assert sorted(p.sampling.seed for p in gw.backend.prefills) == [41, 42, 43]
    # a prompt counts once, whatever its number of choices
    assert r.json()["usage"]["prompt_tokens"] == len(gw.backend.prefills[0].prompt_token_ids)
    assert await gw.budget_released()


async def test_an_unreachable_backend_is_a_503_and_holds_nothing(gw: Gateway) -> None:
    gw.backend.down = ConnectionError("connection refused")
    r = await gw.client.post("/v1/completions", json={"prompt": "Say hello", "max_tokens": 5})
    assert r.status_code == 503 and "connection refused" in r.json()["error"]["message"], r.text
    assert await gw.budget_released()
    assert not gw.svc.cluster.redis_ok  # refused at once from now on, until the health probe says otherwise


async def test_a_client_leaving_a_stream_releases_its_budget_and_cancels_the_workers(gw: Gateway) -> None:
    gw.backend.responder = None  # a worker that answers only what the test pushes
    leave = asyncio.Event()
    sent: list[dict[str, Any]] = []
    task = asyncio.create_task(_call(gw.app, "/v1/completions", {"prompt": "Say hello", "max_tokens": 50,
                                                                 "stream": True}, leave, sent))
    await gw.backend.wait_for(lambda: len(gw.backend.prefills) == 1)
    rid = gw.backend.prefills[0].request_id
    gw.backend.push(TokenEvent(rid, 0, gw.reply_ids[:1], [-0.5], num_prompt_tokens=3))
    for _ in range(500):  # until the client got the first token's chunk
        if any(b'"text": "Hello"' in m.get("body", b"") for m in sent):
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError(f"no chunk with the first token: {sent}")
    leave.set()
    await asyncio.wait_for(task, 10)
    await gw.backend.wait_for(lambda: len(gw.backend.cancels) == 1)
    assert (gw.backend.cancels[0].request_id, gw.backend.cancels[0].reason) == (rid, "client disconnected")
    assert await gw.budget_released()
    assert gw.svc.router.active == 0  # its event queue is gone too


async def _call(app: Any, path: str, body: dict[str, Any], leave: asyncio.Event, sent: list[dict[str, Any]]) -> None:
    """One POST straight through ASGI, with a client that disconnects when `leave` is set."""
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)


def test_the_lifecycle_refuses_moves_outside_its_table() -> None:
    assert transition(State.SENT, State.STREAMING, "r") is State.STREAMING
    with pytest.raises(IllegalTransition):
        transition(State.CREATED, State.SENT, "r")  # nothing is sent before admission
    with pytest.raises(IllegalTransition):
        transition(State.FINISHED, State.STREAMING, "r")
    assert ALLOWED[State.CLOSED] == set()  # closed is final
    assert all(State.CLOSED in ALLOWED[s] for s in State if s is not State.CLOSED)  # close() works from anywhere
