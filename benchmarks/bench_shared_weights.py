"""Memory of N worker engines on one machine, with and without the shared packed weights (issue 42, item 3).

N processes each build the engine as a worker does (`baton.worker.shell.build_engine`: load, prepare,
quantize, release the load-time copies), serve one request (a 16-token prompt, 4 tokens: a mapped page
counts in PSS only once read, and a serving worker has read every weight) and then wait; once all
are ready, each one's PSS (proportional set size: a page mapped by k processes counts 1/k in each)
is read from `/proc/PID/smaps_rollup`, split into anonymous (the process's own: copies, KV pool,
activations) and file-backed (the page cache's: shared packed weights, the GGUF, libraries). Two rounds:
`BATON_PACKED_CACHE=off` (before: every worker repacks the GGUF's blocks into its own memory) and on
(after: one packed file per machine, mapped read-only by every worker; baton.model.packed_cache).
The sum is printed beside the GGUF file's size.

A third round loads N workers of a tiny Q8_0 GGUF (make_random_model.py's `--tiny --gguf q8_0`: 2
layers of hidden 64, the same vocabulary and tokenizer) in the same way: its PSS per worker less its
KV pool is a worker's fixed cost (interpreter, torch, kernels, tokenizer, buffers; the tiny model's
own 5 MB included). The run ends with issue 42's criterion, for each round (it asks it of the shared one):
total PSS <= 1.2 x the file's size + the workers' KV pools (each engine's `kv_cache_bytes`) + N x the
fixed cost. `--workers 4` stands for one prefill and three decode workers (the same engine build);
`--kv-blocks` takes one count for all or one per worker (e.g. 256,64,64,64) where their pools differ.

    python benchmarks/bench_shared_weights.py                       # the default model, 2 workers
    python benchmarks/make_random_model.py --gguf q8_0 /tmp/llama-1b-shapes.Q8_0.gguf
    python benchmarks/bench_shared_weights.py --model /tmp/llama-1b-shapes.Q8_0.gguf --workers 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import argparse, json, sys
from baton.common.sampling_params import SamplingParams
from baton.worker.shell import build_engine
args = argparse.Namespace(model=sys.argv[1], dtype="bfloat16", device=None, block_size=16,
                          num_kv_blocks=int(sys.argv[2]), kv_cache_memory=0, max_num_seqs=16,
                          max_num_batched_tokens=512, threads=1, quantization="auto", kv_cache_dtype="auto",
                          scheduler_policy="max-utilization", speculative_config=None)
engine = build_engine(args)
# One request, prefill and decode, before the reading: a mapped weight is in a process's PSS only once
# read, and a serving worker has read every weight.
engine.add_request("warm-up", list(range(1, 17)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
while engine.has_unfinished():
    engine.step()
print(json.dumps({"scheme": engine.quantization, "kv_cache_bytes": engine.kv_cache_bytes}), flush=True)
sys.stdin.read()  # held until the parent has read every worker's memory
"""


def smaps_rollup_kb(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0])
    return out


@dataclass
class Worker:
    rollup: dict[str, int]  # smaps_rollup, kB
    kv_cache_bytes: int  # the engine's KV pool


def measure(model_dir: Path, kv_blocks: list[int], shared: bool) -> list[Worker]:
    """One worker per entry of `kv_blocks` (its pool), loaded at once; their memory once all are loaded."""
    env = {**os.environ, "BATON_PACKED_CACHE": "on" if shared else "off", "TOKENIZERS_PARALLELISM": "false"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(model_dir), str(blocks)], cwd=ROOT, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for blocks in kv_blocks]
    try:
        reports = []
        for proc in procs:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"a worker exited with {proc.wait()} before it was loaded")
            reports.append(json.loads(line))
        return [Worker(smaps_rollup_kb(proc.pid), report["kv_cache_bytes"]) for proc, report in zip(procs, reports)]
    finally:
        for proc in procs:
            proc.stdin.close()
            proc.wait(timeout=60)


def table_row(label: str, workers: list[Worker], file_bytes: int) -> str:
    total = sum(w.rollup["Pss"] for w in workers) / 1024
    column = lambda key: ", ".join(f"{w.rollup.get(key, 0) / 1024:.0f}" for w in workers)
    return (f"| {label} | {column('Pss')} | {column('Pss_Anon')} | {column('Pss_File')} | {total:.0f} "
            f"| {total * 1024 * 1024 / file_bytes:.2f} |")


def pss_bytes(workers: list[Worker]) -> int:
    return sum(w.rollup["Pss"] for w in workers) * 1024


def kv_blocks_per_worker(spec: str, workers: int) -> list[int]:
    counts = [int(x) for x in spec.split(",")]
    if len(counts) == 1:
        return counts * workers
    if len(counts) != workers:
        raise SystemExit(f"--kv-blocks gives {len(counts)} counts for {workers} workers")
    return counts


def tiny_gguf() -> Path:
    """make_random_model.py's tiny Q8_0 GGUF, the fixed-cost reference, written once by the same writer to
    a fixed path in the cache (its converted directory names that path, so it must stay)."""
    from make_random_model import write_q8_0_gguf

    from baton.common.model_files import cache_root

    path = cache_root() / "bench" / "llama-tiny-random.Q8_0.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_q8_0_gguf(path.with_suffix(".tmp"), tiny=True, seed=0)
        path.with_suffix(".tmp").replace(path)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="",
                        help="a .gguf, or a model directory made from one (default: the default model)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kv-blocks", default="64",
                        help="each worker's KV pool, in blocks of 16 tokens: one count, or one per worker")
    parser.add_argument("--fixed-model", default="",
                        help="the tiny GGUF whose workers give the fixed cost (default: written once to $BATON_CACHE/bench)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_engine import cpu_model

    from baton.common.model_files import gguf_source, resolve_model

    kv_blocks = kv_blocks_per_worker(args.kv_blocks, args.workers)
    model_dir = resolve_model(args.model or None)
    source = gguf_source(model_dir)
    if source is None:
        print(f"{model_dir} was not made from a GGUF: nothing to share", file=sys.stderr)
        return 2
    file_bytes = source.stat().st_size
    tiny_dir = resolve_model(args.fixed_model or tiny_gguf())
    tiny_source = gguf_source(tiny_dir)
    print(f"CPU: {cpu_model()}")
    print(f"model: {source.name}, {file_bytes / 2**20:.0f} MB; {args.workers} workers, KV blocks "
          f"{', '.join(map(str, kv_blocks))}; fixed cost from {tiny_source.name}, "
          f"{tiny_source.stat().st_size / 2**20:.1f} MB (MB: 2**20 bytes)")
    print("| packed weights | PSS per worker MB | of which anonymous MB | of which file MB | PSS total MB | "
          "total / file size |")
    print("| --- | --- | --- | --- | --- | --- |")
    rounds = {}
    for shared in (False, True):
        rounds[shared] = measure(model_dir, kv_blocks, shared)
        label = "one shared file (after)" if shared else "one copy per worker (before)"
        print(table_row(label, rounds[shared], file_bytes), flush=True)
    tiny = measure(tiny_dir, kv_blocks, shared=True)
    print(table_row(f"tiny model, shared ({tiny_source.name})", tiny, tiny_source.stat().st_size), flush=True)
    fixed = (pss_bytes(tiny) - sum(w.kv_cache_bytes for w in tiny)) / len(tiny)
    kv_pools = sum(w.kv_cache_bytes for w in rounds[True])
    bound = 1.2 * file_bytes + kv_pools + args.workers * fixed
    mb = lambda n: f"{n / 2**20:.0f} MB"
    print(f"fixed cost per worker (tiny model's PSS less its KV pool): {mb(fixed)}; KV pools: "
          f"{', '.join(mb(w.kv_cache_bytes) for w in rounds[True])}")
    for shared, label in ((False, "before"), (True, "after")):
        total = pss_bytes(rounds[shared])
        verdict = "holds" if total <= bound else "does not hold"
        print(f"criterion ({label}): total PSS {mb(total)} <= 1.2 x file {mb(1.2 * file_bytes)} + KV pools "
              f"{mb(kv_pools)} + {args.workers} x fixed {mb(args.workers * fixed)} = {mb(bound)}: {verdict} "
              f"({total / bound:.2f} of the bound)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
