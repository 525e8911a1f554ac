"""A chat's follow-up turns: time to first token when the conversation so far was seen before.

One conversation, run against `baton serve` and (with --llama-server) llama.cpp's server on the same
GGUF, one after the other: a long first prompt (--context tokens of text), then --turns follow-ups,
each sending the whole conversation so far (every earlier prompt and answer) plus a short new user
message, as a chat client does. Each turn streams --answer tokens (greedy). Printed per server: the
first turn's TTFT (nothing cached), the follow-ups' TTFT p50, and how many prompt tokens each
follow-up found cached (Baton: usage's cached_tokens; llama-server: its timings' cache_n).

For a hybrid model (Qwen3.5: Gated DeltaNet layers) this is the case issue #40 names: Baton resumes
a turn from the state snapshot at the last full block of the previous prompt
(docs/design-decisions.md, 25); a server without state checkpoints re-processes the whole prompt.

    python benchmarks/bench_followup.py --gguf /tmp/q35-08b.Q8_0.gguf \\
        --llama-server /tmp/llamabuild/bin/llama-server
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_serving import free_port, start_llama_server, start_server, stop_server, warm_up  # noqa: E402

WORDS = ("river stone market winter garden letter orange window silver morning engine harbor paper "
         "valley signal forest copper lantern bridge meadow thunder ribbon canvas pocket marble").split()


def text_of(n_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def turn(port: int, prompt: str, answer_tokens: int) -> tuple[float, str, int | None]:
    """Stream one completion: (TTFT s, its text, prompt tokens found cached or None if not reported)."""
    body = {"prompt": prompt, "max_tokens": answer_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"}, method="POST")
    start = time.perf_counter()
    ttft, text, cached = None, "", None
    with urllib.request.urlopen(request, timeout=900) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text += choice["text"]
            usage = chunk.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                cached = int(details["cached_tokens"])
            timings = chunk.get("timings") or {}
            if "cache_n" in timings:
                cached = int(timings["cache_n"])
    assert ttft is not None, "no token came back"
    return ttft, text, cached


def conversation(port: int, context_words: int, turns: int, answer_tokens: int) -> list[tuple[float, int | None]]:
    rng = random.Random(7)
    prompt = f"Notes: {text_of(context_words, rng)}\nUser: what do the notes say about the harbor?\nAssistant:"
    results = []
    for i in range(1 + turns):
        ttft, answer, cached = turn(port, prompt, answer_tokens)
        results.append((ttft, cached))
        print(f"  turn {i}: TTFT {ttft * 1000:8.0f} ms, cached {cached}", flush=True)
        prompt += f"{answer}\nUser: and about the {rng.choice(WORDS)} {text_of(8, rng)}?\nAssistant:"
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, required=True, help="the GGUF both servers serve")
    parser.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary")
    parser.add_argument("--context", type=int, default=1500, help="words of the first prompt (about a token each)")
    parser.add_argument("--turns", type=int, default=4, help="follow-up turns after the first")
    parser.add_argument("--answer", type=int, default=32, help="tokens each turn answers")
    parser.add_argument("--serve-args", default="", help="extra flags for baton serve")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_engine import cpu_model, loadavg

    print(f"CPU: {cpu_model()}; {loadavg()}", flush=True)
    servers: list[tuple[str, object]] = [("baton", lambda port: start_server(
        ROOT, port, ["--model", str(args.gguf), *args.serve_args.split()]))]
    if args.llama_server is not None:
        servers.append(("llama-server", lambda port: start_llama_server(args.llama_server, args.gguf, port, 1, 16384)))
    table = {}
    for tag, start in servers:
        port = free_port()
        proc = start(port)  # type: ignore[operator]
        try:
            warm_up(port)
            print(f"{tag}:", flush=True)
            table[tag] = conversation(port, args.context, args.turns, args.answer)
        finally:
            stop_server(proc)
    print(f"\nafter: {loadavg()}\n")
    print("| server | first turn TTFT ms | follow-up TTFT p50 ms | follow-ups' cached prompt tokens |")
    print("| --- | --- | --- | --- |")
    for tag, rows in table.items():
        follow = [t for t, _ in rows[1:]]
        cached = ", ".join("n/a" if c is None else str(c) for _, c in rows[1:])
        print(f"| {tag} | {rows[0][0] * 1000:.0f} | {statistics.median(follow) * 1000:.0f} | {cached} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
