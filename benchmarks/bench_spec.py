"""Inter-token latency with and without speculative decoding (n-gram prompt lookup), through the engine.

Two workloads on the default model (its GGUF as `baton serve` serves it), each at 1 and 4 concurrent
requests, greedy:
- grounded: a chat prompt asking to repeat / lightly edit a passage, so the answer repeats the
  prompt (editing code, answering from a document: where prompt lookup pays);
- random: random token ids, whose continuation repeats nothing (where it must not lose).

Per run: ITL p50 = the median over requests of (last token time - first token time) / (tokens - 1),
in ms per token (several tokens arrive at once when proposals are accepted: this is the per-token
latency a streaming client sees on average), the steps taken, and the acceptance counts. Greedy
tokens are checked equal between the two engines (speculation is exact). Not in the test suite.

    python benchmarks/bench_spec.py                     # 1 and 4 clients, 128 tokens, k = 4
    python benchmarks/bench_spec.py --quick             # a smoke run
    python benchmarks/bench_spec.py --spec '{"method": "ngram", "num_speculative_tokens": 6}'
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.cli.bench.datasets import sample_grounded_requests  # noqa: E402
from baton.common.model_files import resolve_model  # noqa: E402
from baton.common.sampling_params import SamplingParams  # noqa: E402
from baton.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from baton.llm import load_tokenizer  # noqa: E402
from benchmarks.bench_engine import cpu_model  # noqa: E402

def grounded_prompts(tokenizer, n: int) -> list[list[int]]:
    """`baton bench serve --dataset-name grounded`'s prompts, as token ids."""
    return [tokenizer.encode(r.prompt, add_special_tokens=False) for r in sample_grounded_requests(tokenizer, n, 0)]


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(n)]


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """All prompts at once (the concurrency is len(prompts)); the ITL p50 in ms per token."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    times: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
        times[f"r{i}"], tokens[f"r{i}"] = [], []
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                times[out.request_id].append(now)
                tokens[out.request_id].extend(out.new_token_ids)
    itl = [(t[-1] - t[0]) / (len(tokens[r]) - 1) for r, t in times.items() if len(tokens[r]) > 1]
    return [tokens[f"r{i}"] for i in range(len(prompts))], 1000 * statistics.median(itl)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the default model)")
    parser.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 4}')
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--clients", default="1,4")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="32 tokens, 1 client")
    args = parser.parse_args()
    if args.quick:
        args.max_tokens, args.clients = 32, "1"
    model = resolve_model(args.model)
    engines = {name: LLMEngine(EngineConfig(model=model, num_threads=args.threads, speculative_config=spec))
               for name, spec in (("off", None), ("on", json.loads(args.spec)))}
    tokenizer = load_tokenizer(model)
    print(f"model {model.name}, CPU: {cpu_model()}, speculative config {args.spec}, {args.max_tokens} tokens")
    warm = random_prompts(1, 16, 0)
    for engine in engines.values():  # first steps pay one-time costs
        run(engine, warm, 8)
    print(f"{'workload':<10} {'clients':>7} {'ITL off':>9} {'ITL on':>9} {'speedup':>8} {'steps off/on':>13} "
          f"{'accepted/proposed':>18}")
    for clients in [int(c) for c in args.clients.split(",")]:
        for workload in ("grounded", "random"):
            prompts = grounded_prompts(tokenizer, clients) if workload == "grounded" else random_prompts(clients, 64, clients)
            result = {}
            for name, engine in engines.items():
                before = (engine.num_steps, engine.stats())
                out, itl = run(engine, prompts, args.max_tokens)
                after = engine.stats()
                result[name] = (out, itl, engine.num_steps - before[0],
                                after.spec_num_accepted_tokens - before[1].spec_num_accepted_tokens,
                                after.spec_num_draft_tokens - before[1].spec_num_draft_tokens)
            (out_off, itl_off, steps_off, _, _), (out_on, itl_on, steps_on, acc, prop) = result["off"], result["on"]
            same = "" if out_off == out_on else "  (tokens differ!)"
            print(f"{workload:<10} {clients:>7} {itl_off:>7.1f}ms {itl_on:>7.1f}ms {itl_off / itl_on:>7.2f}x "
                  f"{steps_off:>6}/{steps_on:<6} {acc:>8}/{prop:<9}{same}")


if __name__ == "__main__":
    main()
