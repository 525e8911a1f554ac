"""Speculative decoding through `baton serve`, against speculation off, in one run (issue #25's goals).

Two servers up at once (`baton serve` defaults, and the same with `--speculative-config`); at each
level `baton bench serve` runs against one then the other (the order alternating by round), on two
workloads, greedy, ignore_eos, 128 output tokens; the median over `--rounds` is reported:
- grounded (`--dataset-name grounded`: chat prompts asking to repeat or rewrite a passage) at 1 and 4
  clients: where prompt lookup pays;
- random (`--dataset-name random`, prompts 50-200 tokens) at 1 and 64 clients: where it must not lose.
Prints per level the per-token latency (TPOT p50: (last token - first token) / (tokens - 1), what a
streaming reader sees per token; bench serve's ITL is per chunk, and an accepted run arrives as one
chunk of several tokens), ITL p50 and output tok/s, and the ratios off / on (> 1: speculation is faster).

    python benchmarks/bench_spec_serve.py
    python benchmarks/bench_spec_serve.py --spec '{"method": "ngram", "num_speculative_tokens": 6}'
    python benchmarks/bench_spec_serve.py --quick       # fewer prompts per level
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.ab_serve import measure  # noqa: E402
from benchmarks.bench_engine import cpu_model  # noqa: E402
from benchmarks.bench_serving import baton_target, stop_server  # noqa: E402

LEVELS = [("grounded", 1), ("grounded", 4), ("random", 1), ("random", 64)]


def bench(port: int, dataset: str, concurrency: int, num_prompts: int, out_dir: Path, tag: str,
          seed: int = 0) -> dict:
    name = f"{tag}-{dataset}-c{concurrency}.json"
    cmd = [sys.executable, "-m", "baton.cli.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
           "--dataset-name", dataset, "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
           "--request-rate", "inf", "--random-input-len", "125", "--random-range-ratio", "0.6",
           "--random-output-len", "128", "--random-output-range-ratio", "0", "--ignore-eos",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result",
           "--result-dir", str(out_dir), "--result-filename", name, "--disable-tqdm", "--seed",
           str(concurrency + 1000 * seed)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return json.loads((out_dir / name).read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 4}',
                        help="the --speculative-config of the second server")
    parser.add_argument("--serve-args", default="", help="extra flags for both servers")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the levels (median reported)")
    args = parser.parse_args()
    out_dir = Path(tempfile.mkdtemp(prefix="bench-spec-"))
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; load average {os.getloadavg()}", flush=True)

    def run(port: int, case: tuple[str, int], round_: int, label: str) -> dict:
        dataset, c = case
        return bench(port, dataset, c, max(2 * c, 8) if not args.quick else max(c, 2), out_dir, label, seed=round_)

    serve_args = args.serve_args.split()
    med = measure([baton_target("off", ROOT, serve_args),
                   baton_target("on", ROOT, serve_args + ["--speculative-config", args.spec])], LEVELS, args.rounds,
                  run=run, stop=stop_server,
                  describe=lambda tag, case, r: f"{tag:>3} {case[0]:>8} c={case[1]:<3} TPOT p50 "
                                                f"{r['median_tpot_ms']:6.1f} ms  ITL p50 {r['median_itl_ms']:6.1f} ms  "
                                                f"{r['output_throughput']:7.1f} out tok/s")
    print(f"\nspeculation: {args.spec}\n")
    print("| workload | clients | TPOT p50 off / on (ms) | ratio | ITL p50 off / on (ms) | tok/s off / on | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for dataset, c in LEVELS:
        off, on = med[("off", dataset, c)], med[("on", dataset, c)]
        print(f"| {dataset} | {c} | {off['median_tpot_ms']:.1f} / {on['median_tpot_ms']:.1f} | "
              f"{off['median_tpot_ms'] / on['median_tpot_ms']:.2f}x | {off['median_itl_ms']:.1f} / "
              f"{on['median_itl_ms']:.1f} | {off['output_throughput']:.1f} / {on['output_throughput']:.1f} | "
              f"{on['output_throughput'] / off['output_throughput']:.2f}x |")
    print(f"\nload average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
