"""Decode steps with int8 weights (`--quantization int8`) against bf16, on the same model, in one run.

For each thread count, load the model twice (bf16, then int8 weights), bring B requests into pure
decode (context ~256 tokens) and time engine steps at each batch size; print the median step, the
ratio int8 / bf16, and each one's weight bytes per step against the machine's floor (its measured
read bandwidth, in the same run: bench_engine's `measure_bandwidth`).

    python benchmarks/bench_quant.py                      # default model, 1 and 2 threads
    python benchmarks/bench_quant.py --model DIR --threads 2 --batches 1,4,16
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_engine import cpu_model, loadavg, measure_bandwidth, measure_decode_steps  # noqa: E402


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads for the projections and the head (their current ops)."""
    from baton.engine.linear import QuantizedLinear

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
    args = parser.parse_args(argv)

    from baton.llm import LLM
    from baton.common.model_files import resolve_model

    model_dir = resolve_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"model {model_dir.name}; CPU: {cpu_model()}; torch {torch.__version__}")
    print(f"before: {loadavg()}")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        bandwidth = measure_bandwidth()[0]  # with this many threads (torch.sum uses them)
        rows = {}
        for quantization in ("none", "int8"):
            llm = LLM(model=str(model_dir), dtype="bfloat16", max_num_seqs=max(batches), num_threads=threads,
                      quantization=quantization, enable_prefix_caching=False,
                      num_kv_blocks=max(batches) * (args.context // 16 + args.repeats // 16 + 8) + 8)
            steps = measure_decode_steps(llm.engine, batches, args.context, args.repeats, seed=0)
            rows[quantization] = ({b: statistics.median(t) for b, t in steps.items()}, weight_bytes(llm.engine.model))
            del llm
        print(f"\n{threads} thread(s); read bandwidth {bandwidth / 1e9:.1f} GB/s")
        (bf16, bf16_bytes), (int8, int8_bytes) = rows["none"], rows["int8"]
        print(f"weights per step: bf16 {bf16_bytes / 1e6:.0f} MB (floor {bf16_bytes / bandwidth * 1e3:.2f} ms), "
              f"int8 {int8_bytes / 1e6:.0f} MB (floor {int8_bytes / bandwidth * 1e3:.2f} ms)")
        print("| batch | bf16 step ms | int8 step ms | int8 / bf16 | bf16 / floor | int8 / floor |")
        print("| --- | --- | --- | --- | --- | --- |")
        for b in batches:
            print(f"| {b} | {bf16[b] * 1e3:.2f} | {int8[b] * 1e3:.2f} | {int8[b] / bf16[b]:.2f} | "
                  f"{bf16[b] / (bf16_bytes / bandwidth):.2f} | {int8[b] / (int8_bytes / bandwidth):.2f} |")
    print(f"\nafter: {loadavg()}")


if __name__ == "__main__":
    main()
