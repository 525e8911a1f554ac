"""What the thread gate (baton/worker/ledger_gate.py) costs a decode step that keeps its lent threads.

A borrowing decode step looks at its lender's state before each layer (decode_layers.cpp) and twice
from Python. This times the default model's decode step (its GGUF's own blocks, bf16, context 256)
on 2 threads, alternating step by step between no gate and a gate armed over a real core-share
ledger whose lender keeps lending, and prints the medians and their ratio.

    python benchmarks/bench_thread_gate.py [--batches 1,4,16] [--rounds 120]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=120)
    args = parser.parse_args(argv)

    import torch

    from baton.common.model_files import resolve_model
    from baton.llm import LLM
    from baton.worker import thread_lending
    from baton.worker.ledger_gate import LedgerGate
    from baton.worker.thread_lending import Ledger, LenderState, run_with_threads
    from benchmarks.bench_engine import DecodeBatch, cpu_model, loadavg

    batches = [int(b) for b in args.batches.split(",")]
    print(f"CPU: {cpu_model()}; {loadavg()}")
    torch.set_num_threads(2)
    llm = LLM(model=str(resolve_model(None)), dtype="bfloat16", max_num_seqs=max(batches), num_threads=2,
              enable_prefix_caching=False, num_kv_blocks=max(batches) * 30 + 8)
    engine = llm.engine
    with tempfile.TemporaryDirectory() as tmp:
        ledger = Ledger(thread_lending.create(os.path.join(tmp, "core-share"), prefill_workers=1, decode_workers=1))
        ledger.write_lender(0, LenderState.LENDING, 1, time.monotonic())
        gate = LedgerGate(ledger.words(), open_value=int(LenderState.LENDING))
        for batch in batches:
            decode = DecodeBatch(engine, batch, 256, 2 * args.rounds + 4, 0)
            decode.step()
            decode.step()
            seconds: dict[str, list[float]] = {"no gate": [], "gate": []}
            for _ in range(args.rounds):
                for mode in seconds:
                    engine.set_thread_gate(gate if mode == "gate" else None)
                    if mode == "gate":
                        gate.arm([ledger.lender_state_word(0)], ledger.borrowed_words(0), threads=1)
                    started = time.perf_counter()
                    run_with_threads(decode.step, threads=2)
                    seconds[mode].append(time.perf_counter() - started)
                    gate.disarm()
            decode.close()
            plain, gated = (statistics.median(seconds[m]) for m in ("no gate", "gate"))
            print(f"batch {batch}: no gate {plain * 1e3:.2f} ms, gate armed and open {gated * 1e3:.2f} ms "
                  f"({gated / plain:.3f}x), 2 threads, median of {args.rounds} alternating steps")
        engine.set_thread_gate(None)
        ledger.close()
    print(f"after: {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
