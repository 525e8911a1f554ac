"""Chaos soak: `baton serve` with 2 prefill + 2 decode workers at about twice its capacity, while
workers, the gateway and Redis are killed, stopped and restarted; then a table of what happened.

    python benchmarks/chaos.py                       # about 6 minutes on 2 cores
    python benchmarks/chaos.py --duration 120 --seed 3
    python benchmarks/chaos.py --dtype bfloat16      # the default dtype of `baton serve`

Every request is checked: greedy ones against the reference engine's output (the served dtype,
`--dtype`, float32 unless told; same weights, computed in this process, one request at a time: bf16
holds only because greedy decode is batch-invariant), seeded sampled ones against a seeded rerun on
the reference. A `resume_mismatch` (a worker that took over regenerated other tokens) counts as bad.
A request ends in one of: exact (the right tokens), error (a clear 4xx/5xx or error event: 429
overload, 503 while Redis is down, a request that lost its state), hung (no end within the bound:
none may) or wrong (ended normally with other tokens: none may). Faults, in random order: kill -9
and SIGTERM of a worker, SIGSTOP/SIGCONT of the gateway for a few seconds, kill -9 of Redis (serve
restarts it), a client that reads slowly, oversized and malformed requests (each must get a 4xx),
and issue 20's hostile requests (best_of on a streaming route, a seed near 2**64 with n, best_of's
usage, streamed required tool calls with n, prompts x n with echo and 20 logprobs, a 1 MiB /tokenize
with token strings, an invalid schema: each must get its own answer, never a hang or a 500), and
issue 38's (benchmarks/chaos_floods.py): requests without the API key (the server runs with one),
embedding floods of up to 512 inputs and stored-response floods against a 16 KiB
--responses-max-bytes.
Afterwards the cluster must hold nothing: budget, running requests, pending stream entries and KV
blocks in use all back to zero.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from baton.cli.redis_server import free_port  # noqa: E402
from benchmarks.chaos_floods import FloodTally, flood, report_rows  # noqa: E402

PROMPTS = ["The history of the printing press", "東京の天気について教えてください。",
           "Une recette simple de crêpes :", "def fibonacci(n):", "Explain photosynthesis to a child.",
           "Что такое нейронная сеть?", "Los planetas del sistema solar son", "A short poem about rain:"]


@dataclass
class Job:
    prompt: str
    max_tokens: int
    seed: int | None  # None: greedy
    slow: bool = False  # read the stream slowly


@dataclass
class Tally:
    outcomes: dict[str, int] = field(default_factory=lambda: {"exact": 0, "error": 0, "hung": 0, "wrong": 0})
    errors: dict[str, int] = field(default_factory=dict)
    rejected_bad_input: int = 0
    bad_input_not_4xx: int = 0
    hostile_as_expected: int = 0  # issue 20's hostile requests, answered as they should be
    hostile_unexpected: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    wrong_examples: list[str] = field(default_factory=list)

    def error(self, kind: str) -> None:
        self.outcomes["error"] += 1
        self.errors[kind] = self.errors.get(kind, 0) + 1


def resume_mismatches(tally: Tally) -> int:
    # the gateway's error text for it: "the worker that resumed this request produced different tokens ..."
    return sum(n for kind, n in tally.errors.items() if "resumed this request produced different" in kind)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def children(pid: int) -> dict[int, str]:
    """pid -> command line of every descendant of `pid`."""
    parents: dict[int, int] = {}
    cmdlines: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdlines[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in out:
                out[child] = cmdlines.get(child, "")
                frontier.append(child)
    return out


def role_pids(serve_pid: int, role: str) -> list[int]:
    marker = {"prefill": "-m prefill_worker", "decode": "-m decode_worker", "gateway": "-m gateway",
              "redis": "redis-server"}[role]
    return [pid for pid, cmd in children(serve_pid).items() if marker in cmd]


async def references(model: Path, jobs: list[Job], dtype: str = "float32") -> dict[tuple, list[int]]:
    from baton import LLM, SamplingParams

    llm = LLM(model=str(model), dtype=dtype, enable_prefix_caching=False)
    out: dict[tuple, list[int]] = {}
    for job in jobs:
        key = (job.prompt, job.max_tokens, job.seed)
        if key in out:
            continue
        params = SamplingParams(temperature=0 if job.seed is None else 0.8, seed=job.seed,
                                max_tokens=job.max_tokens)
        [result] = llm.generate([job.prompt], params)
        out[key] = result.outputs[0].token_ids
    return out


async def run_job(client: httpx.AsyncClient, job: Job, expected: list[int], tally: Tally, hang_s: float) -> None:
    parameters: dict[str, object] = {"max_new_tokens": job.max_tokens, "details": True}
    if job.seed is not None:
        parameters.update(do_sample=True, temperature=0.8, seed=job.seed)
    ids: list[int] = []
    try:
        async with asyncio.timeout(hang_s):
            async with client.stream("POST", "/generate_stream",
                                     json={"inputs": job.prompt, "parameters": parameters}) as response:
                if response.status_code != 200:
                    await response.aread()
                    tally.error(f"http {response.status_code}")
                    return
                finished = None
                async for line in response.aiter_lines():
                    if job.slow:
                        await asyncio.sleep(0.05)
                    if not line.startswith("data:"):
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        tally.error(re.sub(r"\d+", "N", str(event["error"]))[:70])
                        return
                    ids.append(event["token"]["id"])
                    if event.get("details"):
                        finished = event["details"]["finish_reason"]
                if finished is None:
                    tally.error("stream ended without a finish")
                elif ids == expected:
                    tally.outcomes["exact"] += 1
                else:
                    tally.outcomes["wrong"] += 1
                    tally.wrong_examples.append(f"{job.prompt[:20]!r} seed={job.seed}: {len(ids)} ids")
    except TimeoutError:
        tally.outcomes["hung"] += 1
    except httpx.HTTPError as exc:
        tally.error(f"connection: {type(exc).__name__}")


async def bad_input(client: httpx.AsyncClient, tally: Tally, rng: random.Random) -> None:
    kind = rng.choice(["oversized", "malformed", "wrong_type", "text_plain"])
    try:
        if kind == "oversized":
            r = await client.post("/v1/completions", json={"prompt": "word " * 200_000, "max_tokens": 4})
        elif kind == "malformed":
            r = await client.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": ',
                                  headers={"content-type": "application/json"})
        elif kind == "wrong_type":
            r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": "many"})
        else:
            r = await client.post("/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    except httpx.HTTPError:
        tally.bad_input_not_4xx += 1
        return
    ok = 400 <= r.status_code < 500 and r.headers.get("content-type", "").startswith("application/json")
    # A bad request may also meet a gateway that is stopped or without Redis: a 503 is a clear answer.
    if ok:
        tally.rejected_bad_input += 1
    elif r.status_code != 503:
        tally.bad_input_not_4xx += 1


# Issue 20's hostile requests: each was once able to lock up or mislead the gateway. The answer
# each must get (a 503 is clear too: a fault may be under way).
TOOL = {"type": "function", "function": {"name": "save", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
HOSTILE: dict[str, tuple[str, dict[str, object], int]] = {
    # best_of on the streaming route without a `stream` field: leaked its budget for good
    "best_of_stream": ("/generate_stream", {"inputs": "Hi", "parameters": {
        "best_of": 4, "do_sample": True, "max_new_tokens": 200}}, 422),
    # a seed near 2**64 with n > 1: its siblings' seeds overflowed the wire, the request hung 120 s
    "seed_2_64": ("/v1/completions", {"prompt": "Hi", "n": 2, "seed": 2**64 - 1, "max_tokens": 4,
                                      "temperature": 1.0}, 200),
    # best_of: usage once reported prompt_tokens 0
    "best_of_usage": ("/v1/completions", {"prompt": "Hi there", "best_of": 3, "max_tokens": 4,
                                          "temperature": 1.0, "seed": 7}, 200),
    # streamed required tool calls with n: rescanned the answer per chunk on the event loop
    "tools_required_n": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "save hi"}],
                                                  "tools": [TOOL], "tool_choice": "required", "n": 3,
                                                  "max_tokens": 24, "stream": True, "temperature": 1.0}, 200),
    # several prompts x n with echo and logprobs: formatted on the event loop
    "echo_logprobs": ("/v1/completions", {"prompt": ["Hi", "Bonjour", "你好"], "n": 2, "echo": True,
                                          "logprobs": 20, "max_tokens": 6, "temperature": 1.0}, 200),
    # a 1 MiB prompt's token strings, outside admission
    "tokenize_1mib": ("/tokenize", {"prompt": "héllo wörld 你好 " * 45_000, "return_token_strs": True}, 200),
    # an invalid schema, sent again and again
    "invalid_schema": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}}, 400),
}


async def hostile(client: httpx.AsyncClient, tally: Tally, rng: random.Random, hang_s: float) -> None:
    name = rng.choice(sorted(HOSTILE))
    path, body, expected = HOSTILE[name]
    try:
        async with asyncio.timeout(hang_s):
            r = await client.post(path, content=json.dumps(body, ensure_ascii=False).encode("utf-8"),
                                  headers={"content-type": "application/json"})
    except TimeoutError:
        tally.outcomes["hung"] += 1
        tally.hostile_unexpected.append(f"{name}: hung")
        return
    except httpx.HTTPError as exc:
        tally.error(f"connection: {type(exc).__name__}")
        return
    if r.status_code == 200 and name == "tools_required_n" and '"error"' in r.text:
        tally.error(f"hostile {name}: error event")  # a stream's error event: as run_job counts it
    elif r.status_code == expected and _hostile_answer_ok(name, r):
        tally.hostile_as_expected += 1
    elif r.status_code == 503 or (r.status_code == 429 and expected == 200):
        tally.error(f"hostile {name}: {r.status_code}")  # a fault under way, or overload: clear answers
    elif r.status_code == 400 and expected == 200 and "needs" in r.text and "tokens" in r.text:
        tally.error(f"hostile {name}: exceeds the budget")
    else:
        tally.hostile_unexpected.append(f"{name}: {r.status_code} {r.text[:80]!r}")


def _hostile_answer_ok(name: str, r: httpx.Response) -> bool:
    if r.status_code != 200:
        return r.headers.get("content-type", "").startswith("application/json")
    if name == "tools_required_n":
        return r.text.rstrip().endswith("data: [DONE]")
    body = r.json()
    if name == "seed_2_64":
        return sorted(c["index"] for c in body["choices"]) == [0, 1]
    if name == "best_of_usage":
        return body["usage"]["prompt_tokens"] > 0 and len(body["choices"]) == 1
    if name == "echo_logprobs":
        return len(body["choices"]) == 6 and all(c["logprobs"]["top_logprobs"] for c in body["choices"])
    return name == "tokenize_1mib" and len(body["token_strs"]) == body["count"] > 0


async def inject(serve_pid: int, tally: Tally, rng: random.Random, stop_at: float, every_s: float) -> None:
    faults = ["kill_prefill", "kill_decode", "term_prefill", "term_decode", "stop_gateway", "kill_redis"]
    await asyncio.sleep(every_s)
    while time.monotonic() < stop_at - every_s:
        rng.shuffle(faults)
        for fault in faults:
            if time.monotonic() >= stop_at - every_s:
                return
            action, role = fault.split("_")
            pids = role_pids(serve_pid, role)
            if not pids:
                tally.faults.append(f"{fault} (no {role} found)")
            else:
                pid = rng.choice(pids)
                if action == "kill":
                    os.kill(pid, signal.SIGKILL)
                elif action == "term":
                    os.kill(pid, signal.SIGTERM)
                else:
                    os.kill(pid, signal.SIGSTOP)
                    await asyncio.sleep(3)
                    os.kill(pid, signal.SIGCONT)
                tally.faults.append(fault)
                print(f"  {time.strftime('%H:%M:%S')} fault: {fault} (pid {pid})", flush=True)
            await asyncio.sleep(every_s)


async def load(base_url: str, jobs: list[Job], refs: dict[tuple, list[int]], tally: Tally, floods: FloodTally,
               concurrency: int, stop_at: float, rng: random.Random, hang_s: float) -> int:
    sent = 0
    timeout = httpx.Timeout(hang_s, connect=10)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=KEY_HEADERS) as client, \
            httpx.AsyncClient(base_url=base_url, timeout=timeout) as keyless_client:
        async def worker() -> None:
            nonlocal sent
            while time.monotonic() < stop_at:
                sent += 1
                draw = rng.random()
                if draw < 0.05:
                    await bad_input(client, tally, rng)
                    continue
                if draw < 0.10:
                    await hostile(client, tally, rng, hang_s)
                    continue
                if draw < 0.16:
                    await flood(keyless_client, KEY_HEADERS, floods, rng, hang_s)
                    continue
                job = rng.choice(jobs)
                await run_job(client, job, refs[(job.prompt, job.max_tokens, job.seed)], tally, hang_s)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sent


API_KEY = "chaos-" + os.urandom(8).hex()
KEY_HEADERS = {"authorization": f"Bearer {API_KEY}"}


def held(base_url: str, redis_url: str | None) -> dict[str, object]:
    stats = httpx.get(base_url + "/stats", timeout=10, headers=KEY_HEADERS).json()
    workers = stats.get("workers", {})
    return {
        "budget in use (tokens)": stats["token_budget"]["in_use"],
        "requests running/waiting": stats["requests"]["running"] + stats["requests"]["waiting"],
        "stream entries pending": sum(s.get("pending", 0) for s in stats.get("streams", {}).values()),
        "KV blocks in use": sum(w.get("num_kv_blocks_used", 0) for kind in ("prefill", "decode")
                                for w in workers.get(kind, [])),
        "workers (prefill+decode)": sum(len(workers.get(k, [])) for k in ("prefill", "decode")),
    }


def wait_idle(base_url: str, timeout: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    state: dict[str, object] = {}
    while time.monotonic() < deadline:
        try:
            state = held(base_url, None)
            if (state["budget in use (tokens)"] == 0 and state["requests running/waiting"] == 0
                    and state["stream entries pending"] == 0 and state["KV blocks in use"] == 0
                    and state["workers (prefill+decode)"] == 4):
                return state
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(1)
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the default model)")
    parser.add_argument("--duration", type=float, default=240, help="seconds of load (at most 480)")
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--fault-every", type=float, default=15, help="seconds between faults")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--hang-timeout", type=float, default=150, help="a request without an end this long is hung")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the workers' dtype (and the reference's)")
    args = parser.parse_args()
    duration = min(args.duration, 480)
    rng = random.Random(args.seed)

    from baton.common.model_files import resolve_model

    model = resolve_model(args.model)
    jobs = [Job(p, n, None) for p in PROMPTS for n in (16, 40)]
    jobs += [Job(p, 24, seed) for p, seed in zip(PROMPTS, range(100, 108))]
    jobs += [Job(PROMPTS[0], 40, None, slow=True)]
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; model {model.name} ({args.dtype}); computing references ...",
          flush=True)
    refs = asyncio.run(references(model, jobs, args.dtype))

    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    # About twice the load the budget admits: concurrency x (prompt + output) ~ 2 x budget.
    budget = max(256, args.concurrency * 50 // 2)
    log = tempfile.NamedTemporaryFile("w", prefix="baton-chaos-", suffix=".log", delete=False)
    cmd = [str(Path(sys.executable).parent / "baton"), "serve", "--model", str(model), "--port", str(port),
           "--prefill-workers", "2", "--decode-workers", "2", "--dtype", args.dtype,
           "--max-batch-total-tokens", str(budget), "--max-total-tokens", "256", "--max-input-tokens", "128",
           "--max-queue-wait", "5", "--responses-max-bytes", "16KiB"]
    # The key through the environment, as a user should pass it (argv is visible to every user).
    serve = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, "BATON_API_KEY": API_KEY})
    tally, floods = Tally(), FloodTally()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(base_url + "/health", timeout=2).status_code == 200 and \
                        httpx.get(base_url + "/stats", timeout=2, headers=KEY_HEADERS).json()["token_budget"]["total"] > 0:
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if serve.poll() is not None:
                sys.exit(f"baton serve exited ({serve.returncode}); see {log.name}")
            time.sleep(1)
        print(f"serving on {base_url}; {duration:.0f}s of load at concurrency {args.concurrency}, "
              f"budget {budget} tokens, a fault every {args.fault_every:.0f}s (log: {log.name})", flush=True)
        stop_at = time.monotonic() + duration

        async def soak() -> int:
            injector = asyncio.create_task(inject(serve.pid, tally, rng, stop_at, args.fault_every))
            sent = await load(base_url, jobs, refs, tally, floods, args.concurrency, stop_at, rng,
                              args.hang_timeout)
            await injector
            return sent

        sent = asyncio.run(soak())
        after = wait_idle(base_url, 90)
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
    print()
    print(f"CPU: {cpu_model()}; `python benchmarks/chaos.py --duration {duration:.0f} --seed {args.seed} "
          f"--dtype {args.dtype}`")
    print(f"faults injected: {len(tally.faults)} ({', '.join(sorted(set(tally.faults)))})")
    print()
    print("| requests | count |")
    print("| --- | --- |")
    print(f"| sent | {sent} |")
    print(f"| completed with the reference's exact tokens | {tally.outcomes['exact']} |")
    print(f"| ended with a clear error | {tally.outcomes['error']} |")
    print(f"| bad input answered 4xx (JSON) | {tally.rejected_bad_input} |")
    print(f"| bad input not answered 4xx | {tally.bad_input_not_4xx} |")
    print(f"| hostile requests (issue 20) answered as they should be | {tally.hostile_as_expected} |")
    print(f"| hostile requests answered otherwise | {len(tally.hostile_unexpected)} |")
    print(f"| hung | {tally.outcomes['hung']} |")
    print(f"| wrong output | {tally.outcomes['wrong']} |")
    print(f"| resume_mismatch (a takeover regenerated other tokens) | {resume_mismatches(tally)} |")
    for label, value in report_rows(floods):
        print(f"| {label} | {value} |")
    for key, value in after.items():
        print(f"| afterwards: {key} | {value} |")
    print()
    print("errors by kind: " + ", ".join(f"{k}: {v}" for k, v in sorted(tally.errors.items(), key=lambda kv: -kv[1])))
    if tally.hostile_unexpected:
        print("hostile, answered otherwise: " + "; ".join(tally.hostile_unexpected[:5]))
    if floods.unexpected:
        print("floods, answered otherwise: " + "; ".join(floods.unexpected[:5]))
    if tally.wrong_examples:
        print("wrong: " + "; ".join(tally.wrong_examples[:5]))
    bad = (tally.outcomes["hung"] or tally.outcomes["wrong"] or tally.bad_input_not_4xx or resume_mismatches(tally)
           or tally.hostile_unexpected or floods.unexpected or floods.hung
           or after.get("budget in use (tokens)") or after.get("KV blocks in use") or after.get("stream entries pending"))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
