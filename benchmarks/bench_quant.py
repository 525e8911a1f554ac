"""Decode steps with quantized weights against bf16, on the same model, in one run.

For each thread count, load the model once per `--quantization` (bf16 = none, int8, int4, auto: a
GGUF's own blocks), bring B requests into pure decode (context ~256 tokens) and time engine steps at
each batch size; print the median step, the ratio to bf16, and each one's step against the floor of
the weight bytes it reads (the machine's read bandwidth, measured in the same run: bench_engine's
`measure_bandwidth`).

    python benchmarks/bench_quant.py                      # default model (its GGUF: auto = Q4_1), 1 and 2 threads
    python benchmarks/bench_quant.py --model x.gguf --threads 2 --batches 1,4,16 --schemes none,auto
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_engine import (cpu_model, loadavg, measure_bandwidth, measure_decode_steps,  # noqa: E402
                                     measure_prefill)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads for the projections and the head (their current ops)."""
    from baton.model.linear import QuantizedLinear

    total = 0
    for owner, name, linear in model.projection_slots():
        op = getattr(owner, name)
        total += op.nbytes if isinstance(op, QuantizedLinear) else linear.weight.numel() * linear.weight.element_size()
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: the default model)")
    parser.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    parser.add_argument("--batches", default="1,4,16,64", help="decode batch sizes (default 1,4,16,64)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--schemes", default="none,int8,int4,auto", help="--quantization values (none first)")
    parser.add_argument("--prefill", type=int, default=0,
                        help="also time the step that prefills one prompt of this many tokens (0: no)")
    parser.add_argument("--dtype", default="bfloat16",
                        help="the model's dtype (float32 is what `auto` serves on a CPU without AVX512-BF16)")
    args = parser.parse_args(argv)

    from baton.llm import LLM
    from baton.common.model_files import resolve_model

    model_dir = resolve_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"model {model_dir.name} in {args.dtype}; CPU: {cpu_model()}; torch {torch.__version__}")
    print(f"before: {loadavg()}")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        bandwidth = measure_bandwidth()[0]  # with this many threads (torch.sum uses them)
        rows, prefill = {}, {}
        schemes = args.schemes.split(",")
        for quantization in schemes:
            llm = LLM(model=str(model_dir), dtype=args.dtype, max_num_seqs=max(batches), num_threads=threads,
                      quantization=quantization, enable_prefix_caching=False,
                      num_kv_blocks=max(batches) * (args.context // 16 + args.repeats // 16 + 8) + 8)
            name = f"{quantization}={llm.engine.quantization}" if quantization == "auto" else quantization
            steps = measure_decode_steps(llm.engine, batches, args.context, args.repeats, seed=0)
            rows[name] = ({b: statistics.median(t) for b, t in steps.items()}, weight_bytes(llm.engine.runtime.model))
            if args.prefill:
                prefill[name] = statistics.median(measure_prefill(llm.engine, args.prefill, 5, seed=1))
            del llm
        print(f"\n{threads} thread(s); read bandwidth {bandwidth / 1e9:.1f} GB/s")
        print("weights per step: " + ", ".join(f"{n} {nbytes / 1e6:.0f} MB (floor {nbytes / bandwidth * 1e3:.2f} ms)"
                                                for n, (_, nbytes) in rows.items()))
        base = next(iter(rows))
        print("| batch | " + " | ".join(f"{n} ms" for n in rows) + " | "
              + " | ".join(f"{n} / {base}" for n in list(rows)[1:]) + " | "
              + " | ".join(f"{n} / floor" for n in rows) + " |")
        print("| --- " * (1 + 3 * len(rows) - 1) + "|")
        for b in batches:
            steps_ms = [f"{r[b] * 1e3:.2f}" for r, _ in rows.values()]
            ratios = [f"{r[b] / rows[base][0][b]:.2f}" for r, _ in list(rows.values())[1:]]
            floors = [f"{r[b] / (nbytes / bandwidth):.2f}" for r, nbytes in rows.values()]
            print(f"| {b} | " + " | ".join(steps_ms + ratios + floors) + " |")
        if prefill:
            print(f"prefill of {args.prefill} tokens (median of 5): "
                  + ", ".join(f"{n} {t * 1e3:.0f} ms" for n, t in prefill.items()))
    print(f"\nafter: {loadavg()}")


if __name__ == "__main__":
    main()
