"""The KV cache formats side by side (`--kv-cache-dtype auto | int8 | fp8`), one process, alternating:
bytes a prompt token holds (and a handoff moves through the block store), blocks a GiB holds, and the
decode step at a few batch sizes.

    .venv/bin/python benchmarks/bench_kv_cache.py [--model M] [--batches 1,16] [--rounds 2]

A step's time is the median of S timed decode steps (`bench_engine.DecodeBatch`), then the median of the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from baton import LLM, SamplingParams  # noqa: E402
from baton.model.model_runner import kv_bytes_per_block  # noqa: E402
from benchmarks.bench_engine import DecodeBatch, cpu_model  # noqa: E402

FORMATS = ("auto", "int8", "fp8")


def decode_ms(llm: LLM, batch: int, context: int, steps: int) -> float:
    """The median decode step of `batch` requests at ~`context` tokens each (bench_engine's DecodeBatch)."""
    db = DecodeBatch(llm.engine, batch, context, steps + 2, seed=batch)
    for _ in range(2):
        db.step()  # the first decode steps at this shape
    times = [db.step() for _ in range(steps)]
    db.close()
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    engines = {kv: LLM(model=args.model, kv_cache_dtype=kv, num_threads=args.threads, enable_prefix_caching=False,
                       kv_cache_memory=1 << 30) for kv in FORMATS}
    for llm in engines.values():
        llm.generate(["warm up"], SamplingParams(max_tokens=4, temperature=0))
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for batch in batches:
            for kv, llm in engines.items():  # alternating: drift hits every format alike
                times.setdefault((kv, batch), []).append(decode_ms(llm, batch, args.context, args.steps))
    print(f"CPU: {cpu_model()}; torch threads {args.threads}; context {args.context}; median of {args.rounds} rounds")
    header = "| cache | bytes / token | blocks / GiB | " + " | ".join(f"step ms, batch {b}" for b in batches) + " |"
    print(header)
    print("|" + " --- |" * (3 + len(batches)))
    base = {b: statistics.median(times[("auto", b)]) for b in batches}
    for kv, llm in engines.items():
        engine = llm.engine
        block = kv_bytes_per_block(engine.model_config, engine.block_size, engine.kv_dtype)
        cells = [f"{statistics.median(times[(kv, b)]):.1f} ({statistics.median(times[(kv, b)]) / base[b]:.2f}x)"
                 for b in batches]
        name = kv if kv != "auto" else f"auto ({str(engine.kv_dtype).removeprefix('torch.')})"
        print(f"| {name} | {block // engine.block_size} | {(1 << 30) // block} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
