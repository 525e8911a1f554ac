"""Overload harness: drive a running Baton at a multiple of its capacity and report what happened.

    python benchmarks/overload.py --base-url http://127.0.0.1:8000 --multiple 2 --num-requests 200

Capacity is the gateway's `max_concurrent_requests` (from /info). The harness keeps
`multiple x capacity` streaming requests in flight (closed loop, real HTTP on loopback, bounded in
count and time: it stops by itself), then reports completed / rejected (429) / failed / hung, the
time a rejection takes, TTFT and inter-token latency of the admitted requests, and, once the load
is over, the cluster's budget in use, requests running and KV blocks in use — which must all
return to zero.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Outcome:
    kind: str = "completed"  # completed | rejected | failed | hung
    status: int = 0
    latency: float = 0.0  # to the rejection, or end to end
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    error: str = ""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def one_request(client: httpx.AsyncClient, prompt: str, max_new_tokens: int, hang_timeout: float) -> Outcome:
    started = time.perf_counter()
    out = Outcome()
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}}
    try:
        async with client.stream("POST", "/generate_stream", json=body) as response:
            out.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                out.latency = time.perf_counter() - started
                out.kind = "rejected" if response.status_code == 429 else "failed"
                out.error = response.text[:200]
                return out
            last = started
            lines = response.aiter_lines()
            while True:
                try:
                    line = await asyncio.wait_for(lines.__anext__(), hang_timeout)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    out.kind = "hung"
                    return out
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    out.kind, out.error = "failed", str(event["error"])[:200]
                    return out
                now = time.perf_counter()
                if out.ttft is None:
                    out.ttft = now - started
                else:
                    out.itls.append(now - last)
                last = now
                if event.get("details") is not None or event.get("generated_text") is not None:
                    out.latency = now - started
                    return out
            out.kind, out.error = "failed", "stream ended without a final event"
    except httpx.HTTPError as exc:
        out.kind, out.error = "failed", repr(exc)[:200]
    return out


async def wait_idle(client: httpx.AsyncClient, timeout: float) -> dict:
    deadline = time.time() + timeout
    state: dict = {}
    while time.time() < deadline:
        stats = (await client.get("/stats")).json()
        decode = stats.get("workers", {}).get("decode", [])
        state = {"budget_in_use": stats["token_budget"]["in_use"], "requests_running": stats["requests"]["running"],
                 "requests_waiting": stats["requests"]["waiting"],
                 "kv_blocks_in_use": sum(d.get("num_kv_blocks_used", 0) for d in decode),
                 "decode_running": sum(d.get("num_requests_running", 0) for d in decode)}
        if not any(state.values()):
            break
        await asyncio.sleep(0.5)
    return state


async def run_overload(base_url: str, multiple: float, num_requests: int, max_new_tokens: int = 32,
                       hang_timeout: float = 60.0, seed: int = 0, time_limit: float = 600.0,
                       api_key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(hang_timeout * 2), headers=headers,
                                 limits=limits) as client:
        info = (await client.get("/info")).json()
        capacity = int(info["max_concurrent_requests"])
        concurrency = max(1, int(round(capacity * multiple)))
        rng = random.Random(seed)
        words = "the of and to in is you that it he was for on are as with his they at be this from".split()
        prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 64))) for _ in range(num_requests)]
        outcomes: list[Outcome] = []
        next_index = 0
        deadline = time.monotonic() + time_limit
        started = time.perf_counter()

        async def client_loop() -> None:
            nonlocal next_index
            while next_index < num_requests and time.monotonic() < deadline:
                index = next_index
                next_index += 1
                outcomes.append(await one_request(client, prompts[index], max_new_tokens, hang_timeout))

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        duration = time.perf_counter() - started
        after = await wait_idle(client, timeout=30)
    by_kind = {k: [o for o in outcomes if o.kind == k] for k in ("completed", "rejected", "failed", "hung")}
    ttfts = [o.ttft for o in by_kind["completed"] if o.ttft is not None]
    itls = [x for o in by_kind["completed"] for x in o.itls]
    rejections = [o.latency for o in by_kind["rejected"]]
    return {
        "capacity": capacity, "multiple": multiple, "concurrency": concurrency, "requests": len(outcomes),
        "duration_s": duration,
        **{k: len(v) for k, v in by_kind.items()},
        "reject_p50_ms": percentile(rejections, 50) * 1000, "reject_p99_ms": percentile(rejections, 99) * 1000,
        "ttft_p50_ms": percentile(ttfts, 50) * 1000, "ttft_p99_ms": percentile(ttfts, 99) * 1000,
        "itl_p50_ms": percentile(itls, 50) * 1000, "itl_p99_ms": percentile(itls, 99) * 1000,
        "output_tok_s": sum(len(o.itls) + 1 for o in by_kind["completed"]) / duration,
        "errors": sorted({o.error for o in by_kind["failed"] + by_kind["hung"]})[:5],
        "after": after,
    }


def print_report(report: dict) -> None:
    after = report["after"]
    print(f"=== overload x{report['multiple']:g} (capacity {report['capacity']}, {report['concurrency']} clients, "
          f"{report['requests']} requests, {report['duration_s']:.1f} s) ===")
    print(f"completed {report['completed']}  rejected(429) {report['rejected']}  failed {report['failed']}  "
          f"hung {report['hung']}")
    print(f"time to rejection   p50 {report['reject_p50_ms']:8.1f} ms   p99 {report['reject_p99_ms']:8.1f} ms")
    print(f"TTFT (admitted)     p50 {report['ttft_p50_ms']:8.1f} ms   p99 {report['ttft_p99_ms']:8.1f} ms")
    print(f"ITL  (admitted)     p50 {report['itl_p50_ms']:8.1f} ms   p99 {report['itl_p99_ms']:8.1f} ms")
    print(f"output tokens/s     {report['output_tok_s']:.1f}")
    print(f"after the load: budget in use {after.get('budget_in_use')}, requests running "
          f"{after.get('requests_running')}, waiting {after.get('requests_waiting')}, "
          f"KV blocks in use {after.get('kv_blocks_in_use')}")
    for error in report["errors"]:
        print(f"  error: {error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--multiple", type=float, action="append", help="times capacity (repeatable; default 2 and 4)")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--hang-timeout", type=float, default=60.0, help="seconds without an event = hung")
    parser.add_argument("--time-limit", type=float, default=600.0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--json", action="store_true", help="print the reports as JSON too")
    args = parser.parse_args(argv)
    ok = True
    for multiple in args.multiple or [2.0, 4.0]:
        report = asyncio.run(run_overload(args.base_url, multiple, args.num_requests, args.max_new_tokens,
                                          args.hang_timeout, time_limit=args.time_limit, api_key=args.api_key))
        print_report(report)
        if args.json:
            print(json.dumps(report))
        ok &= report["failed"] == 0 and report["hung"] == 0 and not any(report["after"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
