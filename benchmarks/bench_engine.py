"""Offline throughput of Baton's engine against transformers' static batching, and decode-step floors.

One run does all of it, in one process, with the same torch thread count throughout:

1. builds N requests from a fixed seed (random token ids >= 100, prompts of 16-512 tokens,
   max_tokens 16-256, greedy, ignore_eos);
2. runs them through `baton.LLM.generate` (continuous batching, chunked prefill, paged KV) and
   reports generated tokens / wall time, and how that time splits between steps carrying prefill
   chunks and decode-only steps;
3. runs them through transformers `generate` in static batches of 8 (left-padded, generating to the
   batch's longest max_tokens) and reports USEFUL tokens / wall time (each request's own max_tokens)
   and the share of generated slots wasted;
4. prints both and their ratio;
5. times Baton's engine step with decode tokens only at batch 1, 16 and 64 (context ~256 each) next
   to this machine's limits measured in the same run: weight (+KV) bytes / memory read bandwidth,
   and step FLOPs / the 2048^3 matmul rate;
6. with --profile, splits a decode step at batch 1, 16 and 64 into scheduling, metadata, model forward
   (matmuls, KV gather, attention, KV write, other ops, Python between ops), sampling and
   bookkeeping.

    python benchmarks/bench_engine.py                    # the real SmolLM2-135M, bf16, 64 requests
    python benchmarks/bench_engine.py --quick            # smoke run (< 2 min)
    python benchmarks/bench_engine.py --dtype float32 --profile

The machines are shared and small (2 cores): numbers are medians where they can be, and the load
average is printed before and after so a noisy run can be recognised.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from baton.model.config import ModelConfig  # noqa: E402
from baton.common.sampling_params import SamplingParams  # noqa: E402

MIN_TOKEN_ID = 100  # random prompts avoid the special tokens at the start of the vocabulary
GIB = 1 << 30


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int


@dataclass
class Sizes:
    """Knobs of a run: --quick shrinks everything."""

    num_requests: int
    prompt_len: tuple[int, int]
    max_tokens: tuple[int, int]
    step_batches: tuple[int, ...]
    step_context: int
    step_repeats: int  # timed decode steps per batch size


FULL = Sizes(64, (16, 512), (16, 256), (1, 16, 64), 256, 20)
QUICK = Sizes(16, (16, 128), (16, 64), (1, 16, 64), 128, 8)


# --------------------------------------------------------------------------------------------
# helpers


def timings(fn, repeats: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def cpu_model() -> str:
    """The CPU's name, with family/model numbers (a VM often shows only "Intel(R) Xeon(R) Processor")."""
    try:
        info = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
        flags = info.get("flags", "").split()
        extras = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
        return (f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')}; "
                f"{', '.join(extras) or 'no bf16 instructions'})")
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def loadavg() -> str:
    try:
        one, five, _ = os.getloadavg()
        return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"
    except OSError:
        return "load average unknown"


def make_requests(n: int, vocab_size: int, prompt_len: tuple[int, int], max_tokens: tuple[int, int],
                  seed: int) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        length = rng.randint(*prompt_len)
        prompt = [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(length)]
        requests.append(Request(prompt, rng.randint(*max_tokens)))
    return requests


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=0)


def torch_dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


# --------------------------------------------------------------------------------------------
# machine limits


def measure_bandwidth(repeats: int = 5) -> tuple[float, float, float]:
    """Memory read bandwidth (sum over a 1 GiB fp32 tensor): median and best of `repeats`, B/s; and
    the median copy bandwidth (bytes read + written)."""
    tensors = [torch.empty(GIB // 4, dtype=torch.float32).fill_(1.0)]  # fill: fault the pages in first
    reads = timings(lambda: tensors[0].sum(), repeats)
    tensors.append(torch.empty_like(tensors[0]).fill_(0.0))
    copy_s = statistics.median(timings(lambda: tensors[1].copy_(tensors[0]), repeats))
    tensors.clear()
    gc.collect()
    return GIB / statistics.median(reads), GIB / min(reads), 2 * GIB / copy_s


def measure_matmul(dtype: torch.dtype, n: int = 2048, repeats: int = 7) -> tuple[float, float]:
    """FLOP/s of an n^3 matmul in `dtype`: median and best."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    times = timings(lambda: torch.mm(a, b), repeats, warmup=2)
    return 2 * n**3 / statistics.median(times), 2 * n**3 / min(times)


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter once (tied embeddings counted once: the
    lm_head reads the whole matrix, the embedding lookup only a few rows)."""
    seen = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def matmul_params(config: ModelConfig) -> int:
    """Parameters multiplied per token: every projection of every layer, plus the lm_head."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    return config.num_layers * per_layer + h * config.vocab_size


def step_flops(config: ModelConfig, batch: int, context: int) -> float:
    """FLOPs of a decode step: 2 x params x batch, plus QK^T and PV over the context."""
    attention = 4 * config.num_layers * config.num_heads * config.head_dim * context
    return batch * (2 * matmul_params(config) + attention)


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * dtype.itemsize


# --------------------------------------------------------------------------------------------
# 2. Baton


def run_baton(llm, requests: list[Request]) -> tuple[float, int, list[list[int]], list[tuple[int, int, float]]]:
    """Generate through the engine's own API (`add_request`, `step`, `stats`); returns wall seconds,
    generated tokens, the tokens, and per step (prefill tokens, decode tokens, seconds)."""
    engine = llm.engine
    steps: list[tuple[int, int, float]] = []
    tokens: dict[str, list[int]] = {}
    ids = [f"bench-{i}" for i in range(len(requests))]
    t0 = time.perf_counter()
    for request_id, request in zip(ids, requests):
        engine.add_request(request_id, request.prompt, greedy(request.max_tokens))
        tokens[request_id] = []
    while engine.has_unfinished():
        started = time.perf_counter()
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        seconds = time.perf_counter() - started
        stats = engine.stats()
        steps.append((stats.num_batched_tokens - stats.num_decode_tokens, stats.num_decode_tokens, seconds))
    seconds = time.perf_counter() - t0
    generated = [tokens[request_id] for request_id in ids]
    return seconds, sum(len(t) for t in generated), generated, steps


def describe_steps(steps: list[tuple[int, int, float]]) -> str:
    mixed = [s for s in steps if s[0] > 0]
    decode = [s for s in steps if s[0] == 0 and s[1] > 0]
    total = sum(s[2] for s in steps)
    parts = []
    if mixed:
        t = sum(s[2] for s in mixed)
        parts.append(f"{len(mixed)} steps with prefill ({sum(s[0] for s in mixed)} prompt tokens, "
                     f"{sum(s[1] for s in mixed) / len(mixed):.0f} decodes/step on average): "
                     f"{t:.1f} s = {100 * t / total:.0f}%, "
                     f"{1e3 * statistics.median(s[2] for s in mixed):.0f} ms median")
    if decode:
        t = sum(s[2] for s in decode)
        parts.append(f"{len(decode)} decode-only steps (batch {sum(s[1] for s in decode) / len(decode):.1f} on "
                     f"average): {t:.1f} s = {100 * t / total:.0f}%, "
                     f"{1e3 * statistics.median(s[2] for s in decode):.0f} ms median")
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------
# 3. transformers, static batches


def load_hf(model_dir: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from baton.common.model_files import transformers_source

    path, source = transformers_source(model_dir)  # a GGUF's directory: transformers reads the file
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **source)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, **source)
    model.eval()
    return model


def hf_generate_batch(model, batch: list[Request], pad_id: int) -> tuple[list[list[int]], int]:
    """Left-padded static batch generated to its longest max_tokens, EOS ignored.
    Returns each request's useful tokens and the slots generated (batch x max_new_tokens)."""
    from transformers import GenerationConfig

    width = max(len(r.prompt) for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        input_ids[row, width - len(r.prompt):] = torch.tensor(r.prompt)
        mask[row, width - len(r.prompt):] = 1
    new = max(r.max_tokens for r in batch)
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1,
                              eos_token_id=None, pad_token_id=pad_id)
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
    generated = out[:, width:]
    if generated.shape[1] != new:
        raise RuntimeError(f"transformers generated {generated.shape[1]} tokens, expected {new}")
    return [generated[row, :r.max_tokens].tolist() for row, r in enumerate(batch)], len(batch) * new


def run_hf(model, requests: list[Request], batch_size: int, pad_id: int):
    useful = slots = 0
    tokens: list[list[int]] = []
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        out, generated = hf_generate_batch(model, batch, pad_id)
        tokens.extend(out)
        slots += generated
        useful += sum(r.max_tokens for r in batch)
    return time.perf_counter() - t0, useful, slots, tokens


def run_hf_continuous(model, requests: list[Request]) -> tuple[float, int]:
    """transformers' own continuous batching (`continuous_batching_context_manager`, what
    `generate_batch` uses), each request with its own max_new_tokens, greedy. Returns wall seconds
    and tokens generated."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max(r.max_tokens for r in requests))
    t0 = time.perf_counter()
    results = {}
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
        ids = [manager.add_request(r.prompt, max_new_tokens=r.max_tokens, eos_token_id=-1) for r in requests]
        deadline = time.monotonic() + 3600
        while len(results) < len(ids) and time.monotonic() < deadline:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
    seconds = time.perf_counter() - t0
    return seconds, sum(len(r.generated_tokens) for r in results.values())


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """Requests whose greedy outputs are identical, and the median common prefix length."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    prefixes = []
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    return same, int(statistics.median(prefixes))


# --------------------------------------------------------------------------------------------
# 5. decode steps


class DecodeBatch:
    """B requests brought into pure decode on a live engine (context ~`context` tokens each)."""

    def __init__(self, engine, batch: int, context: int, steps: int, seed: int) -> None:
        self.engine = engine
        rng = random.Random(seed)
        vocab = engine.model_config.vocab_size
        self.request_ids = [f"decode-{seed}-{batch}-{i}" for i in range(batch)]
        for request_id in self.request_ids:
            engine.add_request(request_id, [rng.randrange(MIN_TOKEN_ID, vocab) for _ in range(context)],
                               greedy(steps + 64))
        # Prefill (chunked by the token budget) until every request has its first token: from then
        # on each step computes one token per request.
        started: set[str] = set()
        while len(started) < batch:
            if not engine.has_unfinished():
                raise RuntimeError("requests finished before reaching decode")
            started.update(out.request_id for out in engine.step() if out.new_token_ids)

    def step(self) -> float:
        t0 = time.perf_counter()
        outputs = self.engine.step()
        seconds = time.perf_counter() - t0
        if len(outputs) != len(self.request_ids):
            raise RuntimeError(f"decode step produced {len(outputs)} tokens for {len(self.request_ids)} requests")
        return seconds

    def close(self) -> None:
        self.engine.abort(self.request_ids)


def measure_decode_steps(engine, batches, context: int, repeats: int, seed: int) -> dict[int, list[float]]:
    results = {}
    for batch in batches:
        db = DecodeBatch(engine, batch, context, repeats + 2, seed)
        for _ in range(2):
            db.step()  # warm: first decode step at this shape
        results[batch] = [db.step() for _ in range(repeats)]
        db.close()
    return results


def measure_prefill(engine, length: int, repeats: int, seed: int) -> list[float]:
    """Seconds of the engine step that prefills one `length`-token prompt in one chunk (prefix
    caching cannot help: every prompt is new)."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    times = []
    for i in range(repeats + 1):
        request_id = f"prefill-{seed}-{i}"
        engine.add_request(request_id, [rng.randrange(MIN_TOKEN_ID, vocab) for _ in range(length)], greedy(1))
        t0 = time.perf_counter()
        outputs = engine.step()
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
        if [len(out.new_token_ids) for out in outputs if out.request_id == request_id] != [1]:
            raise RuntimeError("the prompt was not prefilled in one step: raise max_num_batched_tokens")
        engine.abort([request_id])
    return times


# --------------------------------------------------------------------------------------------
# profile of a decode step


OP_GROUPS = [  # top-level aten ops of the model forward, by what they do
    ("weight matmuls (linear)", ("aten::linear", "aten::mm", "aten::addmm", "mkldnn::_linear_pointwise",
                                 "native::gemv")),
    ("attention: RoPE + KV write + paged decode (native)", ("native::paged_decode", "native::rope_write_decode")),
    ("all layers in one native call (LayersPlan)", ("native::decode_layers",)),
    ("norms and SwiGLU (native)", ("native::add_rms_norm", "native::silu_mul")),
    ("attention (sdpa or matmul/softmax)", ("aten::scaled_dot_product_attention", "aten::matmul", "aten::bmm",
                                            "aten::softmax", "aten::masked_fill", "aten::bitwise_not")),
    ("KV gather (index, index_select)", ("aten::index", "aten::index_select")),
    ("KV write (index_copy_)", ("aten::index_copy_",)),
]
OTHER_OPS = "other ops (norms, rope, residual, silu, copies)"


def label_native_kernels(model) -> Callable[[], None]:
    """Wrap the native kernels' calls (pybind functions, invisible to the profiler) in profiler
    regions named `native::<kernel>`, for the profile only; returns the function that undoes it."""
    from torch.profiler import record_function

    from baton.model import kernels

    module = kernels.loaded()
    if module is None:
        return lambda: None
    undo: list[Callable[[], None]] = []

    def labelled(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            with record_function(f"native::{name}"):
                return fn(*args, **kwargs)
        return call

    for name in ("paged_decode", "rope_write_decode", "decode_layers", "gemv", "greedy_pick"):
        if hasattr(module, name):
            original = getattr(module, name)
            setattr(module, name, labelled(name, original))
            undo.append(lambda name=name, original=original: setattr(module, name, original))
    owners = [(model, "fused_norm", "add_rms_norm")] + [(layer.mlp, "silu_mul", "silu_mul") for layer in model.layers]
    for owner, attr, name in owners:
        original = getattr(owner, attr, None)
        if original is not None:
            setattr(owner, attr, labelled(name, original))
            undo.append(lambda owner=owner, attr=attr, original=original: setattr(owner, attr, original))
    return lambda: [fn() for fn in reversed(undo)] and None


def profile_decode(engine, batch: int, context: int, steps: int, seed: int) -> None:
    """Where a decode step's time goes: (a) wall time of the engine's parts, by timers wrapped around
    them; (b) the model forward under torch.profiler: top-level aten ops by kind, and the gaps between
    them (Python: module calls, attribute lookups, argument parsing). The profiler adds a few us per
    op, so (b) is given as shares of the profiled forward, applied to the unprofiled forward time."""
    from torch.profiler import ProfilerActivity, profile, record_function

    import baton.engine.llm_engine as engine_module

    db = DecodeBatch(engine, batch, context, 2 * steps + 8, seed)
    for _ in range(2):
        db.step()
    runner, model = engine.runtime.runner, engine.runtime.runner.model
    original_sample = engine_module.sample

    # (a) timers around the parts of engine.step (instance attributes shadow the methods meanwhile)
    totals: dict[str, float] = {}

    def timed(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[label] = totals.get(label, 0.0) + time.perf_counter() - t0

        setattr(owner, name, wrapper)

    timed(engine.scheduler, "schedule", "schedule")
    timed(runner, "execute", "execute")
    timed(model, "forward", "forward")
    timed(engine_module, "sample", "sample")
    step = sum(db.step() for _ in range(steps)) / steps
    engine_module.sample = original_sample
    for owner, attr in ((engine.scheduler, "schedule"), (runner, "execute"), (model, "forward")):
        del owner.__dict__[attr]
    parts = {k: v / steps for k, v in totals.items()}
    parts["runner metadata (tensors)"] = parts["execute"] - parts["forward"]
    parts["engine bookkeeping"] = step - parts["schedule"] - parts["execute"] - parts["sample"]

    # (b) the forward under the profiler
    original_forward = model.forward

    def forward_region(*args, **kwargs):
        with record_function("bench::forward"):
            return original_forward(*args, **kwargs)

    model.forward = forward_region
    restore = label_native_kernels(model)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            db.step()
    restore()
    del model.__dict__["forward"]
    db.close()
    region_time = 0.0
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    num_ops = 0
    for ev in prof.events():
        if ev.name == "bench::forward":
            region_time += ev.cpu_time_total / 1e6
        parent = ev.cpu_parent
        if parent is None or parent.name != "bench::forward" or not ev.name.startswith(("aten::", "mkldnn::", "native::")):
            continue
        num_ops += 1
        kind = next((label for label, names in OP_GROUPS if ev.name in names), OTHER_OPS)
        by_kind[kind] = by_kind.get(kind, 0.0) + ev.cpu_time_total / 1e6
        if kind == OTHER_OPS:
            by_name[ev.name] = by_name.get(ev.name, 0.0) + ev.cpu_time_total / 1e6
    by_kind["Python between ops"] = region_time - sum(by_kind.values())

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:8.2f} ms"

    print(f"\n  batch {batch}, context ~{context}: decode step {step * 1e3:.2f} ms (mean of {steps})")
    for label in ("schedule", "runner metadata (tensors)", "forward", "sample", "engine bookkeeping"):
        name = {"schedule": "scheduler.schedule", "forward": "model forward", "sample": "sampling"}.get(label, label)
        print(f"    {name:<44}{ms(parts[label])}  {100 * parts[label] / step:5.1f}% of the step")
    forward = parts["forward"]
    print(f"  model forward under torch.profiler ({num_ops // steps} top-level ops; profiled forward "
          f"{region_time / steps * 1e3:.1f} ms; shares applied to the unprofiled {forward * 1e3:.1f} ms):")
    for kind, value in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        share = value / region_time
        print(f"    {kind:<44}{ms(share * forward)}  {100 * share:5.1f}% of the forward")
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:6]
    print("    (largest 'other' ops: " + ", ".join(f"{n.removeprefix('aten::')} {100 * v / region_time:.1f}%"
                                               for n, v in top) + ")")


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-requests", type=int, default=None, help="default 64 (16 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--quick", action="store_true", help="16 short requests: a smoke run (< 2 min)")
    parser.add_argument("--hf-batch-size", type=int, default=8, help="transformers static batch size")
    parser.add_argument("--skip-transformers", action="store_true", help="do not run the transformers baseline")
    parser.add_argument("--skip-steps", action="store_true", help="do not time decode steps / machine limits")
    parser.add_argument("--skip-hf-continuous", action="store_true",
                        help="do not run transformers' continuous batching baseline")
    parser.add_argument("--step-threads", type=int, default=1,
                        help="torch threads for the decode-step timings and their floors (default 1: what "
                             "`baton serve` gives a decode worker on 2 cores)")
    parser.add_argument("--profile", action="store_true",
                        help="also split a decode step at batch 1, 16 and 64 into its parts")
    args = parser.parse_args(argv)

    sizes = QUICK if args.quick else FULL
    num_requests = args.num_requests or sizes.num_requests
    torch.set_num_threads(args.threads)
    dtype = torch_dtype(args.dtype)

    from baton.common.model_files import resolve_model
    from baton.llm import LLM

    model_dir = resolve_model(args.model)
    config = ModelConfig.from_dir(model_dir)
    print(f"model {model_dir.name}: {config.num_layers} layers, hidden {config.hidden_size}, "
          f"vocab {config.vocab_size}; dtype {args.dtype}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"before: {loadavg()}")
    probes = [measure_matmul(dtype, repeats=5)[0]]  # the same rate start, middle and end: a quiet run
    requests = make_requests(num_requests, config.vocab_size, sizes.prompt_len, sizes.max_tokens, args.seed)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    useful_tokens = sum(r.max_tokens for r in requests)
    print(f"{num_requests} requests (seed {args.seed}): prompts {sizes.prompt_len[0]}-{sizes.prompt_len[1]} "
          f"tokens ({prompt_tokens} in all), max_tokens {sizes.max_tokens[0]}-{sizes.max_tokens[1]} "
          f"({useful_tokens} in all), greedy, ignore_eos")

    # ---- Baton
    llm = LLM(model=str(model_dir), dtype=args.dtype, max_num_seqs=64, max_num_batched_tokens=512,
              num_threads=args.threads)
    engine = llm.engine
    warm = make_requests(2, config.vocab_size, (32, 64), (4, 8), args.seed + 1)
    run_baton(llm, warm)  # first-call costs (oneDNN kernel selection, allocator) are not the engine's
    steps_before, preempt_before = engine.num_steps, engine.scheduler.num_preemptions
    baton_s, baton_tokens, baton_out, baton_steps = run_baton(llm, requests)
    if baton_tokens != useful_tokens:
        raise RuntimeError(f"Baton generated {baton_tokens} tokens, expected {useful_tokens}")
    baton_rate = baton_tokens / baton_s
    print(f"\nBaton LLM.generate: {baton_tokens} tokens in {baton_s:.1f} s -> {baton_rate:.1f} output tok/s "
          f"({engine.num_steps - steps_before} steps, "
          f"{engine.scheduler.num_preemptions - preempt_before} preemptions; "
          f"{(prompt_tokens + baton_tokens) / baton_s:.0f} tok/s prompt+output)")
    print(f"  {describe_steps(baton_steps)}")

    # ---- decode steps vs the machine's floors (before transformers runs, so that nothing it leaves
    # behind, threads or memory, can disturb these timings)
    if not args.skip_steps:
        torch.set_num_threads(args.step_threads)
        print(f"\ndecode steps and floors on {torch.get_num_threads()} thread(s), CPU: {cpu_model()}")
        read_bw, best_bw, copy_bw = measure_bandwidth()
        flops, best_flops = measure_matmul(dtype)  # the compute floor at the worker's thread count
        weights = weight_bytes_per_step(engine.runtime.model)
        kv_tok = kv_bytes_per_token(config, dtype)
        print(f"\nmachine (medians; best in brackets): memory read {read_bw / 1e9:.1f} GB/s [{best_bw / 1e9:.1f}] "
              f"(sum of 1 GiB fp32), copy {copy_bw / 1e9:.1f} GB/s (read+write); {args.dtype} matmul 2048^3 "
              f"{flops / 1e9:.0f} GFLOP/s [{best_flops / 1e9:.0f}]")
        print(f"per step: weights {weights / 1e6:.0f} MB read; KV {kv_tok / 1024:.1f} KiB per context token; "
              f"{2 * matmul_params(config) / 1e6:.0f} MFLOP per token + attention")
        ctx = sizes.step_context
        steps = measure_decode_steps(engine, sizes.step_batches, ctx, sizes.step_repeats, args.seed + 2)
        print(f"decode steps (engine.step, decode tokens only, context ~{ctx}, median of {sizes.step_repeats}):")
        for batch, times in steps.items():
            seconds = statistics.median(times)
            bw_floor = (weights + batch * ctx * kv_tok) / read_bw
            compute_floor = step_flops(config, batch, ctx) / flops
            print(f"  batch {batch:>2}: {seconds * 1e3:6.1f} ms/step (floor: bandwidth {bw_floor * 1e3:.1f} ms, "
                  f"compute {compute_floor * 1e3:.1f} ms) -> {batch / seconds:.0f} tok/s  "
                  f"[{seconds / max(bw_floor, compute_floor):.1f}x the floor; best step {min(times) * 1e3:.1f} ms]")
        prefill_times = measure_prefill(engine, 512, 5, args.seed + 4)
        prefill_s = statistics.median(prefill_times)
        prefill_floor = step_flops(config, 512, 256) / flops  # 512 tokens attending ~256 on average
        print(f"  prefill of one 512-token prompt: {prefill_s * 1e3:6.1f} ms (compute floor {prefill_floor * 1e3:.1f} ms)"
              f" -> {512 / prefill_s:.0f} prompt tok/s [{prefill_s / prefill_floor:.1f}x the floor]")
        print("  (bandwidth floor = (weights + batch x context x KV bytes/token) / read bandwidth; "
              "compute floor = step FLOPs / 2048^3 matmul rate)")
        torch.set_num_threads(args.threads)
        probes.append(measure_matmul(dtype, repeats=5)[0])  # the noise probe, at the run's thread count

    # ---- transformers, static batches
    if not args.skip_transformers:
        hf = load_hf(model_dir, dtype)
        pad_id = llm.tokenizer.pad_token_id
        if pad_id is None:
            pad_id = config.eos_token_ids[0] if config.eos_token_ids else 0
        run_hf(hf, warm, args.hf_batch_size, pad_id)
        hf_s, hf_useful, hf_slots, hf_out = run_hf(hf, requests, args.hf_batch_size, pad_id)
        hf_rate = hf_useful / hf_s
        wasted = 100 * (hf_slots - hf_useful) / hf_slots
        print(f"transformers generate, static batches of {args.hf_batch_size}: {hf_useful} useful tokens in "
              f"{hf_s:.1f} s -> {hf_rate:.1f} useful tok/s ({hf_slots} slots generated, {wasted:.0f}% wasted)")
        same, prefix = agreement(baton_out, hf_out)
        print(f"greedy outputs identical for {same}/{num_requests} requests (median common prefix {prefix} "
              f"tokens; {args.dtype} numerics differ between the implementations)")
        print(f"\n==> Baton {baton_rate:.1f} tok/s vs transformers static batches {hf_rate:.1f} tok/s: "
              f"{baton_rate / hf_rate:.2f}x")
        if not args.skip_hf_continuous:
            try:
                run_hf_continuous(hf, warm)
                cb_s, cb_tokens = run_hf_continuous(hf, requests)
                cb_rate = cb_tokens / cb_s
                print(f"==> Baton {baton_rate:.1f} tok/s vs transformers continuous batching "
                      f"(generate_batch's manager; {cb_tokens} tokens in {cb_s:.1f} s) {cb_rate:.1f} tok/s: "
                      f"{baton_rate / cb_rate:.2f}x")
            except Exception as exc:  # noqa: BLE001 - an optional baseline; say why it is missing
                print(f"transformers continuous batching unavailable here: {type(exc).__name__}: {exc}")
        del hf
        gc.collect()
    else:
        print(f"\n==> Baton {baton_rate:.1f} tok/s (transformers skipped)")

    if args.profile:
        torch.set_num_threads(args.step_threads)  # as the decode steps above were timed
        print(f"\nprofile of a decode step ({args.dtype}, {torch.get_num_threads()} thread(s)):")
        for batch in (1, 16, 64):
            profile_decode(engine, batch, sizes.step_context, 10, args.seed + 3)
        torch.set_num_threads(args.threads)

    probes.append(measure_matmul(dtype, repeats=5)[0])
    print(f"\nafter: {loadavg()}")
    steady = min(probes) / max(probes) > 0.85
    print(f"noise check: {args.dtype} 2048^3 matmul at the start, {'middle, ' if len(probes) > 2 else ''}end: "
          + ", ".join(f"{p / 1e9:.0f}" for p in probes) + " GFLOP/s"
          + ("" if steady else " -- they differ: other processes ran, distrust this run"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
