"""Test support for the gateway tests (no tests here): a pytest plugin of fixtures named gw_*, a
real uvicorn server in a thread, and an "echo worker" test double that speaks the exact worker
protocol over real Redis.

The echo worker stands in for the prefill + decode workers: it reads `baton:prefill` in the
consumer group, publishes a fixed reply (tokenized with the model's tokenizer) to the requesting
gateway's token stream (first token in one event, as prefill does, the rest as decode does), stops
a request when a Cancel for it arrives on `baton:cancel`, and can write a decode heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError
import uvicorn

from baton.common import heartbeats
from baton.common.protocol import (
    CANCEL_STREAM,
    PAYLOAD_FIELD,
    PREFILL_GROUP,
    PREFILL_STREAM,
    STREAM_MAXLEN,
    Cancel,
    PrefillRequest,
    TokenEvent,
    decode,
    encode,
    pack_embedding,
    token_stream,
)

DEFAULT_REPLY = "Hello! 你好，世界 😀🎉 naïve café — the end."


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def private_db(url: str, db: int = 15) -> str:
    """Gateway tests use their own Redis database so no other test's workers see our streams."""
    return url.rsplit("/", 1)[0] + f"/{db}"


class ServerThread:
    """A real uvicorn (uvloop) server for an ASGI app, in a background thread."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, loop="uvloop",
                                log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name=f"gateway-{self.port}")

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        # A gateway that does not shut down promptly is a bug (a lost task cancellation once was).
        assert not self.thread.is_alive(), "the gateway did not shut down within 15 s"


class EchoWorker:
    """Worker test double. Knobs (set from tests between requests): reply_ids, delay, hold,
    tokens_per_event, mode ("normal" | "duplicate" | "diverge" | "error" | "silent"), logprob_of
    (a request's tokens' logprob, from its PrefillRequest), top_logprobs (alternatives sent per
    token when a request asks for logprobs)."""

    def __init__(self, redis_url: str, hf_tokenizer: Any) -> None:
        self.redis_url = redis_url
        self.tok = hf_tokenizer
        self.eos = hf_tokenizer.eos_token_id
        self.requests: list[PrefillRequest] = []
        self.cancels: list[Cancel] = []
        self.heartbeat: dict[str, Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._ready = threading.Event()
        self.reset()

    def reset(self) -> None:
        self.set_reply(DEFAULT_REPLY)
        self.delay = 0.0
        self.hold = False
        self.tokens_per_event = 1
        self.mode = "normal"
        self.heartbeat = None
        self.logprob_of: Any = None
        self.top_logprobs = 0

    def set_reply(self, text: str, eos: bool = True) -> None:
        self.reply_ids = list(self.tok(text, add_special_tokens=False)["input_ids"]) + ([self.eos] if eos else [])

    def cancelled_ids(self) -> set[str]:
        return {c.request_id for c in self.cancels}

    def start(self) -> EchoWorker:
        self._thread.start()
        assert self._ready.wait(10), "echo worker did not start"
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)
        # A worker left running would keep taking prefill requests meant for the next module's
        # worker, and answer them with its own (reset) reply.
        assert not self._thread.is_alive(), "echo worker did not stop"

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        r = aioredis.Redis.from_url(self.redis_url)
        try:
            await r.xgroup_create(PREFILL_STREAM, PREFILL_GROUP, id="$", mkstream=True)
        except Exception:
            await r.xgroup_setid(PREFILL_STREAM, PREFILL_GROUP, id="$")
        tasks = [asyncio.create_task(self._serve_prefill(r)), asyncio.create_task(self._listen_cancels(r)),
                 asyncio.create_task(self._heartbeats(r))]
        self._ready.set()
        await self._stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await r.aclose()

    async def _serve_prefill(self, r: aioredis.Redis) -> None:
        running: set[asyncio.Task] = set()
        while not self._stop.is_set():  # also ends if a cancellation is swallowed mid-read
            reply = await r.xreadgroup(PREFILL_GROUP, "echo", {PREFILL_STREAM: ">"}, count=64, block=100)
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    await r.xack(PREFILL_STREAM, PREFILL_GROUP, entry_id)
                    req = decode(fields[PAYLOAD_FIELD], PrefillRequest)
                    self.requests.append(req)
                    task = asyncio.create_task(self._generate(r, req))
                    running.add(task)
                    task.add_done_callback(running.discard)

    async def _generate(self, r: aioredis.Redis, req: PrefillRequest) -> None:
        # Redis going away under us (the outage test) ends the request silently, like a dead worker.
        with contextlib.suppress(Exception):
            await self._generate_tokens(r, req)

    async def _generate_tokens(self, r: aioredis.Redis, req: PrefillRequest) -> None:
        if self.mode == "silent":
            return
        stream = token_stream(req.gateway_id)
        ids = self.reply_ids[: req.sampling.max_tokens]
        finish = "stop" if len(ids) == len(self.reply_ids) else "length"
        if self.mode == "error":
            await self._publish(r, stream, TokenEvent(req.request_id, 0, [], [], "error", "boom: worker failed"))
            return
        if req.pooling:  # an embeddings batch: per input, an event with a vector its tokens determine
            for index, input_ids in enumerate(req.inputs):
                await self._publish(r, stream, TokenEvent(
                    req.request_id, index, [], [], "stop" if index == len(req.inputs) - 1 else None,
                    num_prompt_tokens=len(input_ids), worker_id="echo",
                    embedding=pack_embedding(self._embedding(input_ids))))
            return
        i = 0
        while i < len(ids):
            while self.hold:
                await asyncio.sleep(0.01)
            if req.request_id in self.cancelled_ids():
                return
            if self.delay:
                await asyncio.sleep(self.delay)
            n = 1 if i == 0 else self.tokens_per_event  # the first token comes alone (prefill)
            chunk = ids[i:i + n]
            last = i + len(chunk) >= len(ids)
            logprob = self.logprob_of(req) if self.logprob_of is not None else -0.25
            top = ([[[float(t), -1.0 - 0.01 * j] for j, t in enumerate(range(100, 100 + self.top_logprobs))]
                    for _ in chunk] if self.top_logprobs and req.sampling.logprobs is not None else [])
            event = TokenEvent(req.request_id, i, chunk, [logprob] * len(chunk), finish if last else None,
                               num_prompt_tokens=len(req.prompt_token_ids), worker_id="echo", top_logprobs=top)
            await self._publish(r, stream, event)
            if self.mode == "duplicate" and i > 0:
                await self._publish(r, stream, event)  # redelivery: the gateway must drop it
            if self.mode == "diverge" and i >= 2:
                # A worker that took over regenerates from token 1 and gets another token there
                # (other numerics): the text so far and the new one are not one causal chain.
                await self._publish(r, stream, TokenEvent(req.request_id, 1, [ids[1] + 1], [-0.25],
                                                          worker_id="echo-2"))
                return
            i += len(chunk)

    def _embedding(self, prompt_ids: list[int]) -> list[float]:
        from gateway.embeddings.pooling_config import hidden_size

        size = hidden_size(Path(self.tok.name_or_path))  # the served model's, as the gateway expects
        return [((sum(prompt_ids) + i) % 7) - 3.0 for i in range(size)]

    async def _publish(self, r: aioredis.Redis, stream: str, event: TokenEvent) -> None:
        await r.xadd(stream, {PAYLOAD_FIELD: encode(event)}, maxlen=STREAM_MAXLEN, approximate=True)

    async def _listen_cancels(self, r: aioredis.Redis) -> None:
        # From the stream's current end, but as an id: re-reading with "$" after each empty block
        # would miss a cancel added between two reads (seen under load).
        try:
            last = (await r.xinfo_stream(CANCEL_STREAM))["last-generated-id"]
        except ResponseError:  # no cancel stream yet
            last = "0-0"
        while not self._stop.is_set():
            reply = await r.xread({CANCEL_STREAM: last}, count=100, block=100)
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    self.cancels.append(decode(fields[PAYLOAD_FIELD], Cancel))

    async def _heartbeats(self, r: aioredis.Redis) -> None:
        while not self._stop.is_set():
            if self.heartbeat is not None:
                pipe = r.pipeline(transaction=False)
                heartbeats.queue_beat(pipe, "decode", "echo", self.heartbeat, 1.5)
                await pipe.execute()
            await asyncio.sleep(0.2)


def wait_until(predicate: Any, timeout: float = 5.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture(scope="session")
def gw_tokenizer(default_model_dir: Path):
    from gateway.tokenizer import PromptTokenizer

    return PromptTokenizer(default_model_dir)


@pytest.fixture(scope="session")
def gw_redis_url(redis_url: str) -> str:
    return private_db(redis_url)


@pytest.fixture(scope="module")
def gw_echo_worker(gw_redis_url: str, gw_tokenizer):
    worker = EchoWorker(gw_redis_url, gw_tokenizer.hf).start()
    yield worker
    worker.stop()


@pytest.fixture
def gw_worker(gw_echo_worker: EchoWorker) -> EchoWorker:
    """The module's echo worker, with its knobs reset for this test."""
    gw_echo_worker.reset()
    yield gw_echo_worker
    gw_echo_worker.reset()


def start_gateway(default_model_dir: Path, gw_redis_url: str, gw_tokenizer, **overrides: Any) -> ServerThread:
    from gateway.app import create_app
    from gateway.config import Settings

    settings = Settings(model_dir=default_model_dir, redis_url=gw_redis_url,
                        max_batch_total_tokens=overrides.pop("max_batch_total_tokens", 100_000),
                        heartbeat_interval=0.2, **overrides)
    return ServerThread(create_app(settings, tokenizer=gw_tokenizer)).start()


@pytest.fixture(scope="module")
def gw_server(default_model_dir: Path, gw_redis_url: str, gw_tokenizer, gw_echo_worker) -> ServerThread:
    server = start_gateway(default_model_dir, gw_redis_url, gw_tokenizer, max_queue_wait=5.0)
    yield server
    server.stop()

