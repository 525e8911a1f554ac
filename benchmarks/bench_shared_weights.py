"""Memory of N worker engines on one machine, with and without the shared packed weights (issue 42, item 3).

N processes each build the engine as a worker does (`baton.worker.shell.build_engine`: load, prepare,
quantize, release the load-time copies) and then wait; once all are loaded, each one's PSS
(proportional set size: a page mapped by k processes counts 1/k in each) is read from
`/proc/PID/smaps_rollup`, split into anonymous (the process's own: copies, KV pool, activations) and
file-backed (the page cache's: shared packed weights, the GGUF, libraries). Two rounds:
`BATON_PACKED_CACHE=off` (before: every worker repacks the GGUF's blocks into its own memory) and on
(after: one packed file per machine, mapped read-only by every worker; baton.model.packed_cache).
The sum is printed beside the GGUF file's size.

    python benchmarks/bench_shared_weights.py                       # the default model, 2 workers
    python benchmarks/bench_shared_weights.py --model x.Q8_0.gguf --workers 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import argparse, json, sys
from baton.worker.shell import build_engine
args = argparse.Namespace(model=sys.argv[1], dtype="bfloat16", device=None, block_size=16,
                          num_kv_blocks=int(sys.argv[2]), kv_cache_memory=0, max_num_seqs=16,
                          max_num_batched_tokens=512, threads=1, quantization="auto", kv_cache_dtype="auto",
                          scheduler_policy="max-utilization", speculative_config=None)
engine = build_engine(args)
print(json.dumps({"scheme": engine.quantization}), flush=True)
sys.stdin.read()  # held until the parent has read every worker's memory
"""


def smaps_rollup_kb(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0])
    return out


def measure(model_dir: Path, workers: int, kv_blocks: int, shared: bool) -> list[dict[str, int]]:
    env = {**os.environ, "BATON_PACKED_CACHE": "on" if shared else "off", "TOKENIZERS_PARALLELISM": "false"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(model_dir), str(kv_blocks)], cwd=ROOT, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for _ in range(workers)]
    try:
        for proc in procs:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"a worker exited with {proc.wait()} before it was loaded")
        return [smaps_rollup_kb(proc.pid) for proc in procs]
    finally:
        for proc in procs:
            proc.stdin.close()
            proc.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="",
                        help="a .gguf, or a model directory made from one (default: the default model)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kv-blocks", type=int, default=64, help="each worker's KV pool, in blocks of 16 tokens")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_engine import cpu_model

    from baton.common.model_files import gguf_source, resolve_model

    model_dir = resolve_model(args.model or None)
    source = gguf_source(model_dir)
    if source is None:
        print(f"{model_dir} was not made from a GGUF: nothing to share", file=sys.stderr)
        return 2
    print(f"CPU: {cpu_model()}")
    print(f"model: {source.name}, {source.stat().st_size / 1e6:.0f} MB; {args.workers} workers, "
          f"{args.kv_blocks} KV blocks each")
    print("| packed weights | PSS per worker MB | of which anonymous MB | of which file MB | PSS total MB | "
          "total / file size |")
    print("| --- | --- | --- | --- | --- | --- |")
    for shared in (False, True):
        rollups = measure(model_dir, args.workers, args.kv_blocks, shared)
        total = sum(r["Pss"] for r in rollups) / 1024
        label = "one shared file (after)" if shared else "one copy per worker (before)"
        column = lambda key: ", ".join(f"{r.get(key, 0) / 1024:.0f}" for r in rollups)  # noqa: E731
        print(f"| {label} | {column('Pss')} | {column('Pss_Anon')} | {column('Pss_File')} | {total:.0f} "
              f"| {total * 1024 * 1024 / source.stat().st_size:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
