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
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_engine import cpu_model  # noqa: E402
from benchmarks.bench_serving import free_port, start_server, stop_server, warm_up  # noqa: E402
from benchmarks.bench_spec_serve import bench  # noqa: E402

FIGURES = ("median_itl_ms", "median_tpot_ms", "median_ttft_ms", "p99_ttft_ms", "output_throughput")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,4,16,64", help="client counts")
    parser.add_argument("--serve-args", default="", help="extra flags for both servers")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the levels (median reported)")
    args = parser.parse_args()
    levels = [int(c) for c in args.levels.split(",")]
    out_dir = Path(tempfile.mkdtemp(prefix="bench-cores-"))
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; load average {os.getloadavg()}", flush=True)
    results: dict[tuple[str, int], list[dict]] = {}
    servers = {}
    try:  # both up at once (an idle server costs little), so the two alternate at every level
        for tag, extra in (("off", ["--no-core-share"]), ("on", [])):
            port = free_port()
            servers[tag] = (port, start_server(ROOT, port, args.serve_args.split() + extra))
            warm_up(port)
        for round_ in range(args.rounds):
            for c in levels:
                for tag in (("off", "on") if round_ % 2 == 0 else ("on", "off")):
                    r = bench(servers[tag][0], "random", c, max(2 * c, 6), out_dir, f"{tag}{round_}")
                    results.setdefault((tag, c), []).append(r)
                    print(f"{tag:>3} c={c:<3} ITL p50 {r['median_itl_ms']:6.1f} ms  TTFT p50 {r['median_ttft_ms']:7.1f} ms"
                          f"  {r['output_throughput']:7.1f} out tok/s", flush=True)
    finally:
        for _, proc in servers.values():
            stop_server(proc)
    med = {key: {name: statistics.median(r[name] for r in runs) for name in FIGURES} for key, runs in results.items()}
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
