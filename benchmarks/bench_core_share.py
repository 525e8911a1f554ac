"""Cores lent by an idle prefill worker (`baton serve` default) against each worker on its own
threads (`--no-core-share`), in one run (issue #23, item 5: cores at low load).

Two servers up at once; at each level `baton bench serve` runs against one then the other (the
order alternating by round): random prompts of 50-200 tokens, 128 output tokens, greedy,
ignore_eos, at 1, 4, 16 and 64 clients. Prints per level ITL p50, TPOT p50, TTFT p50 / p99 and output
tok/s of both and the ratios (ITL off / on > 1 and tok/s on / off > 1: lending is faster); the median
over `--rounds`. Lending must win at 1-4 clients and change nothing at 16 and 64 (TTFT included).

    python benchmarks/bench_core_share.py
    python benchmarks/bench_core_share.py --levels 1,4 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.ab_serve import measure  # noqa: E402
from benchmarks.bench_engine import cpu_model  # noqa: E402
from benchmarks.bench_serving import baton_target, stop_server  # noqa: E402
from benchmarks.bench_spec_serve import bench  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,4,16,64", help="client counts")
    parser.add_argument("--serve-args", default="", help="extra flags for both servers")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the levels (median reported)")
    args = parser.parse_args()
    levels = [int(c) for c in args.levels.split(",")]
    out_dir = Path(tempfile.mkdtemp(prefix="bench-cores-"))
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; load average {os.getloadavg()}", flush=True)
    serve_args = args.serve_args.split()
    targets = [baton_target("off", ROOT, serve_args + ["--no-core-share"]), baton_target("on", ROOT, serve_args)]
    med = measure(targets, levels, args.rounds,
                  run=lambda port, c, round_, label: bench(port, "random", c, max(2 * c, 6), out_dir, label, seed=round_),
                  describe=lambda tag, c, r: f"{tag:>3} c={c:<3} ITL p50 {r['median_itl_ms']:6.1f} ms  TTFT p50 "
                                             f"{r['median_ttft_ms']:7.1f} ms  {r['output_throughput']:7.1f} out tok/s",
                  stop=stop_server)
    print("\n| clients | ITL p50 off / on (ms) | ratio | TTFT p50 off / on (ms) | TTFT p99 off / on (ms) "
          "| tok/s off / on | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c in levels:
        off, on = med[("off", c)], med[("on", c)]
        print(f"| {c} | {off['median_itl_ms']:.1f} / {on['median_itl_ms']:.1f} | "
              f"{off['median_itl_ms'] / on['median_itl_ms']:.2f}x | {off['median_ttft_ms']:.0f} / "
              f"{on['median_ttft_ms']:.0f} | {off['p99_ttft_ms']:.0f} / {on['p99_ttft_ms']:.0f} | "
              f"{off['output_throughput']:.1f} / {on['output_throughput']:.1f} | "
              f"{on['output_throughput'] / off['output_throughput']:.2f}x |")
    print(f"\nload average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
