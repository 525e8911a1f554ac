"""The native matmuls alone, per projection shape and row count: Q8_0 and 4-bit (`qgemv`) against
the bf16 native kernel (`RowSplitLinear`, AMX or AVX512-BF16), in one run, on the default model's
shapes (SmolLM2-135M: q|k|v 960 x 576, o 576 x 576, gate|up 3072 x 576, down 576 x 1536, the head
49152 x 576). Prints the best of `--repeats` calls and the multiply-accumulates per second; with
`--activations` also the time of quantizing the activations alone (`quantize_activations`), the
part of a qgemv call that does not depend on N.

    python benchmarks/bench_qgemv.py                     # 1 thread, rows 1, 16, 64
    python benchmarks/bench_qgemv.py --threads 2 --rows 1,4,16,64,256 --activations
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_engine import cpu_model, loadavg  # noqa: E402

SHAPES = [("q|k|v", 960, 576), ("o", 576, 576), ("gate|up", 3072, 576), ("down", 576, 1536), ("head", 49152, 576)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--activations", action="store_true", help="also time the activation quantization alone")
    args = parser.parse_args()

    from baton.model import kernels
    from baton.model.linear import QuantizedLinear, RowSplitLinear, best_seconds
    from baton.model.quant import quantize_q4, quantize_q8_0

    native = kernels.load()
    if native is None or not native.q8_available():
        raise SystemExit("the native integer kernel is not available on this CPU")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"CPU: {cpu_model()}; {loadavg()}; {args.threads} thread(s); integer dot: {native.qgemv_isa()}, "
          f"bf16: {native.gemv_kernel('')}")
    print("| projection | rows | Q8_0 us | 4-bit us | bf16 us | Q8_0 GMAC/s | 4-bit GMAC/s | bf16 GMAC/s |"
          + (" activations us |" if args.activations else ""))
    print("| --- " * (8 + args.activations) + "|")
    for name, n, k in SHAPES:
        weight = torch.randn(n, k) * 0.02
        q8 = QuantizedLinear.q8_0(*quantize_q8_0(weight), None, native)
        q4 = QuantizedLinear.q4(*quantize_q4(weight), None, native)
        bf16 = RowSplitLinear(weight.bfloat16(), None, native) if native.gemv_available() else None
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            times = [best_seconds(lambda op=op: op(x), args.repeats) for op in (q8, q4)]
            times.append(best_seconds(lambda: bf16(x), args.repeats) if bf16 is not None else float("nan"))
            macs = m * n * k
            row = [f"{t * 1e6:.1f}" for t in times] + [f"{macs / t / 1e9:.0f}" for t in times]
            if args.activations:
                row.append(f"{best_seconds(lambda: native.quantize_activations(x, 128), args.repeats) * 1e6:.1f}")
            print(f"| {name} {n}x{k} | {m} | " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
