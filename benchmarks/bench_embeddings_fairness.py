"""Chat TTFT while an embeddings flood arrives at a multiple of the prefill pool's capacity (issue 38).

    python benchmarks/bench_embeddings_fairness.py                     # baton serve, defaults (~2 min)
    python benchmarks/bench_embeddings_fairness.py --duration 30 --multiple 4 --inputs 64
    python benchmarks/bench_embeddings_fairness.py --base-url http://127.0.0.1:8000   # a running server

Phases, on one server (`baton serve` with its defaults, started here unless --base-url):
1. capacity: embeddings requests (`--inputs` inputs of ~`--words` words each, base64, as the openai
   SDK asks) back to back from 2 clients for `--capacity-seconds`: the prefill pool's rate in input
   tokens per second (the `usage` of the answers).
2. quiet: streamed chat requests (`--chat-rate` a second, open loop, `max_tokens` 8) for
   `--duration` seconds: time to the first content chunk (TTFT).
3. loaded: the same chat requests while embeddings requests arrive open loop at `--multiple` times
   the capacity, for `--duration` seconds; then every request in flight is waited for.
Printed: quiet TTFT p50/p99, loaded TTFT p50/p99, the p99 ratio, and each kind's outcomes: ok,
rejected at the door (429/503 with Retry-After: the flood beyond capacity must be refused, not
queued), errors, and timeouts (the gateway's "no token from the workers" or no answer within
`--client-timeout`): none may time out. Last, the gateway's budget and embeddings lane in use,
which must be back to 0. The issue's bar: loaded TTFT p99 <= 3x the quiet p99, 0 timeouts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_serving import free_port, start_server, stop_server  # noqa: E402

WORDS = ("river stone cloud lamp garden violin copper maple silent orbit harbor pencil meadow signal "
         "lantern velvet canyon puzzle thunder saddle").split()
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "Why is the sky blue?",
             "Give me a word that rhymes with cat.", "What do bees make?", "How many legs has a spider?"]


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # ok | rejected | error | timeout
    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0  # embeddings: input tokens answered
    errors: list[str] = field(default_factory=list)

    def record(self, status: int, text: str) -> None:
        if status in (429, 503):
            self.outcomes["rejected"] += 1
        elif "no token from the workers" in text or status == -1:
            self.outcomes["timeout"] += 1
            self.errors.append(text[:160])
        else:
            self.outcomes["error"] += 1
            self.errors.append(f"{status}: {text[:160]}")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def embedding_body(rng: random.Random, inputs: int, words: int) -> dict:
    # a random number first: no two inputs share a prefix the prefix cache could skip
    texts = [f"{rng.randrange(10**9)} " + " ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(inputs)]
    return {"input": texts, "encoding_format": "base64"}


async def answered(tally: Tally, request: Awaitable[T]) -> T | None:
    """The request's result, or None with its transport failure recorded (timeout or connection)."""
    try:
        return await request
    except httpx.TimeoutException:
        tally.record(-1, "no answer within the client timeout")
    except httpx.HTTPError as exc:
        tally.record(0, f"{type(exc).__name__}: {exc}")
    return None


async def embed(client: httpx.AsyncClient, body: dict, tally: Tally, timeout: float) -> None:
    reply = await answered(tally, client.post("/v1/embeddings", json=body, timeout=timeout))
    if reply is None:
        return
    if reply.status_code == 200:
        tally.outcomes["ok"] += 1
        tally.tokens += reply.json()["usage"]["prompt_tokens"]
    else:
        tally.record(reply.status_code, reply.text)


async def chat(client: httpx.AsyncClient, question: str, tally: Tally, timeout: float) -> None:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 8, "stream": True}
    started = time.perf_counter()

    async def stream() -> tuple[bool, float | None]:  # (ended well, time to the first content)
        async with client.stream("POST", "/v1/chat/completions", json=body, timeout=timeout) as reply:
            if reply.status_code != 200:
                tally.record(reply.status_code, (await reply.aread()).decode(errors="replace"))
                return False, None
            first: float | None = None
            async for line in reply.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    tally.record(500, json.dumps(event["error"]))
                    return False, None
                delta = (event.get("choices") or [{}])[0].get("delta") or {}
                if first is None and delta.get("content"):
                    first = time.perf_counter() - started
            return True, first

    outcome = await answered(tally, stream())
    if outcome is None or not outcome[0]:
        return
    tally.outcomes["ok"] += 1
    if outcome[1] is not None:
        tally.ttfts.append(outcome[1])


async def open_loop(rate: float, duration: float, start: Callable[[], Awaitable[None]]) -> list[asyncio.Task]:
    """Start `start()` at `rate` a second (Poisson arrivals) for `duration` seconds."""
    rng = random.Random(7)
    tasks: list[asyncio.Task] = []
    deadline = time.perf_counter() + duration
    while time.perf_counter() < deadline:
        tasks.append(asyncio.create_task(start()))
        await asyncio.sleep(rng.expovariate(rate))
    return tasks


async def measure_capacity(client: httpx.AsyncClient, args: argparse.Namespace) -> float:
    rng = random.Random(1)
    tally = Tally()
    deadline = time.perf_counter() + args.capacity_seconds
    started = time.perf_counter()

    async def loop() -> None:
        while time.perf_counter() < deadline:
            await embed(client, embedding_body(rng, args.inputs, args.words), tally, args.client_timeout)

    await asyncio.gather(loop(), loop())
    elapsed = time.perf_counter() - started
    if tally.outcomes["ok"] == 0:
        raise SystemExit(f"no embeddings request succeeded while measuring capacity: {tally.errors[:3]}")
    return tally.tokens / elapsed


async def chat_phase(client: httpx.AsyncClient, args: argparse.Namespace, flood_rate: float) -> tuple[Tally, Tally]:
    chats, floods = Tally(), Tally()
    rng = random.Random(3)
    flood = (open_loop(flood_rate, args.duration, lambda: embed(
        client, embedding_body(rng, args.inputs, args.words), floods, args.client_timeout))
             if flood_rate > 0 else asyncio.sleep(0, result=[]))
    chat_tasks, flood_tasks = await asyncio.gather(
        open_loop(args.chat_rate, args.duration, lambda: chat(client, rng.choice(QUESTIONS), chats, args.client_timeout)),
        flood)
    await asyncio.gather(*chat_tasks, *flood_tasks)
    return chats, floods


def outcome_line(name: str, tally: Tally) -> str:
    counts = ", ".join(f"{key} {tally.outcomes[key]}" for key in ("ok", "rejected", "error", "timeout"))
    return f"{name:<11} {counts}"


async def run(base_url: str, args: argparse.Namespace) -> int:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, limits=limits) as client:
        await chat(client, "Hello", Tally(), args.client_timeout)  # warm-up
        await embed(client, embedding_body(random.Random(0), 4, 4), Tally(), args.client_timeout)
        capacity = await measure_capacity(client, args)
        tokens_per_request = args.inputs * (args.words + 4)  # about: the number and the words' tokens
        flood_rate = args.multiple * capacity / tokens_per_request
        print(f"capacity: {capacity:.0f} input tokens/s ({capacity / tokens_per_request:.2f} requests of "
              f"{args.inputs} inputs/s); the flood: {flood_rate:.2f} requests/s ({args.multiple:g}x)", flush=True)
        quiet, _ = await chat_phase(client, args, 0.0)
        loaded, floods = await chat_phase(client, args, flood_rate)
        await asyncio.sleep(1.0)
        stats = (await client.get("/stats", timeout=10)).json()
    q50, q99 = percentile(quiet.ttfts, 50), percentile(quiet.ttfts, 99)
    l50, l99 = percentile(loaded.ttfts, 50), percentile(loaded.ttfts, 99)
    print(f"quiet  chat TTFT p50 {q50 * 1000:7.0f} ms  p99 {q99 * 1000:7.0f} ms  ({len(quiet.ttfts)} requests)")
    print(f"loaded chat TTFT p50 {l50 * 1000:7.0f} ms  p99 {l99 * 1000:7.0f} ms  ({len(loaded.ttfts)} requests)")
    ratio = l99 / q99
    print(f"loaded / quiet p99: {ratio:.2f}x (bar: <= 3x)")
    print(outcome_line("quiet chat", quiet))
    print(outcome_line("chat", loaded))
    print(outcome_line("embeddings", floods) + f"  ({floods.tokens} input tokens answered)")
    for error in (quiet.errors + loaded.errors + floods.errors)[:5]:
        print("  e.g.", error)
    lane = stats.get("embeddings", {})
    print(f"afterwards: token budget in use {stats['token_budget']['in_use']}, embeddings lane in use "
          f"{lane.get('tokens_in_use', '?')}, requests running {stats['requests']['running']}")
    timeouts = quiet.outcomes["timeout"] + loaded.outcomes["timeout"] + floods.outcomes["timeout"]
    errors = quiet.outcomes["error"] + loaded.outcomes["error"] + floods.outcomes["error"]
    return 0 if ratio <= 3 and timeouts == 0 and errors == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="a running server (default: start baton serve)")
    parser.add_argument("--serve-args", default="", help="extra `baton serve` flags")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of each chat phase")
    parser.add_argument("--capacity-seconds", type=float, default=10.0)
    parser.add_argument("--multiple", type=float, default=4.0, help="the flood's rate, in times the capacity")
    parser.add_argument("--chat-rate", type=float, default=2.0, help="chat requests a second")
    parser.add_argument("--inputs", type=int, default=64, help="inputs per embeddings request")
    parser.add_argument("--words", type=int, default=12, help="words per input")
    parser.add_argument("--client-timeout", type=float, default=180.0)
    args = parser.parse_args(argv)
    if args.base_url:
        return asyncio.run(run(args.base_url, args))
    port = free_port()
    proc = start_server(ROOT, port, args.serve_args.split())
    try:
        return asyncio.run(run(f"http://127.0.0.1:{port}", args))
    finally:
        stop_server(proc)


if __name__ == "__main__":
    sys.exit(main())
