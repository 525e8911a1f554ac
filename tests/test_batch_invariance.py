"""Greedy decode in bf16 (the default dtype) is batch-invariant: a request's tokens do not depend on
what else shares its steps (issue #20, item 12).

Why it matters: when a decode worker dies, a live one claims the request's handoff, loads the prompt's
KV and regenerates from the first token, in its own batch; the gateway compares the regenerated tokens
with those already sent and fails the request (`resume_mismatch`) at the first difference. Before the
fix, each projection's matmul kernel was chosen by row count (the native kernel up to a tuned count,
oneDNN above, and oneDNN's own kernel changes with M), so on one thread 3 of 6 prompts decoded alone
differed from the same prompts inside a batch of 24, from tokens 1, 6 and 11.
"""

from __future__ import annotations

import random

import pytest
import torch

from baton import LLM, SamplingParams

pytestmark = pytest.mark.real_model

NEW_TOKENS = 48
WORDS = ("the a robot paints cat river mountain code python list three facts about moon write story explain "
         "how why when city France Paris number seven twelve").split()


def _prompt(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module", autouse=True)
def invariant_mode():
    """The mode under test, on any CPU with the native matmul (the default, auto, turns it on only
    where it runs on AMX); the workers the cluster test starts inherit it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATON_BATCH_INVARIANT", "full")
        yield


@pytest.fixture(scope="module")
def llm(default_model_dir, one_torch_thread):
    from baton.model import kernels

    llm = LLM(model=str(default_model_dir), dtype="bfloat16", enable_prefix_caching=False)
    native = kernels.loaded()
    if native is None or not native.gemv_available():
        pytest.skip("batch-invariant bf16 matmuls need the native kernel (AVX512-BF16)")
    return llm


@pytest.fixture(scope="module")
def prompts(llm):
    rng = random.Random(0)
    encode = llm.tokenizer.encode
    targets = [encode(_prompt(rng, n), add_special_tokens=False) for n in (5, 12, 20, 33, 47, 70)]
    others = [encode(_prompt(rng, rng.randint(3, 120)), add_special_tokens=False) for _ in range(18)]
    return targets, others


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def in_batch_outputs(llm, prompts) -> list:
    """The targets' outputs inside a batch of 24 (the others of varied lengths and output lengths, so
    the batch shrinks as they finish)."""
    targets, others = prompts
    batch = others[:9] + targets + others[9:]
    params = [greedy(16 + 8 * (i % 5)) for i in range(9)] + [greedy()] * len(targets) + \
             [greedy(16 + 8 * (i % 5)) for i in range(9)]
    outputs = llm.generate(batch, params)
    return [o.outputs[0] for o in outputs[9:9 + len(targets)]]


@pytest.fixture(scope="module")
def in_batch(in_batch_outputs) -> list[list[int]]:
    return [o.token_ids for o in in_batch_outputs]


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def test_greedy_tokens_alone_equal_the_tokens_inside_a_batch(llm, prompts, in_batch_outputs):
    targets, _ = prompts
    alone = [llm.generate([ids], greedy())[0].outputs[0] for ids in targets]
    differences = [_first_difference(a.token_ids, b.token_ids) for a, b in zip(alone, in_batch_outputs)]
    assert differences == [None] * len(targets), f"first differing token per prompt: {differences}"
    # not only the tokens: the numbers (every log-probability bit for bit)
    assert [a.logprobs for a in alone] == [b.logprobs for b in in_batch_outputs]


def test_a_request_resumed_in_another_batch_continues_with_the_tokens_already_sent(llm, prompts, in_batch,
                                                                                   in_batch_outputs):
    """What a decode worker that takes over does: the prompt and its first token (the handoff's), the
    prompt's KV computed again (here; a worker loads it from the store unless it is missing there),
    then decode from the first token while other requests, already mid-decode, share the steps. And
    a request recomputed from its prompt and 17 generated tokens (a preemption by recompute, or KV
    lost with the store): the generated tokens' KV then comes from a prefill chunk, not from the decode
    steps that first made it, and must be the same."""
    targets, others = prompts
    engine = llm.engine
    for i, ids in enumerate(others[3:14]):
        engine.add_request(f"busy-{i}", ids, greedy(NEW_TOKENS + 8))
    for _ in range(5):  # the others are decoding when the resumed requests arrive
        engine.step()
    resumed_at = [1 if i % 2 else 17 for i in range(len(targets))]
    for i in reversed(range(len(targets))):  # another order than the original batch's
        engine.add_request(f"resumed-{i}", targets[i], greedy(), output_token_ids=in_batch[i][:resumed_at[i]])
    tokens: dict[str, list[int]] = {f"resumed-{i}": in_batch[i][:resumed_at[i]] for i in range(len(targets))}
    logprobs: dict[str, list[float]] = {request_id: [] for request_id in tokens}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id in tokens:
                tokens[out.request_id] += out.new_token_ids
                logprobs[out.request_id] += out.new_logprobs
    differences = [_first_difference(tokens[f"resumed-{i}"], original) for i, original in enumerate(in_batch)]
    assert differences == [None] * len(targets), f"first differing token per resumed request: {differences}"
    for i, original in enumerate(in_batch_outputs):
        assert logprobs[f"resumed-{i}"] == original.logprobs[resumed_at[i]:], i  # the same numbers, bit for bit


@pytest.mark.parametrize("choice", ["amx", "avx512bf16"])
def test_the_native_matmul_computes_each_row_alike_for_every_row_count(choice):
    """The kernel behind every bf16 projection in this mode: a row's output is bit-identical whatever
    the number of rows in the call (1 to 513: every tiling and tail) and the row's place in it; both
    paths (AMX, used where the CPU has it, and AVX512-BF16)."""
    from baton.model import kernels

    native = kernels.load()
    if native is None or not native.gemv_available():
        pytest.skip("the native matmul needs AVX512-BF16")
    before = native.gemv_kernel("")
    if native.gemv_kernel(choice) != choice:
        native.gemv_kernel(before)
        pytest.skip(f"no {choice} path on this CPU")
    try:
        _check_rows_alike(native)
    finally:
        native.gemv_kernel(before)


def _check_rows_alike(native) -> None:
    gen = torch.Generator().manual_seed(0)
    for out_features, in_features in ((960, 576), (576, 1536), (100, 38)):
        w = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(torch.bfloat16)
        packed = native.gemv_pack(w)
        x = torch.randn(520, in_features, generator=gen).to(torch.bfloat16)
        alone = torch.cat([native.gemv(x[i:i + 1], packed, None, out_features, False) for i in range(40)])
        for rows in (1, 2, 5, 6, 7, 15, 16, 17, 31, 32, 33, 40, 64, 100, 513):
            got = native.gemv(x[:rows], packed, None, out_features, False)
            assert torch.equal(got[:40], alone[:rows]), (out_features, in_features, rows)
        shifted = native.gemv(x[3:70], packed, None, out_features, False)  # the rows at other places
        assert torch.equal(shifted[:37], alone[3:40])


def test_sigkill_of_a_decode_worker_in_bf16_loses_no_stream(default_model_dir, llm, prompts):
    """The issue's scenario, in the default dtype: 2 prefill + 2 decode workers in bf16, 12 greedy
    streams, kill -9 of one decode worker mid-way; every stream must end with the tokens the engine
    gives alone (no `resume_mismatch`, no other error, nothing held afterwards)."""
    from tests.cluster import Cluster
    from tests.test_faults import expected_ids, run_streams_and_kill

    rng = random.Random(5)
    texts = [_prompt(rng, 4 + 5 * i) for i in range(12)]
    with Cluster(default_model_dir, prefill=2, decode=2, dtype="bfloat16") as cluster:
        got = run_streams_and_kill(cluster, texts, 64, "decode-0", after_tokens=12 * 24)
        expected = expected_ids(llm, texts, 64)
        differences = [_first_difference(g, e) for g, e in zip(got, expected)]
        assert differences == [None] * len(texts), f"first differing token per stream: {differences}"
        assert cluster.procs["decode-0"].poll() is not None
        cluster.wait_idle(timeout=60)


def test_every_bf16_projection_takes_one_kernel_for_every_row_count_unless_turned_off(tiny_model_dir, monkeypatch):
    """The mode's wiring: by default no projection (layers, lm_head) switches kernel with the row
    count, nor does the all-layers native call, and prefill attends through the decode kernel;
    BATON_BATCH_INVARIANT=matmul keeps the first only, =0 restores the tuned split and SDPA."""
    from baton.model import kernels
    from baton.model.linear import ALL_ROWS, RowSplitLinear

    native = kernels.load()
    if native is None or not native.gemv_available():
        pytest.skip("the native matmul needs AVX512-BF16")
    tiny = LLM(model=str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=16)  # full (the module's mode)
    model = tiny.engine.runtime.model
    ops = [op for layer in model.layers for op in (layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up,
                                                  layer.mlp.down)] + [model.head]
    assert all(isinstance(op, RowSplitLinear) and op.max_native_rows == ALL_ROWS for op in ops)
    assert model.layers_plan is not None and model.layers_plan.max_native_rows == [ALL_ROWS] * 4
    assert all(layer.self_attn.backend.decode_style_prefill for layer in model.layers)
    monkeypatch.setenv("BATON_BATCH_INVARIANT", "matmul")
    model.prepare()
    assert model.head.max_native_rows == ALL_ROWS
    assert not any(layer.self_attn.backend.decode_style_prefill for layer in model.layers)
    monkeypatch.setenv("BATON_BATCH_INVARIANT", "0")
    model.prepare()
    ops = [op for layer in model.layers for op in (layer.self_attn.qkv, layer.mlp.down)] + [model.head]
    assert not any(isinstance(op, RowSplitLinear) and op.max_native_rows == ALL_ROWS for op in ops)
    assert not any(layer.self_attn.backend.decode_style_prefill for layer in model.layers)
    monkeypatch.delenv("BATON_BATCH_INVARIANT")  # the default, auto: full wherever the native matmul runs
    model.prepare()
    assert isinstance(model.head, RowSplitLinear) and model.head.max_native_rows == ALL_ROWS
    assert model.head.large is None  # no oneDNN pack made: the native pack is the weight's only copy
    assert all(layer.self_attn.backend.decode_style_prefill for layer in model.layers)


@pytest.mark.parametrize("kernel,mode", [("amx", "full"), ("avx512bf16", "full"), ("none", "off")])
def test_the_default_is_invariant_wherever_the_native_matmul_runs(monkeypatch, kernel, mode):
    from baton.model.linear import batch_invariant_mode

    class Kernels:
        @staticmethod
        def gemv_kernel(choice: str) -> str:
            return kernel

    monkeypatch.delenv("BATON_BATCH_INVARIANT")
    assert batch_invariant_mode(Kernels()) == mode
    assert batch_invariant_mode(None) == "off"
    for value, forced in (("full", "full"), ("1", "full"), ("matmul", "matmul"), ("off", "off"), ("0", "off")):
        monkeypatch.setenv("BATON_BATCH_INVARIANT", value)
        assert batch_invariant_mode(Kernels()) == forced
