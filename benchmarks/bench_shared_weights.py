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

`--weights bf16` measures the same for bf16 weights (workers built with `dtype="bfloat16",
quantization="none"`): where the native bf16 matmul runs, each projection's pack is written once to
`$BATON_CACHE/packed/weights-<key>.bin` and mapped by every worker (baton.model.shared_weights), with
the embedding's table. `--weights float32` does it for float32 weights, what `--dtype auto` loads on a
CPU without bf16 instructions (AMD Zen 3): the weights F.linear reads are what is shared (reference
size 4 x parameters; the fixed cost from the same tiny checkpoint, loaded in float32). The model is
a safetensors directory or a GGUF (dequantized to bf16); the reference size in the criterion is then
the bf16 weights' bytes, 2 x the checkpoint's parameter count (read from the safetensors headers or
the GGUF's tensor list; a tied embedding counted once), and the fixed cost comes from
make_random_model.py's tiny bf16 checkpoint (`--tiny`). A bf16 worker holds the loaded weights and
its packs at once while it loads: `--stagger` starts each worker once the previous one has served its
request, so that their loads do not peak together (the memory is still read once all are ready).
A GGUF's load leaves a worker ~80 MB more anonymous memory than a safetensors one, whatever the model's
size (docs/benchmarks.md, "Shared weights at 1B (bf16)"): `--fixed-model` naming the tiny Q8_0 GGUF
measures the fixed cost through that path.

    python benchmarks/make_random_model.py /tmp/llama-1b-shapes
    python benchmarks/bench_shared_weights.py --model /tmp/llama-1b-shapes --weights bf16 --workers 4 --stagger
"""

from __future__ import annotations

import argparse
import json
import math
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
args = argparse.Namespace(model=sys.argv[1], dtype=sys.argv[4], device=None, block_size=16,
                          num_kv_blocks=int(sys.argv[2]), kv_cache_memory=0, max_num_seqs=16,
                          max_num_batched_tokens=512, threads=1, quantization=sys.argv[3], kv_cache_dtype="auto",
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
    packs: set[Path]  # the shared pack files it maps


def ready_report(proc: subprocess.Popen) -> dict:
    """The worker's line, printed once it has loaded and served its request."""
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"a worker exited with {proc.wait()} before it was loaded")
    return json.loads(line)


def mapped_packs(pid: int) -> set[Path]:
    """The shared pack files (`$BATON_CACHE/packed/*.bin`) the process maps."""
    paths = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and "/packed/" in fields[5] and fields[5].endswith(".bin"):
            paths.add(Path(fields[5]))
    return paths


def measure(model_dir: Path, kv_blocks: list[int], shared: bool, quantization: str = "auto",
            stagger: bool = False, dtype: str = "bfloat16") -> list[Worker]:
    """One worker per entry of `kv_blocks` (its pool), loaded at once (with `stagger`: each once the
    previous one is ready); their memory once all are loaded."""
    env = {**os.environ, "BATON_PACKED_CACHE": "on" if shared else "off", "TOKENIZERS_PARALLELISM": "false"}
    procs: list[subprocess.Popen] = []
    reports = []
    try:
        for blocks in kv_blocks:
            procs.append(subprocess.Popen([sys.executable, "-c", CHILD, str(model_dir), str(blocks), quantization, dtype],
                                          cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True))
            if stagger:
                reports.append(ready_report(procs[-1]))
        if not stagger:
            reports = [ready_report(proc) for proc in procs]
        return [Worker(smaps_rollup_kb(proc.pid), report["kv_cache_bytes"], mapped_packs(proc.pid))
                for proc, report in zip(procs, reports)]
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


def dense_parameter_bytes(model_dir: Path, source: Path | None, width: int = 2) -> int:
    """`width` x the checkpoint's parameter count: the GGUF's tensors, or the safetensors headers' (a
    tied embedding is stored, and counted, once)."""
    if source is not None:
        import gguf

        return width * sum(int(t.n_elements) for t in gguf.GGUFReader(str(source)).tensors)
    params = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                params += math.prod(entry["shape"])
    if params == 0:
        raise SystemExit(f"{model_dir} has no safetensors weights")
    return width * params


def tiny_bf16() -> Path:
    """make_random_model.py's tiny bf16 checkpoint (`--tiny`), the fixed-cost reference of bf16 workers,
    written once to the cache."""
    from baton.common.model_files import cache_root

    path = cache_root() / "bench" / "llama-tiny-random-bf16"
    if not (path / "config.json").is_file():
        tmp = path.with_name(path.name + ".tmp")
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_random_model.py"), "--tiny", str(tmp)],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        tmp.replace(path)
    return path


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
                        help="a .gguf, or a model directory made from one (with --weights bf16 also a safetensors "
                             "directory; default: the default model)")
    parser.add_argument("--weights", choices=["quantized", "bf16", "float32"], default="quantized",
                        help="quantized: the GGUF's blocks, repacked (quantization auto); bf16: bf16 weights, a "
                             "GGUF's dequantized (quantization none), shared as the native bf16 packs; float32: "
                             "what a CPU without bf16 instructions loads, shared as the weights F.linear reads")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kv-blocks", default="64",
                        help="each worker's KV pool, in blocks of 16 tokens: one count, or one per worker")
    parser.add_argument("--stagger", action="store_true",
                        help="start each worker once the previous one is ready (their loads' peaks apart)")
    parser.add_argument("--fixed-model", default="",
                        help="the tiny model whose workers give the fixed cost (default: a tiny Q8_0 GGUF, or with "
                             "--weights bf16 a tiny bf16 checkpoint, written once to $BATON_CACHE/bench)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_engine import cpu_model

    from baton.common.model_files import gguf_source, resolve_model

    bf16 = args.weights in ("bf16", "float32")  # dense weights (the float32 round's tiny model is the bf16 one)
    width = 4 if args.weights == "float32" else 2
    dtype = "float32" if args.weights == "float32" else "bfloat16"
    quantization = "none" if bf16 else "auto"
    kv_blocks = kv_blocks_per_worker(args.kv_blocks, args.workers)
    model_dir = resolve_model(args.model or None)
    source = gguf_source(model_dir)
    tiny_dir = resolve_model(args.fixed_model or (tiny_bf16() if bf16 else tiny_gguf()))
    tiny_source = gguf_source(tiny_dir)
    if bf16:
        file_bytes = dense_parameter_bytes(model_dir, source, width)
        tiny_bytes = dense_parameter_bytes(tiny_dir, tiny_source, width)
        name = source.name + " dequantized" if source is not None else model_dir.name
        reference = f"{args.weights} weights ({width} x parameters)"
        tiny_name = tiny_dir.name if tiny_source is None else tiny_source.name
    else:
        if source is None:
            print(f"{model_dir} was not made from a GGUF: nothing to share (--weights bf16 shares bf16 weights)",
                  file=sys.stderr)
            return 2
        if tiny_source is None:
            print(f"{tiny_dir} was not made from a GGUF", file=sys.stderr)
            return 2
        file_bytes, tiny_bytes = source.stat().st_size, tiny_source.stat().st_size
        name, reference, tiny_name = source.name, "file", tiny_source.name
    print(f"CPU: {cpu_model()}")
    print(f"model: {name}, {file_bytes / 2**20:.0f} MB{f' of {reference}' if bf16 else ''}; "
          f"{args.workers} workers{' (staggered)' if args.stagger else ''}, KV blocks "
          f"{', '.join(map(str, kv_blocks))}; fixed cost from {tiny_name}, {tiny_bytes / 2**20:.1f} MB "
          f"(MB: 2**20 bytes)")
    print(f"| packed weights | PSS per worker MB | of which anonymous MB | of which file MB | PSS total MB | "
          f"total / {args.weights + ' weights' if bf16 else 'file size'} |")
    print("| --- | --- | --- | --- | --- | --- |")
    rounds = {}
    for shared in (False, True):
        rounds[shared] = measure(model_dir, kv_blocks, shared, quantization, args.stagger, dtype)
        label = "one shared file (after)" if shared else "one copy per worker (before)"
        print(table_row(label, rounds[shared], file_bytes), flush=True)
    tiny = measure(tiny_dir, kv_blocks, True, quantization, args.stagger, dtype)
    print(table_row(f"tiny model, shared ({tiny_name})", tiny, tiny_bytes), flush=True)
    mb = lambda n: f"{n / 2**20:.0f} MB"
    if bf16:
        packs = set().union(*(w.packs for w in rounds[True]))
        if not packs:
            print("shared round: no worker maps a packed file (no native bf16 matmul here, or the cache is off)")
        for pack in sorted(packs):
            print(f"shared pack file: {pack.name}, {mb(pack.stat().st_size)}, mapped by "
                  f"{sum(pack in w.packs for w in rounds[True])} of {args.workers} workers")
    fixed = (pss_bytes(tiny) - sum(w.kv_cache_bytes for w in tiny)) / len(tiny)
    kv_pools = sum(w.kv_cache_bytes for w in rounds[True])
    bound = 1.2 * file_bytes + kv_pools + args.workers * fixed
    print(f"fixed cost per worker (tiny model's PSS less its KV pool): {mb(fixed)}; KV pools: "
          f"{', '.join(mb(w.kv_cache_bytes) for w in rounds[True])}")
    for shared, label in ((False, "before"), (True, "after")):
        total = pss_bytes(rounds[shared])
        verdict = "holds" if total <= bound else "does not hold"
        print(f"criterion ({label}): total PSS {mb(total)} <= 1.2 x {reference} {mb(1.2 * file_bytes)} + KV pools "
              f"{mb(kv_pools)} + {args.workers} x fixed {mb(args.workers * fixed)} = {mb(bound)}: {verdict} "
              f"({total / bound:.2f} of the bound)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
