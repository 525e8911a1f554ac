"""Serving throughput and latency of `baton serve`, against a baseline checkout, in one run.

For each tree (this checkout, and with --baseline a worktree of another commit), start `baton serve`
with its defaults on a free port, run `baton bench serve` at each concurrency (streaming
completions, prompts 50-200 tokens, exactly 128 output tokens (--output-len), ignore_eos, greedy), stop the server,
and print one table with the ratios. Both servers are up at once and at each concurrency level the
bench runs against one then the other (with --rounds N, N passes, the order reversed every other
pass, the median reported: benchmarks/ab_serve.py); the machine's load average is printed before
and after.

    git worktree add /tmp/baton-base d084efe
    python benchmarks/bench_serving.py --baseline /tmp/baton-base
    python benchmarks/bench_serving.py --concurrency 1,16 --prompts-per-level 2   # quicker

Both trees run with this checkout's virtualenv (the baseline's own packages are put first on
PYTHONPATH, so its code is what runs).

With --llama-server BIN the baseline is llama.cpp's server on a GGUF (--gguf, default: the default
model's own file, the one `baton serve` serves by default), started anew for each level with one
slot per client (`-np C`, 512 tokens of context each) and `-t` the machine's cores, as llama-server
users run it; `baton serve` keeps its defaults (add `--serve-args "--model FILE"` for another GGUF):

    python benchmarks/bench_serving.py --llama-server /tmp/llamabuild/bin/llama-server
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
sys.path.insert(0, str(ROOT))

from benchmarks.ab_serve import Server, Target, measure  # noqa: E402


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


def start_llama_server(binary: Path, gguf: Path, port: int, slots: int, context: int | None = None) -> subprocess.Popen:
    """llama-server with `slots` slots and `context` tokens in all (default: 512 per slot)."""
    log = open(tempfile.mktemp(prefix="llama-server-", suffix=".log"), "w")
    proc = subprocess.Popen([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                             "-t", str(os.cpu_count() or 1), "-np", str(slots), "-c", str(context or 512 * slots)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}; see {log.name}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"llama-server did not become ready; see {log.name}")


def warm_up(port: int) -> None:
    """One short request: first-call costs are not a server's steady state."""
    urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", method="POST",
        data=json.dumps({"prompt": "Hello", "max_tokens": 4}).encode(),
        headers={"content-type": "application/json"}), timeout=300).read()


def describe(tag: str, c: int, r: dict) -> str:
    return (f"{tag:>10} c={c:<3} {r['output_throughput']:7.1f} out tok/s  TTFT p50 {r['median_ttft_ms']:7.0f} ms  "
            f"ITL p50 {r['median_itl_ms']:6.1f} ms  TPOT p50 {r['median_tpot_ms']:6.1f} ms  ({r['completed']} requests)")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


def bench(port: int, concurrency: int, num_prompts: int, out_dir: Path, tag: str, seed: int = 0,
          output_len: int = 128) -> dict:
    name = f"{tag}-c{concurrency}.json"
    cmd = [sys.executable, "-m", "baton.cli.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
           "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
           "--random-input-len", "125", "--random-range-ratio", "0.6", "--random-output-len", str(output_len),
           "--random-output-range-ratio", "0", "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out_dir),
           "--result-filename", name, "--disable-tqdm", "--seed", str(concurrency + 1000 * seed)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return json.loads((out_dir / name).read_text())


def default_gguf() -> Path:
    from baton.common.model_files import gguf_source, resolve_model

    source = gguf_source(resolve_model(None))
    if source is None:
        raise SystemExit("the default model's GGUF is not in the cache: pass --gguf")
    return source


def baton_target(tag: str, tree: Path, serve_args: list[str]) -> Target:
    """`baton serve` from `tree` with its defaults plus `serve_args`, up for the whole run."""
    def start(_case: object) -> Server:
        port = free_port()
        proc = start_server(tree, port, serve_args)
        warm_up(port)
        return port, proc
    return Target(tag, start)


def llama_target(binary: Path, gguf: Path) -> Target:
    """llama-server on `gguf`, started anew for each client count (one slot per client)."""
    def start(clients: object) -> Server:
        port = free_port()
        proc = start_llama_server(binary, gguf, port, int(clients))
        try:
            warm_up(port)
        except BaseException:
            stop_server(proc)
            raise
        return port, proc
    return Target("baseline", start, per_case=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, default=None, help="a checkout of the baseline commit")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--prompts-per-level", type=float, default=2.0,
                        help="requests per level = max(6, this x concurrency)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="passes at each level, the order of the two alternating (median reported)")
    parser.add_argument("--serve-args", default="", help="extra flags for baton serve (both trees)")
    parser.add_argument("--result-dir", type=Path, default=Path(tempfile.mkdtemp(prefix="bench-serving-")))
    parser.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary: the baseline")
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF llama-server serves (default: the default model's)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request (exactly, ignore_eos)")
    args = parser.parse_args()
    if args.baseline is not None and args.llama_server is not None:
        parser.error("one baseline: --baseline or --llama-server")
    levels = [int(c) for c in args.concurrency.split(",")]
    serve_args = args.serve_args.split()
    if args.gguf is not None and "--model" not in serve_args:
        serve_args += ["--model", str(args.gguf)]  # both servers on the one file (else baton serves its default)
    targets = [baton_target("baton", ROOT, serve_args)]
    if args.baseline is not None:
        targets.append(baton_target("baseline", args.baseline.resolve(), serve_args))
    if args.llama_server is not None:
        gguf = args.gguf or default_gguf()
        print(f"llama-server on {gguf.name}", flush=True)
        targets.append(llama_target(args.llama_server, gguf))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_engine import cpu_model, loadavg

    print(f"CPU: {cpu_model()}; {loadavg()}", flush=True)
    results = measure(targets, levels, args.rounds,
                      run=lambda port, c, round_, label: bench(port, c, max(6, int(args.prompts_per_level * c)),
                                                               args.result_dir, label, seed=round_,
                                                               output_len=args.output_len),
                      describe=describe, stop=stop_server)
    print(f"\nafter: {loadavg()}\n")
    tags = [t.tag for t in targets]
    print("| concurrency | " + " | ".join(f"{t} tok/s" for t in tags)
          + (" | ratio | ITL p50 baton / baseline ms | TTFT p50 baton / baseline ms |" if len(tags) > 1 else
             " | ITL p50 ms | TTFT p50 ms |"))
    print("| --- " * (1 + len(tags) + (3 if len(tags) > 1 else 2)) + "|")
    for c in levels:
        row = [f"{results[(t, c)]['output_throughput']:.1f}" for t in tags]
        b = results[("baton", c)]
        if len(tags) > 1:
            base = results[("baseline", c)]
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
