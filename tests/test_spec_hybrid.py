"""Speculative decoding on the hybrids (Gated DeltaNet, short-conv and Mamba-2 state layers beside attention).

A state layer cannot cut its memory back the way the KV is cut back: a verify row runs its last
token and k proposals through the state layers one recurrent step each, the state after each of
its tokens but the last kept in a free state slot, and the engine keeps the one its accepted
tokens reach (baton.model.gated_deltanet.StateMeta). What a user would notice, and what is checked:
the tokens are speculation off's, token for token, whatever is accepted (every count from none to
all: the proposals here are the target's own next tokens with one spoiled at a position that
moves each step), through chunked prefill and preemption, in float32 and in bf16 through the
native Gated DeltaNet step; the acceptance is what the stats say; every state slot is free again
at the end; and a draft model with state layers is refused.
"""

from __future__ import annotations

import pytest

from baton import LLM, SamplingParams
from tests.test_engine_tiny import assert_pool_all_free
from tests.test_families import prompts, tokens_of  # noqa: F401 (a fixture)
from tests.test_hybrid import hybrid_dir  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def with_oracle_proposals(llm: LLM, future: dict[tuple[int, ...], list[int]]) -> None:
    """The speculator proposes each request's true next tokens (speculation off's), with the one at
    position (step mod k + 1) spoiled: over the steps every accepted count 0..k occurs."""
    speculator = llm.engine.scheduler.speculator
    speculator.costs.force = True
    calls = [0]

    def proposals(scheduled, budget):
        wanted = {}
        for seq in speculator._candidates(scheduled):
            k = speculator._room(seq, budget)
            whole = list(seq.prompt_token_ids) + future[tuple(seq.prompt_token_ids)]
            draft = whole[seq.num_tokens:seq.num_tokens + k]
            if not draft:
                continue
            spoil = calls[0] % (len(draft) + 1)
            if spoil < len(draft):
                draft[spoil] = (draft[spoil] + 1) % 1000
            wanted[id(seq)] = draft
            speculator._row(seq)
            calls[0] += 1
        return wanted, []

    speculator._ngram_proposals = proposals


def spec_llm(model_dir, future, dtype="float32", k=3, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 128)
    llm = LLM(model=str(model_dir), dtype=dtype, max_num_seqs=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": k}, **kwargs)
    with_oracle_proposals(llm, future)
    return llm


def assert_states_all_free(llm: LLM) -> None:
    runtime = llm.engine.runtime
    assert runtime.free_state_slots == runtime.runner.state_pool.conv.shape[1]
    assert not runtime.runner._scratch


@pytest.mark.parametrize("family", ["qwen3_5_text", "lfm2", "granitemoehybrid"])
def test_speculation_on_state_layers_gives_speculation_offs_tokens(family, hybrid_dir, prompts):
    model_dir = hybrid_dir(family)
    off = tokens_of(LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128).generate(prompts, PARAMS))
    future = {tuple(p): o for p, o in zip(prompts, off)}
    for kwargs in ({}, {"max_num_batched_tokens": 8}, {"block_size": 4, "num_kv_blocks": 28}):
        llm = spec_llm(model_dir, future, **kwargs)
        assert tokens_of(llm.generate(prompts, PARAMS)) == off, kwargs
        stats = llm.engine.stats()
        acceptance = stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
        assert stats.spec_num_drafts > 10 and 0.3 < acceptance < 0.95, (kwargs, stats)
        assert all(n > 0 for n in stats.spec_accepted_per_pos), stats  # whole runs of 3 accepted too
        assert llm.engine.num_steps < sum(len(o) for o in off)
        if "num_kv_blocks" in kwargs and kwargs["num_kv_blocks"] < 128:
            assert llm.engine.scheduler.num_preemptions > 0
        assert_pool_all_free(llm)
        assert_states_all_free(llm)


def test_bf16_native_gated_deltanet_verify_steps_are_plain_steps(hybrid_dir, prompts):
    """bf16 on the native Gated DeltaNet step: each verified token through the same kernel as a plain
    decode step, so the tokens equal speculation off's exactly, not only to near-ties."""
    model_dir = hybrid_dir("qwen3_5_text")
    plain = LLM(model=str(model_dir), dtype="bfloat16", num_kv_blocks=128)
    off = tokens_of(plain.generate(prompts, PARAMS))
    llm = spec_llm(model_dir, {tuple(p): o for p, o in zip(prompts, off)}, dtype="bfloat16")
    from baton.model import runtime_env

    if runtime_env.native_kernels():  # (BATON_NATIVE_KERNELS=off runs the torch ops: the same claim)
        assert all(layer.linear_attn.kernel is not None for layer in llm.engine.runtime.model.layers
                   if layer.linear_attn is not None)
    assert tokens_of(llm.generate(prompts, PARAMS)) == off
    assert llm.engine.stats().spec_num_accepted_tokens > 0
    assert_states_all_free(llm)


def test_too_few_free_state_slots_limit_the_proposals(hybrid_dir, prompts):
    """Each proposal borrows a state slot for the step: with --max-num-seqs 4 and all four requests
    running no slot is free and nothing is proposed; with 5, one proposal a step while they all run.
    The output is the same."""
    from baton.engine.speculator import proposals_of

    model_dir = hybrid_dir("qwen3_5_text")
    off = tokens_of(LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128).generate(prompts, PARAMS))
    for slots, most in ((4, 0), (5, 1)):
        llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128, max_num_seqs=slots,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
        with_oracle_proposals(llm, {tuple(p): o for p, o in zip(prompts, off)})
        speculator, scheduler = llm.engine.scheduler.speculator, llm.engine.scheduler
        plan, proposed = speculator.plan, []

        def recording(scheduled, budget, num_running, plan=plan, scheduler=scheduler, proposed=proposed):
            out, job = plan(scheduled, budget, num_running)
            proposed.append((len(scheduler.running), sum(len(proposals_of(seq)) for seq, _ in out)))
            return out, job

        speculator.plan = recording
        assert tokens_of(llm.generate(prompts, PARAMS)) == off
        while_all_ran = [n for running, n in proposed if running == 4]
        assert while_all_ran and max(while_all_ran) == most, (slots, proposed)
        assert_states_all_free(llm)


def test_a_draft_model_with_state_layers_and_a_missing_mtp_head_are_refused(hybrid_dir, tiny_model_dir):
    with pytest.raises(ValueError, match=r"carries no multi-token-prediction layer \(no mtp\.\* tensors\)"):
        LLM(model=str(hybrid_dir("qwen3_5_text")), dtype="float32", num_kv_blocks=64,
            speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match="has state layers"):
        LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64,
            speculative_config={"method": "draft_model", "model": str(hybrid_dir("qwen3_5_text")),
                                "num_speculative_tokens": 2})


def test_a_draft_model_speculates_on_a_hybrid_target(hybrid_dir, tiny_model_dir, prompts):
    """A transformer draft (the tiny Llama, the same tokenizer) proposing for Qwen3.5: whatever of its
    proposals is accepted, the state kept is the one after the accepted tokens, and the output is
    speculation off's."""
    model_dir = hybrid_dir("qwen3_5_text")
    off = tokens_of(LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128).generate(prompts, PARAMS))
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128, max_num_seqs=8,
              speculative_config={"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 2})
    llm.engine.scheduler.speculator.costs.force = True
    assert tokens_of(llm.generate(prompts, PARAMS)) == off
    assert llm.engine.stats().spec_num_draft_tokens > 20
    assert_pool_all_free(llm)
    assert_states_all_free(llm)
