"""Structured output in the engine: the matcher rebuilt from tokens, masks, constrained decoding."""

from __future__ import annotations

import json
import re

import pytest
import torch

from baton.engine.sequence import Sequence
from baton.engine.structured import StructuredOutput, apply_bitmask
from baton.common.sampling_params import SamplingParams
from baton.common.structured import InvalidStructure, choice_regex, json_schema, validate

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "active": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "active", "color"],
    "additionalProperties": False,
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def check_schema(value: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(value, SCHEMA)


@pytest.fixture(scope="module")
def grammar_side(default_model_dir) -> StructuredOutput:
    return StructuredOutput(default_model_dir, 49152, [2])


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))


def masks(side: StructuredOutput, seqs: list[Sequence]) -> torch.Tensor:
    """Which tokens each row may take next (True: allowed)."""
    return ~torch.isinf(side.apply(seqs, torch.zeros(len(seqs), 49152)))


def test_validate_names_the_problem():
    assert validate(json_schema(SCHEMA))
    with pytest.raises(InvalidStructure, match="regex"):
        validate({"kind": "regex", "spec": "[a-"})
    with pytest.raises(InvalidStructure, match="foo"):
        validate(json_schema({"type": "foo"}))
    with pytest.raises(InvalidStructure):
        validate({"kind": "choice", "spec": "[]"})
    with pytest.raises(InvalidStructure, match="not found"):
        validate({"kind": "grammar", "spec": 'root ::= "a" | missing'})
    assert validate({"kind": "grammar", "spec": 'root ::= "yes" | "no"'})  # GBNF
    assert validate({"kind": "grammar", "spec": 'start: "yes" | "no"'})  # Lark
    with pytest.raises(ValueError):
        SamplingParams(structured={"kind": "xml", "spec": ""})


def test_choice_regex_escapes_everything():
    pattern = choice_regex(["a.b", "x|y", "(z)*"])
    assert validate({"kind": "regex", "spec": pattern})
    assert re.fullmatch(pattern.replace("\\x{", "\\x").replace("}", ""), "a.b")  # same in Python syntax


def test_matcher_rebuilt_from_tokens_gives_the_same_mask(grammar_side, tokenizer):
    """Handoff, preemption and a crash all come down to a new Sequence (or the same one) carrying
    the output so far: its matcher must be where the original one is."""
    params = SamplingParams(structured=json_schema(SCHEMA), max_tokens=64)
    output = tokenizer.encode('{"name": "Bo", "age": 4', add_special_tokens=False).ids
    running = Sequence("a", [1, 2, 3], params)
    grammar_side.start(running)
    for n in range(len(output) + 1):
        before = masks(grammar_side, [running])
        # a decode worker (or a survivor of a crash) gets the request with the output so far
        resumed = Sequence("a", [1, 2, 3], params, output_token_ids=output[:n])
        grammar_side.start(resumed)
        assert torch.equal(masks(grammar_side, [resumed]), before)
        if n < len(output):
            assert before[0, output[n]]
            running.append_token(output[n], 0.0)
    # the output shrinking (it never does today) rebuilds the matcher from scratch
    del running.token_ids[-3:]
    shrunk = Sequence("b", [1, 2, 3], params, output_token_ids=output[:-3])
    grammar_side.start(shrunk)
    assert torch.equal(masks(grammar_side, [running]), masks(grammar_side, [shrunk]))


def test_only_constrained_rows_are_masked(grammar_side):
    free = Sequence("f", [5], SamplingParams())
    bound = Sequence("c", [5], SamplingParams(structured={"kind": "choice", "spec": '["yes", "no"]'}))
    grammar_side.start(bound)
    logits = torch.randn(2, 49152)
    out = grammar_side.apply([free, bound], logits)
    assert torch.equal(out[0], logits[0])
    assert 0 < int((~torch.isinf(out[1])).sum()) < 10
    assert grammar_side.apply([free], logits) is logits  # nothing constrained: not even a copy


def test_complete_grammar_allows_only_eos(grammar_side, tokenizer):
    seq = Sequence("c", [5], SamplingParams(structured={"kind": "choice", "spec": '["yes", "no"]'}),
                   output_token_ids=tokenizer.encode("yes", add_special_tokens=False).ids)
    grammar_side.start(seq)
    allowed = masks(grammar_side, [seq])[0].nonzero().flatten().tolist()
    assert allowed == [2]


def test_bad_spec_or_bad_output_is_a_value_error(grammar_side, tokenizer):
    with pytest.raises(ValueError, match="regex"):
        grammar_side.start(Sequence("r", [5], SamplingParams(structured={"kind": "regex", "spec": "(a"})))
    wrong = tokenizer.encode("maybe", add_special_tokens=False).ids
    with pytest.raises(ValueError, match="does not match"):
        grammar_side.start(Sequence("w", [5], SamplingParams(structured={"kind": "choice", "spec": '["yes"]'}),
                                    output_token_ids=wrong))


def test_apply_bitmask_rows_and_padding():
    vocab = 100
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 4), dtype=torch.int32)  # 128 bits
    expected = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool().view(2, 128)
    logits = torch.zeros(3, vocab)
    apply_bitmask(logits, bitmask, [0, 2])
    assert torch.equal(~torch.isinf(logits[[0, 2]]), expected[:, :vocab])
    assert not torch.isinf(logits[1]).any()
    wide = torch.zeros(2, 140)  # a model vocabulary padded past the tokenizer's
    apply_bitmask(wide, bitmask, [0, 1])
    assert torch.isinf(wide[:, 128:]).all()


def test_constrained_decode_through_the_engine(tiny_model_dir):
    """The random tiny model, greedy and sampled, through LLMEngine: valid JSON of the schema."""
    from baton.llm import LLM

    llm = LLM(model=str(tiny_model_dir), dtype="float32")
    params = [SamplingParams(temperature=0, max_tokens=120, structured=json_schema(SCHEMA))]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured=json_schema(SCHEMA))
               for s in range(3)]
    params.append(SamplingParams(temperature=1.0, seed=7, max_tokens=20,
                                 structured={"kind": "regex", "spec": "[0-9]{3}-[a-z]{2,4}"}))
    outs = llm.generate(["Tell me about a person:"] * len(params), params)
    for out in outs[:-1]:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0]
        check_schema(json.loads(out.outputs[0].text))
    assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", outs[-1].outputs[0].text)
    assert outs[-1].outputs[0].finish_reason == "stop"
    # unconstrained requests in the same engine are untouched by the grammar side
    free = llm.generate(["Tell me about a person:"], SamplingParams(temperature=0, max_tokens=8))
    assert len(free[0].outputs[0].token_ids) == 8


def test_constrained_sampling_through_preemption_is_unchanged(tiny_model_dir):
    """Preempted requests keep their tokens and their matcher: the same answers as with room."""
    from baton.llm import LLM

    prompts = [f"A person, take {i}:" * (1 + i) for i in range(6)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=100, structured=json_schema(SCHEMA))
              for i in range(6)]
    roomy = LLM(model=str(tiny_model_dir), dtype="float32").generate(prompts, params)
    tight = LLM(model=str(tiny_model_dir), dtype="float32", block_size=4, num_kv_blocks=40)
    squeezed = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    for a, b in zip(roomy, squeezed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.outputs[0].finish_reason == "stop"
        check_schema(json.loads(b.outputs[0].text))


def test_workers_answer_a_spec_they_cannot_compile_with_an_error_event(tiny_model_dir):
    """The gateway refuses bad specs; a worker that gets one anyway (another gateway version, a
    hand-written message) ends the request with an error event and carries on."""
    import dataclasses
    import time

    from baton.common import protocol
    from tests.test_worker_core import decode_core, events_of, prefill_core

    bad = SamplingParams(max_tokens=8, structured={"kind": "regex", "spec": "(unclosed"})
    core = prefill_core(tiny_model_dir)
    effects = core.admit(b"1-0", protocol.PrefillRequest("r1", "gw", [5, 6, 7], bad, time.time()), [])
    [event] = events_of(effects)
    assert event.finish_reason == "error" and "regex" in event.error and effects.acks == [b"1-0"]
    assert not core.engine.has_unfinished()

    # a handoff whose output so far does not match its grammar
    choice = dataclasses.replace(bad, structured={"kind": "choice", "spec": '["yes", "no"]'})
    handoff = protocol.Handoff(request_id="r2", gateway_id="gw", prompt_token_ids=[5, 6, 7], output_token_ids=[9],
                               block_hashes=[], partial_block_key=None, sampling=choice, arrival_time=time.time(),
                               first_token_time=time.time())
    decode = decode_core(tiny_model_dir)
    effects = decode.admit(b"2-0", handoff)
    [event] = events_of(effects)
    assert event.finish_reason == "error" and "does not match" in event.error and effects.acks == [b"2-0"]


@pytest.mark.real_model
def test_real_model_fills_the_schema_sensibly(default_model_dir):
    from baton.llm import LLM

    llm = LLM(model=str(default_model_dir), dtype="float32")
    [out] = llm.chat([{"role": "user", "content": "Make up a customer named Ann, 31, active, who likes green. "
                                                  "Answer in JSON."}],
                     SamplingParams(temperature=0, max_tokens=80, structured=json_schema(SCHEMA)))
    assert out.outputs[0].finish_reason == "stop"
    value = json.loads(out.outputs[0].text)
    check_schema(value)
    assert value["name"] == "Ann" and value["age"] == 31
