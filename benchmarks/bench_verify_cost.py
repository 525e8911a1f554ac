"""What a verify step costs, measured apart from what a proposer guesses: ms per output token with and
without speculation, at a fixed acceptance, through the engine.

A proposer's acceptance depends on the model's weights and the text (a random-init checkpoint's
outputs repeat nothing a real model's would), so the proposals here are the target's own next
tokens (speculation off's output), all of them accepted, or each spoiled (none accepted): the two
ends bracket every proposer. On a model with state layers (Qwen3.5's Gated DeltaNet) each verify row
steps the state layers token by token and copies the states it may fall back to into free slots:
that cost is in these figures. Greedy tokens are checked equal to speculation off's.

    python benchmarks/make_random_model.py --family qwen3_5 /tmp/q35-08b
    python benchmarks/bench_verify_cost.py --model /tmp/q35-08b --rows 1,4 --k 1,2,4
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.common.model_files import resolve_model  # noqa: E402
from baton.common.sampling_params import SamplingParams  # noqa: E402
from baton.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from benchmarks.bench_engine import cpu_model  # noqa: E402


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, int]:
    """All prompts at once; (tokens per request, decode seconds after the first token of all, steps)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    started, steps = None, 0
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        if started is None and all(out.values()):
            started, steps = time.perf_counter(), 0
        steps += 1
    assert started is not None
    return [out[str(i)] for i in range(len(prompts))], time.perf_counter() - started, steps


def oracle(engine: LLMEngine, future: dict[tuple[int, ...], list[int]], spoil: bool) -> None:
    """Proposals: the true next tokens (all accepted) or each spoiled (none accepted)."""
    speculator = engine.scheduler.speculator
    speculator.costs.force = True  # verify every step: the cost is what is measured

    def proposals(scheduled, budget):
        wanted = {}
        for seq in speculator._candidates(scheduled):
            whole = list(seq.prompt_token_ids) + future[tuple(seq.prompt_token_ids)]
            draft = whole[seq.num_tokens:seq.num_tokens + speculator._room(seq, budget)]
            if draft:
                wanted[id(seq)] = [(t + 1) % 1000 if spoil else t for t in draft]
                speculator._row(seq)
        return wanted, []

    speculator._ngram_proposals = proposals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--k", default="1,2,4")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    print(f"CPU: {cpu_model()}; model {model_dir.name}; {args.tokens} tokens a request, greedy")
    rng = random.Random(0)

    def engine(k: int | None) -> LLMEngine:
        spec = {"method": "ngram", "num_speculative_tokens": k} if k else None
        return LLMEngine(EngineConfig(model=str(model_dir), num_threads=args.threads, enable_prefix_caching=False,
                                      max_num_seqs=16, speculative_config=spec))

    plain = engine(None)
    print(f"median of {args.rounds} rounds, plain and speculating runs alternating (this VM's memory bandwidth drifts)")
    print("rows | plain ms/token | k | all accepted: ms/token (ratio) | none accepted: ms/token (ratio)")
    for rows in map(int, args.rows.split(",")):
        prompts = [[rng.randrange(100, 49000) for _ in range(args.prompt_len)] for _ in range(rows)]
        generate(plain, prompts, 4)  # warm
        off, _, _ = generate(plain, prompts, args.tokens)
        future = {tuple(p): o for p, o in zip(prompts, off)}
        for k in map(int, args.k.split(",")):
            engines = []
            for spoil in (False, True):
                spec = engine(k)
                oracle(spec, future, spoil)
                generate(spec, prompts, 4)
                engines.append(spec)
            samples: list[list[float]] = [[], [], []]  # plain, all accepted, none accepted
            for _ in range(args.rounds):
                for i, e in enumerate([plain, *engines]):
                    got, secs, _ = generate(e, prompts, args.tokens)
                    assert got == off, "speculation changed the greedy tokens"
                    samples[i].append(1e3 * secs / (rows * (args.tokens - 1)))
            base, every, none = (statistics.median(x) for x in samples)
            print(f"{rows} | {base:.1f} | {k} | {every:.1f} ({base / every:.2f}x) | {none:.1f} ({base / none:.2f}x)")

if __name__ == "__main__":
    main()
