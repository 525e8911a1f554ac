"""`baton bench sweep`: `bench serve` at several load levels, one CSV row and one point per level."""

from __future__ import annotations

import argparse
import csv
from datetime import datetime
from pathlib import Path
from typing import Any

from baton.cli.bench.metrics import BenchmarkMetrics, parse_percentiles
from baton.cli.bench.serve import benchmark_level, parse_rate, prepare

STATS = ("mean", "median", "p99")
LATENCIES = ("ttft", "tpot", "itl", "e2el")
COLUMNS = ["level", "completed", "failed", "duration", "request_throughput", "output_throughput"] + [
    f"{s}_{m}_ms" for m in LATENCIES for s in STATS]


def parse_levels(args: argparse.Namespace) -> tuple[str, list[Any]]:
    if args.request_rates:
        return "request rate", [parse_rate(x) for x in args.request_rates.split(",") if x.strip()]
    levels = [int(x) for x in (args.concurrency or "1,4,16,64").split(",") if x.strip()]
    if any(c < 1 for c in levels):
        raise SystemExit("--concurrency levels must be >= 1")
    return "concurrency", levels


def row_of(level: Any, m: BenchmarkMetrics) -> dict[str, Any]:
    row: dict[str, Any] = {"level": level, "completed": m.completed, "failed": m.failed, "duration": m.duration,
                           "request_throughput": m.request_throughput, "output_throughput": m.output_throughput}
    for key in LATENCIES:
        dist = m.dists[key]
        p99 = dict(dist.percentiles)[99.0]
        row.update({f"mean_{key}_ms": dist.mean, f"median_{key}_ms": dist.median, f"p99_{key}_ms": p99})
    return row


def format_table(rows: list[dict[str, Any]], kind: str) -> str:
    head = f"{kind:>12} {'ok':>5} {'fail':>5} {'req/s':>8} {'out tok/s':>10} {'med TTFT':>9} {'p99 TTFT':>9} " \
           f"{'med TPOT':>9} {'p99 TPOT':>9} {'med E2EL':>9} {'p99 E2EL':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{str(r['level']):>12} {r['completed']:>5} {r['failed']:>5} {r['request_throughput']:>8.2f} "
                     f"{r['output_throughput']:>10.2f} {r['median_ttft_ms']:>9.1f} {r['p99_ttft_ms']:>9.1f} "
                     f"{r['median_tpot_ms']:>9.1f} {r['p99_tpot_ms']:>9.1f} {r['median_e2el_ms']:>9.1f} "
                     f"{r['p99_e2el_ms']:>9.1f}")
    lines.append("(latencies in ms)")
    return "\n".join(lines)


def run_sweep(args: argparse.Namespace) -> int:
    kind, levels = parse_levels(args)
    # The table and CSV always carry p99 and every latency metric, whatever the per-level block shows.
    wanted = parse_percentiles(args.metric_percentiles)
    args.metric_percentiles = ",".join(str(p) for p in sorted(set(wanted) | {99.0}))
    tokenizer, model, requests = prepare(args)  # one workload, reused at every level
    base_name = args.result_filename
    args.result_filename = None  # per-level JSON / plots get vLLM's default names
    rows = []
    for level in levels:
        print(f"\n### {kind} {level}", flush=True)
        if kind == "concurrency":
            rate, conc = args.request_rate, level
        else:
            rate, conc = level, args.max_concurrency
        metrics, _ = benchmark_level(args, tokenizer, model, requests, rate, conc)
        rows.append(row_of(level, metrics))
    out_dir = Path(args.result_dir or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    stem = Path(base_name).stem if base_name else \
        f"sweep-{kind.replace(' ', '-')}-{model.split('/')[-1]}-{date}"
    csv_path = out_dir / f"{stem}.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    from baton.cli.bench.plots import plot_sweep

    png_path = plot_sweep(rows, kind, args.sweep_latency, out_dir / f"{stem}.png")
    print("\n" + format_table(rows, kind))
    print(f"Saved {csv_path}\nSaved {png_path}")
    return 0 if all(r["completed"] > 0 for r in rows) else 1
