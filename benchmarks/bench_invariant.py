"""What the batch-invariant mode costs here: the native bf16 matmul against oneDNN at every row
count, then the engine's decode steps and a prefill in each `BATON_BATCH_INVARIANT` mode.

    python benchmarks/bench_invariant.py            # this CPU as it is
    python benchmarks/bench_invariant.py --no-amx   # as a CPU without AMX runs: oneDNN limited to
                                                    # AVX512-BF16, the native kernel's AMX path off

Part 1 times the default model's projection shapes (random bf16 weights, each shape's 30 layers in
turn, so weights stream from memory as in a step), 1 thread, best of 3. Part 2 loads the default
model in bf16 and alternates `model.prepare(batch_invariant=mode)` over the rounds (medians of
bench_engine's decode steps at context 256 and of a one-chunk 512-token prefill).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {(576, 576): 60, (192, 576): 60, (1536, 576): 60, (576, 1536): 30}  # [out, in]: count per step (q+o, k+v, gate+up, down)


def best_ms(fn, repeats: int = 3) -> float:
    from baton.model.linear import best_seconds

    return best_seconds(fn, repeats) * 1e3


def matmuls(native, rows: list[int]) -> None:
    import torch

    weights = {shape: [torch.randn(*shape).to(torch.bfloat16) for _ in range(n)] for shape, n in SHAPES.items()}
    print("| M | native | oneDNN | native / oneDNN |\n| --- | --- | --- | --- |")
    with torch.inference_mode():
        for m in rows:
            ours = theirs = 0.0
            for (out_features, in_features), ws in weights.items():
                x = torch.randn(m, in_features).to(torch.bfloat16)
                packs = [native.gemv_pack(w) for w in ws]
                onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in ws]
                ours += best_ms(lambda: [native.gemv(x, p, None, out_features, False) for p in packs])
                theirs += best_ms(lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                           for p in onednn])
            print(f"| {m} | {ours:.1f} ms | {theirs:.1f} ms | {ours / theirs:.2f} |", flush=True)


def modes(rounds: int) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_engine import measure_decode_steps, measure_prefill

    from baton.common.model_files import resolve_model
    from baton.llm import LLM

    llm = LLM(model=resolve_model(None), dtype="bfloat16", quantization="none", max_num_seqs=64,
              max_num_batched_tokens=512, num_threads=1, enable_prefix_caching=False)
    engine = llm.engine
    results: dict[str, dict[str, list[float]]] = {}
    for rnd in range(rounds):
        for mode in ("off", "full", "matmul"):
            engine.runtime.model.prepare(batch_invariant=mode)
            timings = results.setdefault(mode, {})
            for batch, seconds in measure_decode_steps(engine, (1, 16, 64), 256, 10, rnd).items():
                timings.setdefault(f"decode batch {batch}", []).extend(seconds)
            timings.setdefault("prefill 512", []).extend(measure_prefill(engine, 512, 3, rnd))
    keys = list(results["off"])
    print("| mode | " + " | ".join(keys) + " |\n|" + " --- |" * (len(keys) + 1))
    for mode, timings in results.items():
        print(f"| {mode} | " + " | ".join(f"{statistics.median(timings[k]) * 1e3:.1f} ms" for k in keys) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-amx", action="store_true", help="run as a CPU without AMX would")
    parser.add_argument("--rows", default="1,4,16,64,256,512")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    if args.no_amx:  # oneDNN reads its variable at first use: set before torch loads; the engines'
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"  # RuntimeConfig.gemv_amx defaults to
        os.environ["BATON_GEMV_AMX"] = "0"  # BATON_GEMV_AMX (the matmuls below pick the kernel themselves)
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_engine import cpu_model

    from baton.model import kernels

    native = kernels.load()
    if native is None or not native.gemv_available():
        print("no native bf16 matmul on this CPU (it needs AVX512-BF16): nothing to compare")
        return 1
    if args.no_amx:
        native.gemv_kernel("avx512bf16")
    torch.set_num_threads(1)
    print(f"CPU: {cpu_model()}; native kernel: {native.gemv_kernel('')}; oneDNN limited to AVX512-BF16: "
          f"{args.no_amx}")
    matmuls(native, [int(r) for r in args.rows.split(",")])
    if not args.skip_engine:
        modes(args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
