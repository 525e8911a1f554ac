"""Speculative decoding (n-gram prompt lookup): exact, cheaper in steps, and leak-free.

Greedy output with speculation on is token for token the output with it off and transformers'
(batched, chunked prefill, preemption; the tiny Llama and a sliding-window Mistral); seeded
sampling gives the very tokens speculation off gives (a function of (seed, position)), and the
verify rule keeps the target distribution (a chi-square bound that an accept-always rule fails);
a stop inside an accepted run emits nothing after it; the KV pool is whole again at the end.
Tiny models, float32, one thread; the engine's cost model is forced on (`costs.force`) where a test
needs verify steps to happen, and tested alone with synthetic step times.
"""

from __future__ import annotations

import argparse
import random

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.block_manager import BlockManager
from baton.engine.block_pool import BlockPool
from baton.common.finish_reason import FinishReason
from baton.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from baton.engine.sequence import Sequence, SequenceStatus
from baton.engine.sampling import sample
from baton.engine.speculative_config import SpeculativeConfig, parse_speculative_config
from baton.engine.ngram_proposer import NgramIndex, propose
from baton.engine.speculation_policy import RETRY_STEPS, RowPolicy, StepCostModel
from tests.test_engine_tiny import assert_pool_all_free, tokens_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
VOCAB = 49152


def make_llm(model_dir, spec: bool, force: bool | None = True, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    llm = LLM(model=str(model_dir), dtype="float32", speculative_config=SPEC if spec else None, **kwargs)
    if spec and force is not None:
        llm.engine.scheduler.speculator.costs.force = force
    return llm


def greedy(max_tokens: int = 40, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Repetitive prompts (a phrase the answer can copy) and plain random ones, of mixed lengths."""
    rng = random.Random(99)
    phrase = [rng.randrange(3, VOCAB) for _ in range(12)]
    return [phrase * 4, [rng.randrange(3, VOCAB) for _ in range(30)], phrase * 2 + [5, 6, 7],
            [rng.randrange(3, VOCAB) for _ in range(5)], phrase[:7] * 6]


_HF: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def hf_greedy(model_dir, prompt: list[int], max_new_tokens: int) -> list[int]:
    key = (str(model_dir), tuple(prompt), max_new_tokens)
    if key not in _HF:
        from transformers import AutoModelForCausalLM, GenerationConfig

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        _HF[key] = out[0, len(prompt):].tolist()
    return _HF[key]


# ------------------------------------------------------------------ config and flags

def test_config_parses_vllms_shape_and_refuses_what_it_cannot_run():
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    assert config == SpeculativeConfig("ngram", 3, 5, 2)
    assert parse_speculative_config(None) is None and parse_speculative_config("") is None
    assert parse_speculative_config({"method": "draft_model", "model": "/m", "num_speculative_tokens": 4}) == \
        SpeculativeConfig("draft_model", 4, model="/m")
    with pytest.raises(ValueError, match="'eagle' is not yet supported"):
        parse_speculative_config({"method": "eagle", "model": "/m", "num_speculative_tokens": 4})
    with pytest.raises(ValueError, match="model.*required"):
        parse_speculative_config({"method": "draft_model", "num_speculative_tokens": 4})
    with pytest.raises(ValueError, match="prompt_lookup_max.*ngram"):
        parse_speculative_config({"method": "draft_model", "model": "/m", "num_speculative_tokens": 4,
                                  "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="model.*draft_model"):
        parse_speculative_config({"method": "ngram", "model": "/m", "num_speculative_tokens": 4})
    with pytest.raises(ValueError, match="unknown field.*lookahead"):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
                                  "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_speculative_config("{method: ngram}")


def test_decode_worker_flag_and_baton_serve_pass_the_config(monkeypatch):
    from pathlib import Path

    from baton.cli.serve import ThreadPlan, add_serve_arguments, build_child_specs
    from baton.worker.args import worker_parser
    from tests.test_cli import child_config

    parser = worker_parser("decode")
    assert parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
                             ).speculative_config == SpeculativeConfig("ngram", 2, 4, 2)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'])
    monkeypatch.setenv("BATON_SPECULATIVE_CONFIG", '{"method": "ngram", "num_speculative_tokens": 6}')
    assert worker_parser("decode").parse_args([]).speculative_config.num_speculative_tokens == 6
    monkeypatch.delenv("BATON_SPECULATIVE_CONFIG")
    serve = argparse.ArgumentParser()
    add_serve_arguments(serve)
    args = serve.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    specs = build_child_specs(args, Path("/m"), "redis://127.0.0.1:1/0", ThreadPlan([1], [1], cpus=2), python="py")
    assert child_config(specs[1]).speculative_config == SpeculativeConfig("ngram", 3, 4, 2)
    assert child_config(specs[0]).speculative_config is None  # the decode workers' only


# ------------------------------------------------------------------ the proposer

def test_ngram_lookup_proposes_what_followed_the_latest_longest_match():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]
    assert propose(tokens, 3, 2, 4) == [7, 1, 2]  # "1 2 3" last seen ending at 7: then 7 1 2
    assert propose([5, 1, 2, 8, 8, 4, 1, 2], 2, 2, 4) == [8, 8]
    assert propose([5, 6, 7, 8], 3, 2, 4) == []  # no earlier occurrence
    assert propose([4, 4, 4, 4], 3, 2, 4) == [4, 4, 4]  # a run continues past the end
    assert propose([1, 2, 1, 2], 5, 2, 2) == [1, 2, 1, 2, 1]  # and so does a cycle
    assert propose([3, 1, 2, 3, 1], 2, 1, 1) == [2, 3]  # n = 1 when allowed


def test_incremental_index_equals_the_reference_on_growing_sequences():
    rng = random.Random(7)
    for trial in range(40):
        index, tokens = NgramIndex(2, 4), [rng.randrange(6) for _ in range(rng.randrange(1, 8))]
        for _ in range(60):
            assert index.propose(tokens, 4) == propose(tokens, 4, 2, 4), (trial, tokens)
            tokens.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))  # accepted runs grow it


# ------------------------------------------------------------------ greedy: exact

def test_greedy_with_speculation_is_the_output_without_it_and_transformers(tiny_model_dir, prompts):
    off = tokens_of(make_llm(tiny_model_dir, spec=False).generate(prompts, greedy()))
    assert off == [hf_greedy(tiny_model_dir, p, 40) for p in prompts]
    for kwargs in ({}, {"max_num_batched_tokens": 8}, {"block_size": 4, "num_kv_blocks": 24}):
        llm = make_llm(tiny_model_dir, spec=True, **kwargs)
        assert tokens_of(llm.generate(prompts, greedy())) == off, kwargs
        stats = llm.engine.stats()
        assert stats.spec_num_accepted_tokens > 0 and stats.spec_accepted_per_pos[1] > 0, kwargs
        assert_pool_all_free(llm)
        if "num_kv_blocks" in kwargs:
            assert llm.engine.scheduler.num_preemptions > 0


def test_logprobs_and_max_tokens_mid_run_are_the_plain_ones(tiny_model_dir, prompts):
    params = [greedy(max_tokens=n, logprobs=2) for n in (9, 13, 21, 6, 17)]
    off = make_llm(tiny_model_dir, spec=False).generate(prompts, params)
    on = make_llm(tiny_model_dir, spec=True).generate(prompts, params)
    for a, b, p in zip(off, on, params):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids and len(b.outputs[0].token_ids) == p.max_tokens
        assert b.outputs[0].logprobs == pytest.approx(a.outputs[0].logprobs, abs=1e-4)
        assert b.outputs[0].finish_reason == "length"


def test_repetitive_prompt_accepts_and_takes_fewer_steps(tiny_model_dir, prompts):
    plain = make_llm(tiny_model_dir, spec=False)
    expected = tokens_of(plain.generate([prompts[0]], greedy(60)))
    llm = make_llm(tiny_model_dir, spec=True)
    assert tokens_of(llm.generate([prompts[0]], greedy(60))) == expected
    assert llm.engine.stats().spec_num_accepted_tokens > 0
    assert llm.engine.num_steps < plain.engine.num_steps


def test_sliding_window_family_matches_transformers(tmp_path_factory, default_model_dir, prompts):
    from tests.test_families import build_family

    model_dir = build_family("mistral", tmp_path_factory.mktemp("spec-mistral"), default_model_dir)
    long_prompts = [p for p in prompts if len(p) > 24]  # longer than its window
    expected = [hf_greedy(model_dir, p, 40) for p in long_prompts]
    llm = make_llm(model_dir, spec=True, num_kv_blocks=128)
    assert tokens_of(llm.generate(long_prompts, greedy())) == expected
    assert llm.engine.stats().spec_num_accepted_tokens > 0


def test_a_stop_token_inside_an_accepted_run_ends_it_there(tiny_model_dir, prompts):
    ref = tokens_of(make_llm(tiny_model_dir, spec=False).generate([prompts[0]], greedy()))[0]
    # a token first produced late (in the repetitive tail, where runs are accepted)
    index = max(i for i, t in enumerate(ref) if t not in ref[:i])
    llm = make_llm(tiny_model_dir, spec=True)
    out = llm.generate([prompts[0]], greedy(stop_token_ids=[ref[index]]))[0].outputs[0]
    assert out.token_ids == ref[:index + 1] and out.finish_reason == "stop"
    assert_pool_all_free(llm)


def test_scheduler_emits_nothing_after_eos_in_an_accepted_run():
    """The unit view: proposals [7, EOS, 8] all match the samples; only 7 and EOS are emitted."""
    pool = BlockPool(16, 4)
    bm = BlockManager(pool, "m")
    sched = Scheduler(SchedulerConfig(max_model_len=64), bm, eos_token_ids=[2],
                      speculative=SpeculativeConfig("ngram", 3, 2, 1))
    sched.speculator.costs.force = True
    seq = Sequence("r", [5, 7, 2, 8, 6], SamplingParams(temperature=0, max_tokens=20))
    sched.add(seq)
    plan = sched.schedule()
    sched.update_from_output(plan, *_sampled(plan, [5]))  # the prompt, then its first token: 5
    plan = sched.schedule()
    assert seq.speculation.proposals == [7, 2, 8] and plan.scheduled == [(seq, 4)]
    outs = sched.update_from_output(plan, [], [], [], None, [(seq, [7, 2, 8, 9], [0.0] * 4, [[]] * 4)])
    assert outs[0].new_token_ids == [7, 2] and outs[0].finished and seq.finish_reason is FinishReason.STOP
    assert seq.status is SequenceStatus.FINISHED and pool.num_free_blocks == pool.num_blocks - 1
    pool.check_invariants()


def _sampled(plan: SchedulerOutput, tokens: list[int]):
    seqs = [s for s, _ in plan.scheduled]
    return seqs, tokens, [0.0] * len(tokens)


def test_rejected_slots_are_released_and_only_accepted_blocks_cached():
    pool = BlockPool(32, 4)
    bm = BlockManager(pool, "m")
    sched = Scheduler(SchedulerConfig(max_model_len=64), bm, speculative=SpeculativeConfig("ngram", 4, 2, 1))
    sched.speculator.costs.force = True
    seq = Sequence("r", [1, 2, 3, 1, 2, 3, 1], SamplingParams(temperature=0, max_tokens=30))
    sched.add(seq)
    plan = sched.schedule()
    sched.update_from_output(plan, *_sampled(plan, [2]))  # tokens: 1 2 3 1 2 3 1 2 (8, two blocks)
    free_before = pool.num_free_blocks
    plan = sched.schedule()
    assert seq.speculation.proposals == [3, 1, 2, 3] and len(seq.block_table) == 3  # 8 + 4 slots: 3 blocks
    # the target agrees with 3 only: emitted 3 and its own 9; 10 tokens, 9 computed
    sched.update_from_output(plan, [], [], [], None, [(seq, [3, 9, 9, 9, 9], [0.0] * 5, [[]] * 5)])
    assert seq.token_ids[8:] == [3, 9] and seq.num_computed_tokens == 9
    assert len(seq.block_table) == 3 and pool.num_free_blocks == free_before - 1
    assert seq.num_registered_blocks == 2  # blocks 0-1 (tokens 0-7, all accepted); not the third
    assert sched.speculator.stats.num_draft_tokens == 4 and sched.speculator.stats.num_accepted_tokens == 1
    sched.abort("r")
    assert pool.num_free_blocks == pool.num_blocks - 1
    pool.check_invariants()


# ------------------------------------------------------------------ sampled: the target's distribution

def test_seeded_sampling_gives_the_tokens_of_speculation_off(tiny_model_dir, prompts):
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=30, seed=seed, ignore_eos=True,
                             repetition_penalty=1.1 if seed % 2 else 1.0) for seed in range(10)]
    batch = [prompts[0]] * 5 + [prompts[4]] * 5
    off = tokens_of(make_llm(tiny_model_dir, spec=False).generate(batch, params))
    llm = make_llm(tiny_model_dir, spec=True)
    assert tokens_of(llm.generate(batch, params)) == off
    assert llm.engine.stats().spec_num_drafts > 0


def _chi_square(counts: dict[int, int], probs: torch.Tensor, n: int) -> float:
    return sum((counts.get(t, 0) - n * float(probs[t])) ** 2 / (n * float(probs[t]))
               for t in range(len(probs)) if probs[t] > 0)


def test_verify_rule_keeps_the_target_distribution_and_a_wrong_rule_is_caught():
    """Position 0 of a verify row: the emitted token is the sample if it differs from the proposal,
    else the proposal. Over many seeds its histogram must fit p; accepting the proposal outright
    (the classic bug) must not. 7 degrees of freedom: chi-square 24 is p < 0.001."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.8]])
    probs = torch.softmax(logits[0], -1)
    proposal, n = 1, 4000
    ours: dict[int, int] = {}
    always: dict[int, int] = {}
    for seed in range(n):
        params = SamplingParams(temperature=1.0, seed=seed)
        token = sample(logits, [params], [[]], [3])[0][0]
        accepted = token == proposal  # the verify rule (baton.engine.speculator)
        emitted = proposal if accepted else token
        ours[emitted] = ours.get(emitted, 0) + 1
        always[proposal] = always.get(proposal, 0) + 1
    assert _chi_square(ours, probs, n) < 24
    assert _chi_square(always, probs, n) > 24


# ------------------------------------------------------------------ never a loss

def test_cost_model_verifies_only_where_it_is_cheaper_per_token():
    costs = StepCostModel()
    assert costs.choose_cap(1, [4], [0.75]) == 0  # nothing measured: a plain step first
    costs.observe(1, 1, 0.010, verified=False)
    assert costs.choose_cap(1, [4], [0.75]) == 1  # verify never measured: explore, smallest cap first
    costs.observe(1, 2, 0.0105, verified=True)
    assert costs.choose_cap(1, [4], [0.75]) == 2  # the next bucket (3 tokens -> 4)
    costs.observe(1, 3, 0.011, verified=True)
    assert costs.choose_cap(1, [4], [0.75]) == 4  # and the last (5 tokens -> 8)
    costs.observe(1, 5, 0.012, verified=True)
    assert costs.choose_cap(1, [4], [0.75]) == 4  # 12 ms for 4 tokens beats 10 ms for 1
    assert costs.choose_cap(1, [4], [0.02]) == 0  # ... but not for 1.08
    # four rows whose kernels turn compute-bound past 16 query tokens: two proposals each win
    costs.observe(4, 4, 0.010, verified=False)
    for tokens, seconds in ((8, 0.011), (12, 0.012), (16, 0.013), (20, 0.030)):
        costs.observe(4, tokens, seconds, verified=True)
    assert costs.choose_cap(4, [4, 4, 4, 4], [0.7, 0.7, 0.7, 0.7]) == 3  # 16 tokens: (4 + 8.4) / 12.25 ms
    # a large batch whose verify step costs twice a plain one, for few accepted tokens
    costs.observe(64, 64, 0.050, verified=False)
    for tokens in (128, 192, 256, 320):
        costs.observe(64, tokens, 0.100, verified=True)
    decisions = [costs.choose_cap(64, [4] * 64, [0.03] * 64) for _ in range(RETRY_STEPS + 1)]
    assert not any(decisions[:-1]) and decisions[-1] == 4  # off, retried once after RETRY_STEPS


def test_a_row_that_keeps_failing_stops_proposing_for_a_while():
    row = RowPolicy()
    for _ in range(10):
        row.observe(4, 0)
        if row.skip:
            break
    assert row.skip > 0
    skipped = 0
    while not row.may_propose():
        skipped += 1
    assert skipped > 0 and row.may_propose()


def test_engine_with_the_measured_policy_is_exact_and_reports_metrics(tiny_model_dir, prompts):
    from prometheus_client import CollectorRegistry, generate_latest

    from baton.worker.metrics import WorkerMetrics

    off = tokens_of(make_llm(tiny_model_dir, spec=False).generate(prompts, greedy()))
    llm = make_llm(tiny_model_dir, spec=True, force=None)
    assert tokens_of(llm.generate(prompts, greedy())) == off
    stats = llm.engine.stats()
    registry = CollectorRegistry()
    metrics = WorkerMetrics("tiny", "decode", registry)
    metrics.spec_decode(stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens,
                        stats.spec_accepted_per_pos)
    text = generate_latest(registry).decode()
    assert f'baton:worker_spec_decode_num_draft_tokens_total{{model_name="tiny",worker_kind="decode"}} {float(stats.spec_num_draft_tokens)}' in text
    assert 'baton:worker_spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0",worker_kind="decode"}' in text
    assert_pool_all_free(llm)


# ------------------------------------------------------------------ the serving dtype: a verify step is a decode step

def test_on_the_default_gguf_speculation_gives_the_plain_greedy_tokens(default_gguf_model_dir):
    """The default model as `baton serve` serves it (its Q4_1 blocks, bf16 activations): verified
    positions run as decode queries through the decode kernels, so their logits are the plain
    steps' and the greedy text is the same with speculation on (a verify chunk through the prefill
    path gave other numbers, and other tokens at near-ties)."""
    from baton.cli.bench.datasets import sample_grounded_requests

    plain = LLM(model=str(default_gguf_model_dir), num_kv_blocks=256)
    prompts = [r.prompt for r in sample_grounded_requests(plain.tokenizer, 2, 48)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    expected = [[o.outputs[0].token_ids] for o in (plain.generate(p, params)[0] for p in prompts)]
    llm = LLM(model=str(default_gguf_model_dir), num_kv_blocks=256, speculative_config=SPEC)
    llm.engine.scheduler.speculator.costs.force = True
    got = [[llm.generate(p, params)[0].outputs[0].token_ids] for p in prompts]  # one client at a time
    assert got == expected
    assert llm.engine.stats().spec_num_accepted_tokens > 10


def test_constrained_rows_speculate_within_their_grammar(tiny_model_dir, prompts):
    """A JSON-schema row proposes only what its grammar accepts and each verified position is
    masked after the proposals before it: greedy and seeded sampled outputs are speculation off's,
    valid JSON, and proposals were verified and accepted."""
    import json

    import jsonschema

    from baton.common.structured import json_schema

    schema = {"type": "object", "properties": {"xs": {"type": "array", "minItems": 12, "maxItems": 12,
                                                      "items": {"type": "integer", "minimum": 0, "maximum": 3}}},
              "required": ["xs"], "additionalProperties": False}
    params = [SamplingParams(temperature=0, max_tokens=80, structured=json_schema(schema)),
              SamplingParams(temperature=1.0, seed=3, max_tokens=80, structured=json_schema(schema)),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]  # an unconstrained row beside them
    batch = [prompts[0], prompts[1], prompts[4]]
    off = make_llm(tiny_model_dir, spec=False).generate(batch, params)
    constrained = make_llm(tiny_model_dir, spec=True)  # the constrained rows alone: they do speculate
    assert tokens_of(constrained.generate(batch[:2], params[:2])) == tokens_of(off[:2])
    stats = constrained.engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0, stats
    llm = make_llm(tiny_model_dir, spec=True)
    on = llm.generate(batch, params)
    assert tokens_of(on) == tokens_of(off)
    for out in on[:2]:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert_pool_all_free(llm)
