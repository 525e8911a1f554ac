"""Resident memory of a worker's engine, per `--quantization`, above the interpreter and torch's own.

Each scheme is measured in a fresh process: import torch, read VmRSS, build the engine as a worker
does (`baton.worker.shell.build_engine`: load, prepare, quantize, release the load-time copies, hand
freed heap back), read VmRSS again; the weights' own bytes are printed beside it, the peak
(VmHWM) the load reached above the same base, and VmRSS once one short request has run (what a
serving worker holds: a pack mapped from the shared file is resident only once read), with the
peak's ratio to it (issue 42 asks at most ~1.3 for a GGUF).

    python benchmarks/bench_memory.py                       # the default model: none (bf16), int8, auto
    python benchmarks/bench_memory.py --model DIR_OR_GGUF --schemes none,auto
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import argparse, json, sys
def rss_mb(key="VmRSS"):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) / 1024
import torch
base = rss_mb()
from baton.common.model_files import resolve_model
from baton.worker.shell import build_engine
args = argparse.Namespace(model=resolve_model(sys.argv[1] or None), dtype="bfloat16", device=None, block_size=16,
                          num_kv_blocks=16, kv_cache_memory=0, max_num_seqs=16, max_num_batched_tokens=512,
                          threads=1, quantization=sys.argv[2], kv_cache_dtype="auto",
                          scheduler_policy="max-utilization", speculative_config=None)
engine = build_engine(args)
from baton.model.plan_report import held_bytes
held = held_bytes(engine.runtime.model)  # every weight in whatever forms it is held, each storage once
loaded, peak = rss_mb() - base, rss_mb("VmHWM") - base
# one short request: every weight is read once (a mapped pack counts only once its pages are touched)
from baton.common.sampling_params import SamplingParams
engine.add_request("warm-up", list(range(1, 33)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
while engine.has_unfinished():
    engine.step()
print(json.dumps({"rss_mb": loaded, "peak_mb": peak, "serving_mb": rss_mb() - base, "scheme": engine.quantization,
                  "weights_mb": held / 1e6}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="model directory or .gguf (default: the default model)")
    parser.add_argument("--schemes", default="none,int8,auto")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_engine import cpu_model

    print(f"CPU: {cpu_model()}")
    print("| --quantization | serves | weights MB | engine RSS above torch's MB | peak RSS while loading MB "
          "| RSS after one request MB | peak / serving |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for scheme in args.schemes.split(","):
        out = subprocess.run([sys.executable, "-c", CHILD, args.model, scheme], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        print(f"| {scheme} | {r['scheme']} | {r['weights_mb']:.0f} | {r['rss_mb']:.0f} | {r['peak_mb']:.0f} "
              f"| {r['serving_mb']:.0f} | {r['peak_mb'] / r['serving_mb']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
