"""Per-step cost of a structured-output token mask: 16 rows of a JSON-schema request, the default
model's tokenizer (SmolLM2, vocab 49152), for llguidance and (if installed) xgrammar.

Each row walks its own valid JSON document (tokenized as the model would emit it); a step fills the
bitmask of all 16 rows at their current state and then advances each by one token. Reported: grammar
compile time, tokenizer setup time, and the mean / p50 / p99 per-step fill time for the batch, filled
one row after another and (where the library has one) with its parallel batch fill, plus the torch
cost of applying a 16-row bitmask to fp32 logits.

    python -m benchmarks.grammar_mask [--model DIR] [--rows 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib.metadata import version
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "active", "tags", "score"],
    "additionalProperties": False,
}


def documents(rows: int) -> list[str]:
    docs = []
    for i in range(rows):
        doc = {"name": f"Person number {i} of the batch", "age": 20 + i, "email": f"user{i}@example.com",
               "active": i % 2 == 0, "tags": [f"tag{j}" for j in range(i % 4 + 1)], "score": 1.5 * i}
        docs.append(json.dumps(doc))  # ", " and ": ", as Baton constrains JSON
    return docs


def summarize(label: str, samples: list[float]) -> dict:
    ms = sorted(s * 1e3 for s in samples)
    out = {"label": label, "steps": len(ms), "mean_ms": statistics.fmean(ms), "p50_ms": ms[len(ms) // 2],
           "p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))]}
    print(f"{label:<44} steps={out['steps']:4d} mean={out['mean_ms']:.3f} ms  p50={out['p50_ms']:.3f} ms  "
          f"p99={out['p99_ms']:.3f} ms")
    return out


def walk(name: str, matchers: list, token_rows: list[list[int]], fill, consume) -> None:
    """Time `fill(live rows, parallel)` at every step of the rows' documents, one-by-one and
    in parallel; `consume(matcher, token)` advances a row."""
    for parallel in (False, True):
        for m in matchers:
            m.reset()
        samples = []
        for step in range(max(len(r) for r in token_rows)):
            live = [(i, m) for i, m in enumerate(matchers) if step < len(token_rows[i])]
            start = time.perf_counter()
            fill(live, parallel)
            samples.append(time.perf_counter() - start)
            for i, m in live:
                assert consume(m, token_rows[i][step])
        summarize(f"{name} fill x{len(token_rows)} ({'parallel' if parallel else 'sequential'})", samples)


def bench_llguidance(model_dir: Path, token_rows: list[list[int]], vocab: int) -> None:
    import llguidance
    import llguidance.torch as llg_torch

    from baton.common.structured import grammar_of, json_schema

    t0 = time.perf_counter()
    tokenizer = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=vocab)
    t1 = time.perf_counter()
    grammar = grammar_of(json_schema(SCHEMA))  # what Baton compiles (JSON_OPTIONS)
    matchers = [llguidance.LLMatcher(tokenizer, grammar, log_level=0) for _ in token_rows]
    t2 = time.perf_counter()
    print(f"llguidance {llguidance.__version__}: tokenizer {1e3 * (t1 - t0):.0f} ms, "
          f"compile+{len(token_rows)} matchers {1e3 * (t2 - t1):.1f} ms")
    bitmask = llg_torch.allocate_token_bitmask(len(token_rows), vocab)
    executor = llguidance.LLExecutor()

    def fill(live, parallel):
        if parallel:
            llg_torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in live], bitmask)
        else:
            for i, m in live:
                llg_torch.fill_next_token_bitmask(m, bitmask, i)

    walk("llguidance", matchers, token_rows, fill, lambda m, t: m.consume_token(t))


def bench_xgrammar(model_dir: Path, token_rows: list[list[int]], vocab: int) -> None:
    try:
        import xgrammar as xgr
    except ImportError:
        print("xgrammar not installed: skipped")
        return
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    matchers = [xgr.GrammarMatcher(compiled) for _ in token_rows]
    t2 = time.perf_counter()
    print(f"xgrammar {version('xgrammar')}: tokenizer {1e3 * (t1 - t0):.0f} ms, "
          f"compile+{len(token_rows)} matchers {1e3 * (t2 - t1):.1f} ms")
    bitmask = xgr.allocate_token_bitmask(len(token_rows), vocab)
    batch = xgr.BatchGrammarMatcher()

    def fill(live, parallel):
        if parallel:
            batch.batch_fill_next_token_bitmask([m for _, m in live], bitmask, indices=[i for i, _ in live])
        else:
            for i, m in live:
                m.fill_next_token_bitmask(bitmask, i)

    walk("xgrammar", matchers, token_rows, fill, lambda m, t: m.accept_token(t))


def bench_apply(rows: int, vocab: int) -> None:
    from baton.engine.structured import apply_bitmask

    logits = torch.randn(rows, vocab)
    bitmask = torch.randint(-(2 ** 31), 2 ** 31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32)
    samples = []
    for _ in range(200):
        start = time.perf_counter()
        apply_bitmask(logits, bitmask, list(range(rows)))
        samples.append(time.perf_counter() - start)
    summarize(f"apply {rows}-row bitmask to fp32 logits (torch)", samples)


def main() -> None:
    from baton.common.model_files import resolve_model
    from tokenizers import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = resolve_model(args.model)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    token_rows = [tok.encode(doc, add_special_tokens=False).ids for doc in documents(args.rows)]
    print(f"{args.rows} rows, vocab {vocab}, {statistics.fmean(map(len, token_rows)):.0f} tokens per document")
    bench_llguidance(model_dir, token_rows, vocab)
    bench_xgrammar(model_dir, token_rows, vocab)
    bench_apply(args.rows, vocab)


if __name__ == "__main__":
    main()
