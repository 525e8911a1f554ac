"""Serving throughput and latency of `baton serve`, against a baseline checkout, in one run.

For each tree (this checkout, and with --baseline a worktree of another commit), start `baton serve`
with its defaults on a free port, run `baton bench serve` at each concurrency (streaming
completions, prompts 50-200 tokens, exactly 128 output tokens, ignore_eos, greedy), stop the server,
and print one table with the ratios. Trees alternate per concurrency level only through their order
in the run; the machine's load average is printed before and after.

    git worktree add /tmp/baton-base d084efe
    python benchmarks/bench_serving.py --baseline /tmp/baton-base
    python benchmarks/bench_serving.py --concurrency 1,16 --prompts-per-level 2   # quicker

Both trees run with this checkout's virtualenv (the baseline's own packages are put first on
PYTHONPATH, so its code is what runs).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(tree: Path, port: int, extra: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(tree))
    log = open(tempfile.mktemp(prefix=f"serve-{tree.name}-", suffix=".log"), "w")
    # where the CLI lives in the tree: baton/cli/cli.py (now), baton/ops/cli.py (before the layers), or
    # baton/cli.py (d084efe and earlier)
    if (tree / "baton" / "cli" / "cli.py").exists():
        cli = "baton.cli.cli"
    elif (tree / "baton" / "ops" / "cli.py").exists():
        cli = "baton.ops.cli"
    else:
        cli = "baton.cli"
    proc = subprocess.Popen([sys.executable, "-m", cli, "serve", "--port", str(port), *extra],
                            cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"baton serve in {tree} exited with {proc.returncode}; see {log.name}")
        if "Baton is serving" in Path(log.name).read_text():
            return proc
        time.sleep(0.5)
    raise TimeoutError(f"baton serve in {tree} did not become ready; see {log.name}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


def bench(port: int, concurrency: int, num_prompts: int, out_dir: Path, tag: str) -> dict:
    name = f"{tag}-c{concurrency}.json"
    cmd = [sys.executable, "-m", "baton.cli.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
           "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
           "--random-input-len", "125", "--random-range-ratio", "0.6", "--random-output-len", "128",
           "--random-output-range-ratio", "0", "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out_dir),
           "--result-filename", name, "--disable-tqdm", "--seed", str(concurrency)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return json.loads((out_dir / name).read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, default=None, help="a checkout of the baseline commit")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--prompts-per-level", type=float, default=2.0,
                        help="requests per level = max(6, this x concurrency)")
    parser.add_argument("--serve-args", default="", help="extra flags for baton serve (both trees)")
    parser.add_argument("--result-dir", type=Path, default=Path(tempfile.mkdtemp(prefix="bench-serving-")))
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    trees = [("baton", ROOT)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_engine import cpu_model, loadavg

    print(f"CPU: {cpu_model()}; {loadavg()}", flush=True)
    results: dict[str, dict[int, dict]] = {}
    for tag, tree in trees:
        port = free_port()
        proc = start_server(tree, port, args.serve_args.split())
        try:
            # one short warm-up request (first-call costs are not the server's steady state)
            urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", method="POST",
                data=json.dumps({"prompt": "Hello", "max_tokens": 4}).encode(),
                headers={"content-type": "application/json"}), timeout=300).read()
            for c in levels:
                n = max(6, int(args.prompts_per_level * c))
                results.setdefault(tag, {})[c] = r = bench(port, c, n, args.result_dir, tag)
                print(f"{tag:>8} c={c:<3} {r['output_throughput']:7.1f} out tok/s  TTFT p50 {r['median_ttft_ms']:7.0f} ms  "
                      f"ITL p50 {r['median_itl_ms']:6.1f} ms  TPOT p50 {r['median_tpot_ms']:6.1f} ms  "
                      f"({r['completed']} requests)", flush=True)
        finally:
            stop_server(proc)
    print(f"\nafter: {loadavg()}\n")
    print("| concurrency | " + " | ".join(f"{t} tok/s" for t, _ in trees)
          + (" | ratio | ITL p50 baton / baseline ms | TTFT p50 baton / baseline ms |" if len(trees) > 1 else
             " | ITL p50 ms | TTFT p50 ms |"))
    print("| --- " * (1 + len(trees) + (3 if len(trees) > 1 else 2)) + "|")
    for c in levels:
        row = [f"{results[t][c]['output_throughput']:.1f}" for t, _ in trees]
        b = results["baton"][c]
        if len(trees) > 1:
            base = results["baseline"][c]
            row += [f"{b['output_throughput'] / base['output_throughput']:.2f}x",
                    f"{b['median_itl_ms']:.1f} / {base['median_itl_ms']:.1f}",
                    f"{b['median_ttft_ms']:.0f} / {base['median_ttft_ms']:.0f}"]
        else:
            row += [f"{b['median_itl_ms']:.1f}", f"{b['median_ttft_ms']:.0f}"]
        print(f"| {c} | " + " | ".join(row) + " |")
    print(f"\n(results: {args.result_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
