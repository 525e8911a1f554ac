#!/usr/bin/env python3
"""Greedy parity of Baton's engine with Hugging Face transformers on one device, for every family.

Self-contained: no network, no model weights. Each family's model is the test suite's tiny
random-init one (`tests/test_families.build_family`: its transformers config class, seeded, weights
scaled so that greedy is decided by clear margins), saved to a temporary directory. Then, on
`--device` (default cuda; `--device cpu` is the dry run):

  float32   Baton's greedy tokens must equal `generate(do_sample=False)`'s, token for token, through
            each path: `single` (one request at a time), `batch` (prompts of different lengths
            together), `prefix` (the batch again, prompts from the prefix cache), `chunked` (8-token
            prefill chunks, decode mixed in), `preempt` (4-token blocks, a pool the longest request
            alone fills: preempted and recomputed, or blocks freed behind a sliding window). Its
            log-probabilities must be within --logprob-tol of transformers'. Any failure: exit 1.
  bfloat16  the same paths, against transformers' bf16 greedy: the agreement rate and the first
            divergence are reported, and whether every Baton token is transformers' float32 argmax
            (teacher-forced along Baton's output) or a near-tie there (within 3% of the row's
            max - median, tests/test_families.py's rule). Reported, not fatal (--strict-bf16: fatal).
  bench     decode tokens/s at batch 1 and 16 (bf16 on CUDA, float32 on the CPU; --bench-dtype).

One line per (family, dtype, path): PASS / FAIL (float32); PASS (equal to transformers' bf16) / NEAR
(other tokens, every one a near-tie) / DIFF (a token that is no near-tie) for bf16; ERROR (an
exception). Exit status 1 if any float32 path fails, anything raises, or a path's own check fails
(no preemption where one was meant, blocks left in use: FAIL in bf16 too); else 0. A bf16 DIFF is
reported (WARN) and fails only with --strict-bf16.

transformers' reference runs with its default attention implementation, except eager where the
model soft-caps attention scores (Gemma 2): SDPA cannot soft-cap, and transformers 5.17 (unlike
5.25) picks SDPA for Gemma 2, silently dropping the cap (--hf-attn overrides).

On CUDA the native CPU kernels (baton/model/kernels, built with a C++ compiler on first use) are
never needed; BATON_NATIVE_KERNELS=0 is set so that no build can start, and the script reports
whether the engine asked for them at all (`kernels.load()` calls are counted).

    python scripts/gpu_parity.py                  # on a machine with CUDA torch and transformers
    python scripts/gpu_parity.py --device cpu     # the dry run (~70 s float32 on 2 cores)

Run on an NVIDIA H200 (torch 2.11.0+cu130, transformers 5.17.0; 2026-12-04): every float32 path of
every family PASS (60/60); bf16 NEAR for the dense families, DIFF for the MoE ones (qwen3_moe,
mixtral: bf16 flips expert choices in transformers' own bf16 as much: docs/performance.md, "The GPU path").
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # baton, kvstore and tests from this checkout

# nothing may reach a hub (the GPU machine has no network; neither do the tests)
os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

PROMPT_LENS = (1, 3, 17, 40, 70, 100)  # + new tokens stays below Phi-3's 128 (its longrope switch)
FP32_PATHS = ("single", "batch", "prefix", "chunked", "preempt")
NEAR_TIE = 0.03  # tests/test_families.py: a bf16 token within 3% of the row's (max - median) of the top


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (the dry run)")
    p.add_argument("--dtypes", default=None,
                   help="comma-separated: float32,bfloat16 (default: both on CUDA, float32 on the CPU)")
    p.add_argument("--families", default="all", help="comma-separated families (default: every one)")
    p.add_argument("--paths", default=",".join(FP32_PATHS), help="comma-separated paths to run")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per prompt (default 16)")
    p.add_argument("--logprob-tol", type=float, default=5e-3,
                   help="float32: max |Baton - transformers| log-probability of a greedy token (default 5e-3)")
    p.add_argument("--strict-bf16", action="store_true", help="a bf16 token that is no near-tie fails the run")
    p.add_argument("--no-bench", action="store_true", help="skip the decode benchmark")
    p.add_argument("--bench-dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--bench-tokens", type=int, default=None, help="decode tokens timed per request "
                   "(default 64 on CUDA, 16 on the CPU)")
    p.add_argument("--bench-prompt", type=int, default=32, help="prompt tokens per benchmark request")
    p.add_argument("--max-seconds", type=float, default=0,
                   help="start no family (nor benchmark) after this many seconds; a skipped family fails (0: no limit)")
    p.add_argument("--hf-attn", default="auto", help="transformers' attn_implementation for the reference "
                   "(auto: its default, eager where the model soft-caps attention scores)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 on the CPU run)")
    p.add_argument("--allow-native-kernels", action="store_true",
                   help="do not set BATON_NATIVE_KERNELS=0 (the CPU kernels may then be built)")
    return p.parse_args()


ARGS = parse_args()
DEVICE_TYPE = ARGS.device.split(":")[0]
if DEVICE_TYPE != "cpu" and not ARGS.allow_native_kernels:
    os.environ["BATON_NATIVE_KERNELS"] = "0"  # CPU-only kernels: never build them for a GPU run
if DEVICE_TYPE == "cpu" and ARGS.dtypes and "bfloat16" in ARGS.dtypes and not ARGS.allow_native_kernels:
    os.environ.setdefault("BATON_NATIVE_KERNELS", "0")  # a bf16 dry run: the torch path, no compile

import logging  # noqa: E402

import torch  # noqa: E402

import transformers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig  # noqa: E402

from baton.common.sampling_params import SamplingParams  # noqa: E402
from baton.model import kernels as native_kernels  # noqa: E402
from baton.model.families import FAMILIES as ENGINE_FAMILIES  # noqa: E402
from baton.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from baton.engine.window_blocks import freeable_window  # noqa: E402
from tests.test_families import FAMILIES as TEST_FAMILIES, VOCAB, build_family  # noqa: E402

logging.basicConfig(level=logging.WARNING, format="      [%(name)s] %(message)s")
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

# count the engine's requests for the native kernels (on CUDA it should make none)
KERNEL_LOADS: list[str] = []
_real_load = native_kernels.load


def _counting_load():
    KERNEL_LOADS.append("".join(traceback.format_stack(limit=4)[:-1]))
    return _real_load()


native_kernels.load = _counting_load


def say(line: str) -> None:
    print(line, flush=True)


def sync() -> None:
    if DEVICE_TYPE == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------- references

class Reference:
    """transformers' model of one family in one dtype on the device, and its greedy outputs."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: str) -> None:
        kwargs = {}
        if ARGS.hf_attn != "auto":
            kwargs["attn_implementation"] = ARGS.hf_attn
        elif getattr(AutoConfig.from_pretrained(model_dir), "attn_logit_softcapping", None) is not None:
            # SDPA has no soft-capping: transformers 5.17 picks sdpa for Gemma 2 by default (5.25:
            # eager) and so drops its attention soft-cap (measured: other tokens from position 45
            # on); eager is the reference's own implementation, which Baton follows
            kwargs["attn_implementation"] = "eager"
        from baton.common.model_files import transformers_source

        path, source = transformers_source(Path(model_dir))  # a GGUF's directory: the file itself
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs, **source).to(device).eval()
        self.attn = self.model.config._attn_implementation
        self.device = device
        self.cache: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        key = (*prompt, -n)
        if key not in self.cache:
            config = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0,
                                      output_logits=True, return_dict_in_generate=True)
            ids = torch.tensor([prompt], device=self.device)
            with torch.no_grad():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            tokens = out.sequences[0, len(prompt):].tolist()
            logprobs = [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, tokens)]
            if len(tokens) != n:
                raise RuntimeError(f"transformers stopped after {len(tokens)} of {n} tokens")
            self.cache[key] = (tokens, logprobs)
        return self.cache[key]

    def logits_along(self, prompt: list[int], output: list[int]) -> torch.Tensor:
        """[len(output), V] fp32 logits predicting each output token, teacher-forced."""
        with torch.no_grad():
            logits = self.model(torch.tensor([prompt + output], device=self.device)).logits
        return logits[0, len(prompt) - 1:len(prompt) - 1 + len(output)].float()


# ---------------------------------------------------------------------------------------- the engine

def make_engine(model_dir: Path, dtype: str, **overrides) -> LLMEngine:
    config = dict(model=str(model_dir), dtype=dtype, device=ARGS.device, num_kv_blocks=256)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


_ids = iter(range(1 << 62))


def generate(engine: LLMEngine, prompts: list[list[int]], n: int,
             on_step: Callable[[], None] | None = None) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """Greedy: every prompt added at once, stepped to the end (LLM.generate's loop; `on_step` after
    each step). Returns tokens, log-probabilities and cached prompt tokens per prompt."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    ids = [f"r{next(_ids)}" for _ in prompts]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    tokens = {i: [] for i in ids}
    logprobs = {i: [] for i in ids}
    cached = {i: 0 for i in ids}
    errors = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.new_logprobs
            cached[out.request_id] = out.num_cached_tokens
            if out.error:
                errors.append(f"{out.request_id}: {out.error}")
        if on_step is not None:
            on_step()
    if errors:
        raise RuntimeError("; ".join(errors))
    return [tokens[i] for i in ids], [logprobs[i] for i in ids], [cached[i] for i in ids]


def pool_problem(engine: LLMEngine) -> str:
    """'' when every block is back in the pool after the requests finished, else what is wrong."""
    pool = engine.pool
    try:
        pool.check_invariants()
    except AssertionError as exc:
        return f"pool invariants: {exc}"
    if pool.num_free_blocks != pool.num_blocks - 1 or any(pool.ref_counts):
        return f"pool: {pool.num_free_blocks} of {pool.num_blocks - 1} blocks free after the run"
    return ""


def run_path(path: str, model_dir: Path, dtype: str, prompts: list[list[int]], n: int,
             engines: dict) -> tuple[list[list[int]], list[list[float]], str, str]:
    """Baton's greedy output through one path: tokens, logprobs, a note, and a problem ('' if none)
    the path itself shows (no preemption where one was meant, blocks left over)."""
    note, problem = "", ""
    if path == "single":
        engine = make_engine(model_dir, dtype)
        tokens, logprobs = [], []
        for prompt in prompts:
            t, lp, _ = generate(engine, [prompt], n)
            tokens += t
            logprobs += lp
        problem = pool_problem(engine)
    elif path in ("batch", "prefix"):
        engine = engines.get((dtype, "batch"))
        if engine is None or path == "batch":
            engine = engines[(dtype, "batch")] = make_engine(model_dir, dtype)
            if path == "prefix":  # run without "batch": fill the prefix cache first
                generate(engine, prompts, n)
        tokens, logprobs, cached = generate(engine, prompts, n)
        note = f"cached prompt tokens {sum(cached)}"
        if path == "prefix" and sum(cached) == 0:
            problem = "nothing came from the prefix cache"
        problem = problem or pool_problem(engine)
    elif path == "chunked":
        engine = make_engine(model_dir, dtype, max_num_batched_tokens=8)
        steps: list[int] = []
        tokens, logprobs, _ = generate(engine, prompts, n, on_step=lambda: steps.append(engine.stats().num_batched_tokens))
        note = f"{len(steps)} steps, max {max(steps)} tokens/step"
        if max(steps) > 8:
            problem = f"a step computed {max(steps)} tokens (> 8)"
        problem = problem or pool_problem(engine)
    elif path == "preempt":
        block = 4
        longest = max(len(p) for p in prompts) + n
        blocks = -(-longest // block) + 1  # the longest request alone fills it (block 0 is reserved)
        engine = make_engine(model_dir, dtype, block_size=block, num_kv_blocks=blocks)
        tokens, logprobs, _ = generate(engine, prompts, n)
        preemptions = engine.scheduler.num_preemptions
        released = engine.block_manager.num_released_blocks
        note = f"{blocks} blocks of {block}: {preemptions} preemptions, {released} blocks freed behind a window"
        if freeable_window(engine.model_config) is None and preemptions == 0:
            problem = "no preemption happened"
        elif preemptions == 0 and released == 0:
            problem = "neither a preemption nor a window release happened"
        problem = problem or pool_problem(engine)
    else:
        raise ValueError(f"unknown path {path!r}")
    return tokens, logprobs, note, problem


def first_divergence(got: list[list[int]], want: list[list[int]], prompts: list[list[int]]) -> str:
    for i, (g, w) in enumerate(zip(got, want)):
        for j, (a, b) in enumerate(zip(g, w)):
            if a != b:
                return f"first divergence: prompt {i} (len {len(prompts[i])}) token {j}: baton {a} vs hf {b}"
        if len(g) != len(w):
            return f"prompt {i} (len {len(prompts[i])}): baton {len(g)} tokens vs hf {len(w)}"
    return ""


def agreement(got: list[list[int]], want: list[list[int]]) -> tuple[int, int]:
    """(tokens equal position by position, all tokens)"""
    total = sum(len(w) for w in want)
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    return same, total


def common_prefix(got: list[list[int]], want: list[list[int]]) -> tuple[int, int]:
    """(tokens before each prompt's first divergence, summed; prompts identical throughout)"""
    prefix = identical = 0
    for g, w in zip(got, want):
        k = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        prefix += k
        identical += g == w
    return prefix, identical


# ---------------------------------------------------------------------------------------- checks

FAILURES: list[str] = []
WARNINGS: list[str] = []


def line(status: str, family: str, dtype: str, path: str, text: str) -> None:
    say(f"{status:<5} {family:<12} {dtype:<8} {path:<8} {text}")


def timed_run(family: str, path: str, model_dir: Path, dtype: str, prompts: list[list[int]], n: int,
              engines: dict) -> tuple | None:
    """`run_path` and its seconds; None (recorded as an ERROR line and a failure, with the
    traceback printed) where the path raised: the other paths still run."""
    try:
        t0 = time.perf_counter()
        tokens, logprobs, note, problem = run_path(path, model_dir, dtype, prompts, n, engines)
        return tokens, logprobs, note, problem, time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001
        FAILURES.append(f"{family} {dtype} {path}: {type(exc).__name__}: {exc}")
        line("ERROR", family, dtype, path, f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
        return None


def check_fp32(family: str, model_dir: Path, ref: Reference, prompts: list[list[int]], paths: list[str]) -> None:
    n = ARGS.new_tokens
    want = [ref.greedy(p, n) for p in prompts]
    want_tokens = [w[0] for w in want]
    distinct = len({t for w in want_tokens for t in w})
    if distinct < 8:
        WARNINGS.append(f"{family}: the reference repeats itself ({distinct} distinct tokens): weak oracle")
    engines: dict = {}
    for path in paths:
        run = timed_run(family, path, model_dir, "float32", prompts, n, engines)
        if run is None:
            continue
        tokens, logprobs, note, problem, secs = run
        same, total = agreement(tokens, want_tokens)
        lp_diff = max((abs(a - b) for got, w in zip(logprobs, want) for a, b in zip(got, w[1])), default=0.0)
        text = ", ".join(x for x in (f"tokens {same}/{total} match ({len(prompts)} prompts x {n})",
                                      f"max|dlogprob| {lp_diff:.1e}", note, f"{secs:.1f}s") if x)
        ok = tokens == want_tokens and lp_diff <= ARGS.logprob_tol and not problem
        if not ok:
            why = first_divergence(tokens, want_tokens, prompts) or problem or \
                f"logprobs differ by {lp_diff:.2e} > {ARGS.logprob_tol:.0e}"
            text += f"; {why}"
            FAILURES.append(f"{family} float32 {path}: {why}")
        line("PASS" if ok else "FAIL", family, "float32", path, text)


def check_bf16(family: str, model_dir: Path, ref16: Reference, ref32: Reference | None,
               prompts: list[list[int]], paths: list[str]) -> None:
    n = ARGS.new_tokens
    want = [ref16.greedy(p, n)[0] for p in prompts]
    engines: dict = {}
    for path in paths:
        run = timed_run(family, path, model_dir, "bfloat16", prompts, n, engines)
        if run is None:
            continue
        tokens, _, note, problem, secs = run
        same, total = agreement(tokens, want)
        prefix, identical = common_prefix(tokens, want)
        text = (f"vs hf bf16: {identical}/{len(prompts)} prompts identical, {prefix}/{total} tokens before "
                f"divergence ({100.0 * prefix / max(total, 1):.0f}%), {same}/{total} equal by position")
        far = exact32 = 0
        if ref32 is not None:  # every Baton token: fp32 argmax, or a near-tie there
            worst = 0.0
            for prompt, got in zip(prompts, tokens):
                logits = ref32.logits_along(prompt, got)
                for i, token in enumerate(got):
                    row = logits[i]
                    margin = float(row.max() - row[token])
                    spread = float(row.max() - row.median())
                    exact32 += margin == 0
                    worst = max(worst, margin / spread if spread > 0 else 0.0)
                    far += margin > NEAR_TIE * spread
            text += f", fp32 argmax {exact32}/{total}, not near-tie {far} (worst margin {100 * worst:.1f}% of spread)"
        divergence = first_divergence(tokens, want, prompts)
        text += "".join(f", {x}" for x in (note, f"{secs:.1f}s") if x)
        if divergence:
            text += f"; {divergence}"
        if problem:
            text += f"; {problem}"
            FAILURES.append(f"{family} bfloat16 {path}: {problem}")
        status = "PASS" if tokens == want and far == 0 else ("NEAR" if far == 0 else "DIFF")
        if problem:
            status = "FAIL"
        if status == "DIFF":
            WARNINGS.append(f"{family} bfloat16 {path}: {far} tokens are no near-tie of the fp32 argmax")
            if ARGS.strict_bf16:
                FAILURES.append(f"{family} bfloat16 {path}: {far} tokens are no near-tie")
        line(status, family, "bfloat16", path, text)


def bench(family: str, model_dir: Path, dtype: str) -> None:
    tokens = ARGS.bench_tokens or (64 if DEVICE_TYPE == "cuda" else 16)
    rng = random.Random(99)
    try:
        engine = make_engine(model_dir, dtype, num_kv_blocks=16 * (-(-(ARGS.bench_prompt + tokens + 1) // 16)) + 8,
                             max_num_seqs=64, enable_prefix_caching=False)
        results = []
        for batch in (1, 1, 16):  # the first run warms up (allocator, kernels' first launches)
            prompts = [[rng.randrange(3, VOCAB) for _ in range(ARGS.bench_prompt)] for _ in range(batch)]
            params = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)
            for prompt in prompts:
                engine.add_request(f"b{next(_ids)}", prompt, params)
            started = 0
            while started < batch:  # prefill: every request's first token
                started += sum(1 for out in engine.step() if out.new_token_ids)
            sync()
            t0 = time.perf_counter()
            generated = steps = 0
            while engine.has_unfinished():
                generated += sum(len(out.new_token_ids) for out in engine.step())
                steps += 1
            sync()
            secs = time.perf_counter() - t0
            results.append((batch, generated / secs, 1000 * secs / max(steps, 1)))
        text = ", ".join(f"batch {b}: {tps:,.0f} tok/s ({ms:.2f} ms/step)" for b, tps, ms in results[1:])
        say(f"BENCH {family:<12} {dtype:<8} decode  {text}  [{engine.runtime.model.describe()}; prompt "
            f"{ARGS.bench_prompt}, {tokens} tokens/request]")
    except Exception as exc:  # noqa: BLE001
        FAILURES.append(f"{family} bench: {type(exc).__name__}: {exc}")
        say(f"ERROR {family:<12} {dtype:<8} bench   {type(exc).__name__}: {exc}")
        traceback.print_exc()


def device_report(model_dir: Path, dtype: str) -> str:
    engine = make_engine(model_dir, dtype, num_kv_blocks=8)
    where = {p.device.type for p in engine.runtime.model.parameters()} | {engine.runtime.runner.kv_cache.device.type}
    if where != {DEVICE_TYPE}:
        raise RuntimeError(f"engine tensors on {sorted(where)}, not {DEVICE_TYPE}")
    return engine.runtime.model.describe()


# ---------------------------------------------------------------------------------------- main

def main() -> int:
    t_start = time.perf_counter()
    if DEVICE_TYPE == "cuda":
        if not torch.cuda.is_available():
            say("FAIL  no CUDA device visible to torch")
            return 1
        # exact float32 on both sides: no TF32 in matmuls (torch's default, made explicit)
        torch.set_float32_matmul_precision("highest")
        try:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        except (AttributeError, RuntimeError) as exc:  # a torch that refuses the legacy flags
            say(f"   (TF32 flags: {exc})")
    torch.set_num_threads(ARGS.threads or (1 if DEVICE_TYPE == "cpu" else torch.get_num_threads()))
    dtypes = (ARGS.dtypes or ("float32,bfloat16" if DEVICE_TYPE == "cuda" else "float32")).split(",")
    paths = [p for p in ARGS.paths.split(",") if p]
    families = list(TEST_FAMILIES) if ARGS.families == "all" else ARGS.families.split(",")
    bench_dtype = ARGS.bench_dtype or ("bfloat16" if DEVICE_TYPE == "cuda" else "float32")
    name = torch.cuda.get_device_name(ARGS.device) if DEVICE_TYPE == "cuda" else "cpu"
    say(f"== baton gpu_parity: device {ARGS.device} ({name}), torch {torch.__version__} "
        f"(cuda {torch.version.cuda}), transformers {transformers.__version__}, python {sys.version.split()[0]}")
    say(f"== dtypes {','.join(dtypes)}; paths {','.join(paths)}; {ARGS.new_tokens} new tokens per prompt; "
        f"prompt lengths {list(PROMPT_LENS)}; BATON_NATIVE_KERNELS={os.environ.get('BATON_NATIVE_KERNELS', '(unset)')}")
    untested = sorted(set(ENGINE_FAMILIES) - set(TEST_FAMILIES))
    if untested:
        WARNINGS.append(f"families the engine runs but the test helpers do not build: {untested}")
    rng = random.Random(4321)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]

    with tempfile.TemporaryDirectory(prefix="baton-gpu-parity-") as tmp:
        empty_tokenizer_dir = Path(tmp) / "no-tokenizer"  # the engine needs no tokenizer for token ids
        empty_tokenizer_dir.mkdir()
        built: dict[str, Path] = {}
        for family in families:
            if ARGS.max_seconds and time.perf_counter() - t_start > ARGS.max_seconds:
                FAILURES.append(f"{family}: not run, past --max-seconds {ARGS.max_seconds:.0f}")
                say(f"SKIP  {family:<12} -        -        past --max-seconds {ARGS.max_seconds:.0f}")
                continue
            t_family = time.perf_counter()
            try:
                model_dir = build_family(family, Path(tmp) / family, empty_tokenizer_dir)
                say(f"-- {family}: {device_report(model_dir, dtypes[0])}")
            except Exception as exc:  # noqa: BLE001
                FAILURES.append(f"{family}: build/load: {type(exc).__name__}: {exc}")
                say(f"ERROR {family:<12} -        load     {type(exc).__name__}: {exc}")
                traceback.print_exc()
                continue
            ref32 = None
            if "float32" in dtypes or "bfloat16" in dtypes:
                try:
                    ref32 = Reference(model_dir, torch.float32, ARGS.device)
                except Exception as exc:  # noqa: BLE001
                    FAILURES.append(f"{family} float32 reference: {type(exc).__name__}: {exc}")
                    say(f"ERROR {family:<12} float32  hf       {type(exc).__name__}: {exc}")
                    traceback.print_exc()
                    continue
                say(f"   {family}: transformers attention: {ref32.attn}")
            if "float32" in dtypes:
                check_fp32(family, model_dir, ref32, prompts, paths)
            if "bfloat16" in dtypes:
                try:
                    ref16 = Reference(model_dir, torch.bfloat16, ARGS.device)
                except Exception as exc:  # noqa: BLE001
                    FAILURES.append(f"{family} bfloat16 reference: {type(exc).__name__}: {exc}")
                    say(f"ERROR {family:<12} bfloat16 hf       {type(exc).__name__}: {exc}")
                else:
                    check_bf16(family, model_dir, ref16, ref32, prompts, paths)
                    del ref16
            del ref32
            built[family] = model_dir
            if DEVICE_TYPE == "cuda":
                torch.cuda.empty_cache()
            say(f"-- {family}: {time.perf_counter() - t_family:.1f}s")
        # the benchmark after every parity line is out (a run cut short still reports parity)
        for family, model_dir in built.items():
            if ARGS.no_bench:
                break
            if ARGS.max_seconds and time.perf_counter() - t_start > ARGS.max_seconds:
                say(f"SKIP  {family:<12} {bench_dtype:<8} bench   past --max-seconds {ARGS.max_seconds:.0f}")
                continue
            bench(family, model_dir, bench_dtype)

    if KERNEL_LOADS:
        msg = f"the engine asked for the native CPU kernels {len(KERNEL_LOADS)} time(s) (first from:\n{KERNEL_LOADS[0]})"
        WARNINGS.append(msg)
    say(f"== native CPU kernels requested by the engine: {len(KERNEL_LOADS)} time(s); built: "
        f"{native_kernels.loaded() is not None}")
    for warning in WARNINGS:
        say(f"WARN  {warning}")
    for failure in FAILURES:
        say(f"FAILED {failure}")
    say(f"== {'OK' if not FAILURES else f'{len(FAILURES)} FAILURE(S)'} in {time.perf_counter() - t_start:.0f}s")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
