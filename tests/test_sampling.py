"""The batched sampler and `SamplingParams` validation."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from baton.engine.sampling import apply_repetition_penalty, sample
from baton.common.sampling_params import SamplingParams

V = 64


def logits_row(seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * scale


def draw(logits: torch.Tensor, params: SamplingParams, index: int = 0, history=None) -> tuple[int, float]:
    tokens, logprobs = sample(logits.clone().unsqueeze(0), [params], [history or []], [index])
    return tokens[0], logprobs[0]


def draws(logits: torch.Tensor, make_params, n: int = 300) -> Counter:
    return Counter(draw(logits, make_params(seed))[0] for seed in range(n))


# ------------------------------------------------------------------ greedy

def test_greedy_is_argmax_per_row_with_its_logprob():
    logits = torch.stack([logits_row(s) for s in range(4)])
    params = [SamplingParams(temperature=0)] * 4
    tokens, logprobs = sample(logits.clone(), params, [[]] * 4, [0, 1, 2, 3])
    assert tokens == logits.argmax(dim=-1).tolist()
    expected = torch.log_softmax(logits, dim=-1).max(dim=-1).values
    assert logprobs == pytest.approx(expected.tolist(), abs=1e-6)


def test_greedy_ignores_seed_and_draw_index():
    logits = logits_row(1)
    results = {draw(logits, SamplingParams(temperature=0, seed=s), index=i)[0]
               for s in range(5) for i in range(5)}
    assert results == {int(logits.argmax())}


def test_top_k_1_equals_greedy_even_at_high_temperature():
    for s in range(5):
        logits = logits_row(s)
        assert SamplingParams(temperature=5.0, top_k=1).greedy
        for seed in range(10):
            assert draw(logits, SamplingParams(temperature=5.0, top_k=1, seed=seed))[0] == int(logits.argmax())


def test_tiny_temperature_is_effectively_greedy():
    logits = logits_row(3)
    assert {draw(logits, SamplingParams(temperature=1e-4, seed=s))[0] for s in range(50)} == {int(logits.argmax())}


# ------------------------------------------------------------------ seeds

def test_same_seed_and_draw_index_give_the_same_token():
    logits = logits_row(0, scale=0.5)  # flat: many tokens are likely
    for seed in (0, 1, 12345, 2**40):
        for index in (0, 7):
            first = draw(logits, SamplingParams(temperature=1.0, seed=seed), index)
            again = draw(logits, SamplingParams(temperature=1.0, seed=seed), index)
            assert first == again


def test_different_seeds_and_indices_give_different_draws():
    logits = logits_row(0, scale=0.5)
    by_seed = [draw(logits, SamplingParams(temperature=1.0, seed=s))[0] for s in range(200)]
    assert len(set(by_seed)) > 20
    by_index = [draw(logits, SamplingParams(temperature=1.0, seed=7), index=i)[0] for i in range(200)]
    assert len(set(by_index)) > 20
    assert by_seed != by_index


def test_a_row_draw_does_not_depend_on_its_batch():
    logits = torch.stack([logits_row(s, scale=0.5) for s in range(3)])
    params = [SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=0),
              SamplingParams(temperature=0.7, seed=5, top_k=10)]
    tokens, logprobs = sample(logits.clone(), params, [[], [], []], [4, 0, 9])
    for row in range(3):
        alone = draw(logits[row], params[row], index=[4, 0, 9][row])
        assert tokens[row] == alone[0]
        assert logprobs[row] == pytest.approx(alone[1])
    assert tokens[1] == int(logits[1].argmax())


def test_unseeded_params_get_a_fixed_random_seed():
    a, b = SamplingParams(), SamplingParams()
    assert isinstance(a.seed, int) and a.seed != b.seed
    logits = logits_row(0, scale=0.5)
    assert draw(logits, a, 3) == draw(logits, a, 3)  # fixed at creation: reproducible


def test_sampling_follows_the_distribution():
    # probabilities 0.5, 0.3, 0.2 (rest impossible)
    logits = torch.full((V,), -float("inf"))
    logits[:3] = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    n = 3000
    counts = draws(logits, lambda s: SamplingParams(temperature=1.0, seed=s), n)
    assert set(counts) == {0, 1, 2}
    for token, p in ((0, 0.5), (1, 0.3), (2, 0.2)):
        assert abs(counts[token] / n - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_sampled_logprob_is_under_the_tempered_distribution():
    logits = logits_row(2)
    token, logprob = draw(logits, SamplingParams(temperature=0.5, seed=3))
    assert logprob == pytest.approx(float(torch.log_softmax(logits / 0.5, dim=-1)[token]), abs=1e-5)


# ------------------------------------------------------------------ top-k / top-p

def test_top_k_restricts_draws_to_the_k_most_likely():
    logits = logits_row(4, scale=0.3)
    top5 = set(torch.topk(logits, 5).indices.tolist())
    counts = draws(logits, lambda s: SamplingParams(temperature=1.0, top_k=5, seed=s))
    assert set(counts) == top5  # only those, and every one of them shows up
    token, logprob = draw(logits, SamplingParams(temperature=1.0, top_k=5, seed=0))
    renormalised = torch.log_softmax(logits[sorted(top5)], dim=-1)
    assert logprob == pytest.approx(float(renormalised[sorted(top5).index(token)]), abs=1e-5)


def test_top_p_small_keeps_only_the_top_token():
    logits = logits_row(5, scale=0.3)
    counts = draws(logits, lambda s: SamplingParams(temperature=1.0, top_p=0.01, seed=s), 100)
    assert set(counts) == {int(logits.argmax())}
    assert draw(logits, SamplingParams(temperature=1.0, top_p=0.01, seed=1))[1] == pytest.approx(0.0, abs=1e-6)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.full((V,), -float("inf"))
    logits[:4] = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    for top_p, expected in ((0.45, {0}), (0.6, {0, 1}), (0.85, {0, 1, 2}), (0.9, {0, 1, 2}), (1.0, {0, 1, 2, 3})):
        counts = draws(logits, lambda s, p=top_p: SamplingParams(temperature=1.0, top_p=p, seed=s), 400)
        assert set(counts) == expected, top_p


def test_top_k_and_top_p_combine():
    logits = logits_row(6, scale=0.3)
    top3 = set(torch.topk(logits, 3).indices.tolist())
    counts = draws(logits, lambda s: SamplingParams(temperature=1.0, top_k=3, top_p=0.99, seed=s))
    assert set(counts) <= top3 and len(counts) >= 2


# ------------------------------------------------------------------ repetition penalty

def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([2.0, -1.0, 1.0, 0.5, -3.0])
    apply_repetition_penalty(logits, [0, 1, 0, 1], 2.0)
    assert logits.tolist() == [1.0, -2.0, 1.0, 0.5, -3.0]


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = logits_row(7)
    history = [3, 5, 5, 9, 17, 40]
    ours = logits.clone()
    apply_repetition_penalty(ours, history, 1.3)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([history]), logits.clone().unsqueeze(0))[0]
    assert torch.equal(ours, theirs)


def test_repetition_penalty_changes_the_greedy_choice_and_lowers_probability():
    logits = torch.zeros(V)
    logits[10], logits[20] = 3.0, 2.0
    assert draw(logits, SamplingParams(temperature=0))[0] == 10
    assert draw(logits, SamplingParams(temperature=0, repetition_penalty=2.0), history=[10])[0] == 20
    # sampled: the repeated token is drawn less often
    plain = draws(logits, lambda s: SamplingParams(temperature=1.0, seed=s), 400)
    penalised = Counter(draw(logits, SamplingParams(temperature=1.0, seed=s, repetition_penalty=2.0),
                             history=[10])[0] for s in range(400))
    assert penalised[10] < plain[10] - 50
    # penalty 1.0 and an empty history change nothing
    assert draw(logits, SamplingParams(temperature=0, repetition_penalty=1.0), history=[10])[0] == 10
    assert draw(logits, SamplingParams(temperature=0, repetition_penalty=2.0), history=[])[0] == 10


# ------------------------------------------------------------------ validation

@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"temperature": -0.1}, "temperature"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"n": 2}, "n=1"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_greedy_flag():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (16, 1.0, 1.0, -1, 1.0)
    assert not p.greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1).greedy
    assert SamplingParams(max_tokens=1, top_p=1.0, temperature=0.0).max_tokens == 1


def test_repetition_penalty_on_inference_mode_logits_leaves_them_untouched():
    # The engine's logits come out of torch.inference_mode(); the penalty must not edit them.
    with torch.inference_mode():
        logits = torch.stack([logits_row(8), logits_row(9)])
    before = logits.clone()
    top = int(logits[0].argmax())
    params = [SamplingParams(temperature=0, repetition_penalty=100.0), SamplingParams(temperature=0)]
    tokens, _ = sample(logits, params, [[top], []], [0, 0])
    assert tokens[0] != top and tokens[1] == int(logits[1].argmax())
    assert torch.equal(logits, before)


def test_a_vanishing_temperature_is_greedy_not_nan():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, -2.0, 4.9]])
    params = [SamplingParams(temperature=1e-39, seed=1), SamplingParams(temperature=1e-6, seed=2)]
    assert all(p.greedy for p in params)
    tokens, logprobs = sample(logits, params, [[], []], [0, 0])
    assert tokens == [1, 0]
    assert all(lp == lp and lp <= 0 for lp in logprobs)  # finite log-probabilities, no NaN


# ------------------------------------------------------------------ OpenAI's penalties, min_p, logit_bias
def test_presence_and_frequency_penalties_count_the_output_only():
    logits = torch.zeros(V)
    logits[[5, 7, 9]] = torch.tensor([3.0, 2.9, 2.8])
    history = [9, 9, 9, 5, 5, 7]  # 9 three times in the prompt (never penalized), then the output 5 5 7
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    [token], [logprob] = sample(logits.clone().unsqueeze(0), [params], [history], [3], [3])
    expected = logits.clone()
    expected[5] -= 0.5 + 2 * 0.25
    expected[7] -= 0.5 + 1 * 0.25
    assert token == 9  # 2.8 beats 3.0 - 1.0 and 2.9 - 0.75
    assert logprob == pytest.approx(float(torch.log_softmax(expected, -1)[9]), abs=1e-5)
    [plain], _ = sample(logits.clone().unsqueeze(0), [SamplingParams(temperature=0)], [history], [3], [3])
    assert plain == 5


def test_logit_bias_forces_and_forbids_tokens():
    logits = logits_row(3)
    top = int(logits.argmax())
    assert draw(logits, SamplingParams(temperature=0, logit_bias=[[11, 100.0]]))[0] == 11
    forbidden = draw(logits, SamplingParams(temperature=0, logit_bias=[[top, -100.0]]))[0]
    assert forbidden != top and forbidden == int(torch.topk(logits, 2).indices[1])
    # an id outside the vocabulary is skipped, not a crash of the step
    assert draw(logits, SamplingParams(temperature=0, logit_bias=[[V + 5, 50.0]]))[0] == top


def test_min_p_never_draws_a_token_below_its_share_of_the_top():
    logits = logits_row(4, scale=1.5)
    probs = torch.softmax(logits, -1)
    kept = {i for i in range(V) if probs[i] >= 0.2 * probs.max()}
    seen = draws(logits, lambda seed: SamplingParams(temperature=1.0, min_p=0.2, seed=seed), n=400)
    assert set(seen) <= kept and len(seen) > 1
    assert len(set(draws(logits, lambda seed: SamplingParams(temperature=1.0, seed=seed), n=400))) > len(kept)


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(min_p=1.5),
                                 dict(logit_bias=[[1, 200.0]]), dict(logit_bias=[[1]]),
                                 dict(logit_bias=[["a", 1.0]])])
def test_new_parameters_are_validated(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_cache_salt_rides_the_wire_and_older_messages_decode_unsalted():
    import dataclasses

    import msgpack

    from baton.common.protocol import MalformedMessage, PrefillRequest, decode, encode

    salted = PrefillRequest("r1", "g1", [1, 2, 3], SamplingParams(cache_salt="tenant-a"), 0.0)
    assert decode(encode(salted), PrefillRequest).sampling.cache_salt == "tenant-a"
    payload = msgpack.unpackb(encode(salted))
    del payload["sampling"]["cache_salt"]  # as a gateway from before cache_salt sent it
    assert decode(msgpack.packb(payload), PrefillRequest).sampling.cache_salt is None
    for bad in ("", 7, "s" * 1025):
        payload["sampling"]["cache_salt"] = bad
        with pytest.raises(MalformedMessage, match="cache_salt"):
            decode(msgpack.packb(payload), PrefillRequest)
    assert dataclasses.replace(SamplingParams(cache_salt="x"), max_tokens=3).cache_salt == "x"  # siblings keep it


def test_min_tokens_keeps_eos_and_stop_tokens_out_until_reached():
    from baton.engine.sampling import suppress_early_stops

    logits = torch.zeros(3, 10)
    logits[:, 2] = 5.0  # EOS would win
    logits[:, 7] = 4.0  # then a stop token
    params = [SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7]),
              SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7]),
              SamplingParams(temperature=0, min_tokens=3, ignore_eos=True)]
    with torch.inference_mode():
        raw = logits.clone()
    allowed = suppress_early_stops(raw, params, [2, 3, 0], eos_token_ids=[2])
    tokens, _ = sample(allowed, params, [[]] * 3, [0] * 3)
    assert tokens[0] not in (2, 7)  # 2 outputs < 3: both banned
    assert tokens[1] == 2  # min_tokens reached: EOS allowed again
    assert tokens[2] == 2  # ignore_eos: EOS is not a stop token, so it stays allowed
    assert torch.equal(raw, logits)  # the model's logits are untouched
    assert suppress_early_stops(raw, params, [5, 5, 5], [2]) is raw  # nothing to do: no copy
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
