"""The reasoning and tool-call parsers (gateway.parsers) on outputs in each model family's format:
the whole parse, the same parse when the output streams in 1 to 3 character pieces (tags cut
anywhere), and malformed calls coming back as text."""

from __future__ import annotations

import json
import os
import random
import sys
from typing import Any

import pytest

from gateway.parsers import reasoning, tool_calls
from gateway.parsers.tool_calls import Call, Parsed


def pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 3)
        out.append(text[i:i + n])
        i += n
    return out


def streamed_reasoning(name: str, text: str, seed: int) -> tuple[str | None, str]:
    parser = reasoning.make(name)
    r, c = "", ""
    for piece in pieces(text, seed):
        dr, dc = parser.feed(piece)
        r, c = r + dr, c + dc
    dr, dc = parser.finish()
    return (r + dr) or None, c + dc


def streamed_calls(name: str, text: str, seed: int, tools: frozenset[str] = frozenset()) -> Parsed:
    parser = tool_calls.make(name, tools)
    out = Parsed()
    for piece in pieces(text, seed):
        out.add(parser.feed(piece))
    return out.add(parser.finish())


# Recorded outputs (DeepSeek-R1-Distill-Qwen: the template opened <think>; Qwen3: it writes it).
R1_OUTPUT = "Okay, the user wants 2+2. That is 4.\n</think>\n\nThe answer is **4**."
QWEN3_OUTPUT = "<think>\nThe user greets me. I should greet back.\n</think>\n\nHello! How can I help?"
# gpt-oss's harmony format, decoded with its special tokens kept
GPTOSS_OUTPUT = ("<|channel|>analysis<|message|>User asks 2+2. Answer 4.<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>The answer is **4**.")
GPTOSS_CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
               '{"city": "Paris"}<|call|>')
REASONING_CASES = [
    ("deepseek_r1", R1_OUTPUT, "Okay, the user wants 2+2. That is 4.", "The answer is **4**."),
    ("deepseek_r1", "<think>a < b </thinking> c</think>ok", "a < b </thinking> c", "ok"),
    ("deepseek_r1", "still thinking when cut", "still thinking when cut", ""),
    ("qwen3", QWEN3_OUTPUT, "The user greets me. I should greet back.", "Hello! How can I help?"),
    ("qwen3", "Hello there, <think> is just text here", None, "Hello there, <think> is just text here"),
    ("qwen3", "<think>\n\n</think>\n\nNo thinking.", None, "No thinking."),  # enable_thinking: false
    ("qwen3", "  <thin", None, "  <thin"),  # no think block: the answer untouched
    ("qwen3", "<think>cut short", "cut short", ""),
    ("openai_gptoss", GPTOSS_OUTPUT, "User asks 2+2. Answer 4.", "The answer is **4**."),
    ("openai_gptoss", "<|channel|>final<|message|>Hi <|there|>", None, "Hi <|there|>"),
    ("openai_gptoss", "<|channel|>analysis<|message|>cut short while thinking", "cut short while thinking", ""),
    # a call goes to the answer whole, for the tool parser
    ("openai_gptoss", "<|channel|>analysis<|message|>Need the weather.<|end|>" + GPTOSS_CALL, "Need the weather.",
     GPTOSS_CALL),
    ("openai_gptoss", "no harmony at all", None, "no harmony at all"),
]


@pytest.mark.parametrize("name,text,expected_reasoning,expected_content", REASONING_CASES)
def test_reasoning_split_whole_and_streamed(name, text, expected_reasoning, expected_content):
    assert reasoning.split(name, text) == (expected_reasoning, expected_content)
    for seed in range(20):
        assert streamed_reasoning(name, text, seed) == (expected_reasoning, expected_content), seed


def test_reasoning_streams_before_the_end():
    """Reasoning is given out as it comes, not at the end; a tag cut in two is held until decided."""
    parser = reasoning.make("qwen3")
    assert parser.feed("<thi") == ("", "")
    assert parser.feed("nk>Let me ") == ("Let me", "")
    assert parser.feed("see.</th") == (" see.", "")
    assert parser.feed("ink>\n\nHi") == ("", "Hi")
    assert parser.finish() == ("", "")
    with pytest.raises(ValueError, match="deepseek_r1"):
        reasoning.make("gpt-oss")


HERMES = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>')
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
MISTRAL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'
PYTHONIC = '[get_weather(city="Paris", days=[1, 2]), get_time()]'
TOOLS = frozenset({"get_weather", "get_time"})
WEATHER = Call("get_weather", '{"city": "Paris"}')
TIME = Call("get_time", "{}")
CALL_CASES = [
    ("hermes", HERMES, "I will check.", [Call("get_weather", '{"city": "Paris", "unit": "c"}'),
                                         Call("get_time", '{"tz": "Europe/Paris"}')]),
    ("hermes", 'No tools needed: 2 < 3 and <b>bold</b>.', "No tools needed: 2 < 3 and <b>bold</b>.", []),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}', "", [TIME]),  # not closed: still read
    ("llama3_json", LLAMA3, "", [WEATHER, TIME]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "arguments": {}}', "", [TIME]),
    ("llama3_json", "The weather in {city} is nice.", "The weather in {city} is nice.", []),
    ("mistral", MISTRAL, "", [WEATHER, TIME]),
    ("mistral", MISTRAL_V11, "", [WEATHER, TIME]),
    # decoded without special tokens, the markers are gone: the same calls
    ("mistral", MISTRAL.removeprefix("[TOOL_CALLS]"), "", [WEATHER, TIME]),
    ("mistral", MISTRAL_V11.replace("[TOOL_CALLS]", "").replace("[ARGS]", ""), "", [WEATHER, TIME]),
    ("mistral", "Sure. [TOOL_CALLS]get_time[ARGS]{}", "Sure.", [TIME]),
    ("mistral", "get the weather yourself", "get the weather yourself", []),
    ("pythonic", PYTHONIC, "", [Call("get_weather", '{"city": "Paris", "days": [1, 2]}'), TIME]),
    ("pythonic", "<|python_start|>[get_time()]<|python_end|>", "", [TIME]),
    ("pythonic", "It is sunny.", "It is sunny.", []),
    ("openai", GPTOSS_CALL, "", [WEATHER]),
    ("openai", GPTOSS_OUTPUT, "The answer is **4**.", []),  # the analysis is the reasoning parser's
    ("openai", "<|channel|>commentary<|message|>Checking the weather.<|end|>" + GPTOSS_CALL
     + "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>",
     "Checking the weather.", [WEATHER, TIME]),
    # the closing <|call|> is the stop token: often not in the text
    ("openai", "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}", "", [TIME]),
    ("openai", "It is sunny.", "It is sunny.", []),
]


@pytest.mark.parametrize("name,text,content,calls", CALL_CASES)
def test_tool_calls_whole_and_streamed(name, text, content, calls):
    assert tool_calls.parse(name, text, TOOLS) == Parsed(content, calls)
    for seed in range(20):
        assert streamed_calls(name, text, seed, TOOLS) == Parsed(content, calls), seed


MALFORMED = [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),  # arguments not an object
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par'),  # cut short
    ("llama3_json", '{"answer": 42}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]not json'),
    ("pythonic", '[get_weather(city=open("/etc/passwd").read())]'),  # not a literal: never evaluated
    ("pythonic", '[get_weather("Paris")]'),  # positional
    ("pythonic", '[get_weather(city="Par'),
    ("openai", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": <|call|>'),
    ("openai", '<|channel|>commentary to=functions.get_weather<|message|>[1, 2]<|call|>'),  # not an object
    ("openai", '<|channel|>analysis to=browser.search<|message|>{"q": "x"}<|call|>'),  # not a function
]


@pytest.mark.parametrize("name,text", MALFORMED)
def test_a_malformed_call_is_text(name, text):
    expected = Parsed(text.strip(), [])
    assert tool_calls.parse(name, text, TOOLS) == expected
    for seed in range(10):
        assert streamed_calls(name, text, seed, TOOLS) == expected


def test_content_streams_before_a_call_and_each_call_when_complete():
    parser = tool_calls.make("hermes")
    assert parser.feed("Let me look") == Parsed("Let me look")
    assert parser.feed(" that up. <tool_") == Parsed(" that up.")  # the blank and the tag's start wait
    assert parser.feed('call>{"name": "get_time", "arguments": {}}') == Parsed()
    assert parser.feed("</tool_call>") == Parsed("", [TIME])
    assert parser.finish() == Parsed()
    # llama3_json: text that cannot be a call streams at once
    parser = tool_calls.make("llama3_json")
    assert parser.feed("Paris is") == Parsed("Paris is")
    assert json.loads(tool_calls.parse("llama3_json", LLAMA3).calls[0].arguments) == {"city": "Paris"}
    with pytest.raises(ValueError, match="pythonic"):
        tool_calls.make("xlam")


def test_parser_detected_from_the_template():
    assert tool_calls.detect("{% if tools %}<tools>...</tools> <tool_call>{...}</tool_call>{% endif %}") == "hermes"
    assert tool_calls.detect("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    assert tool_calls.detect("{{ '[TOOL_CALLS]' + tool_calls | tojson }}") == "mistral"
    assert tool_calls.detect("<tool_call> and [TOOL_CALLS]") is None  # ambiguous: the flag decides
    assert tool_calls.detect("{{- '<|start|>assistant<|channel|>commentary to=functions.' }}") == "openai"
    assert tool_calls.detect("{{ messages }}") is None
    assert tool_calls.detect(None) is None


@pytest.mark.parametrize("name", [n for n in reasoning.NAMES if n != "openai_gptoss"])
def test_structured_output_allows_a_thought_before_the_json(name, default_model_dir):
    """think_first's grammar, run by llguidance on the model's tokens as a worker runs it: a think
    block, then JSON of the schema (qwen3: the block is optional; deepseek_r1: it must close)."""
    import llguidance
    from transformers import AutoTokenizer

    from baton.common.structured import compiled_grammar, json_schema

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = reasoning.think_first(json_schema(schema), name)
    tokenizer = llguidance.LLTokenizer((default_model_dir / "tokenizer.json").read_text())
    hf = AutoTokenizer.from_pretrained(str(default_model_dir))

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, compiled_grammar(grammar["kind"], grammar["spec"]), log_level=0)
        ok = all(matcher.consume_token(t) for t in hf(text, add_special_tokens=False)["input_ids"])
        return ok and matcher.is_accepting()

    assert accepts('<think>x < y, so </thi is text</think>\n\n{"a": 1}')
    assert not accepts('<think>hmm</think>{"a": "one"}')  # the schema holds after the thought
    assert not accepts('<think>hmm</think>{"a":1}')  # with the gateway's JSON separators
    assert not accepts('<think>a</think>b</think>{"a": 1}')
    assert accepts('{"a": 2}') == (name == "qwen3")
    assert accepts('the prompt opened it</think>{"a": 3}') == (name == "deepseek_r1")
    assert reasoning.think_first({"kind": "regex", "spec": "[0-9]+"}, name) is None


# ---- linear work: a long call in small chunks is read once, not again on every chunk ----

def _dense(k: int) -> str:
    return json.dumps({"items": [{"k": i} for i in range(k)]})  # brackets and quotes all along


LONG_STREAMS = {  # case -> (parser, the answer for a size k, the calls its parse holds)
    "llama3_json": ("llama3_json", lambda k: '{"name": "f", "parameters": ' + _dense(k) + "}", 1),
    "mistral": ("mistral", lambda k: '[TOOL_CALLS][{"name": "f", "arguments": ' + _dense(k) + "}]", 1),
    "mistral_args": ("mistral", lambda k: "[TOOL_CALLS]f[ARGS]" + _dense(k), 1),
    "mistral_blanks": ("mistral", lambda k: "[TOOL_CALLS]" + " " * (12 * k) + "f[ARGS]{}", 1),
    "hermes": ("hermes", lambda k: '<tool_call>{"name": "f", "arguments": ' + _dense(k) + "}</tool_call>", 1),
    "pythonic": ("pythonic", lambda k: "[f(items=" + json.dumps(list(range(k))) + ")]", 1),
    "deepseek_r1": ("deepseek_r1", lambda k: "a" + " " * (12 * k) + "b</think>answer", None),
    "openai": ("openai", lambda k: "<|channel|>commentary to=functions.f <|constrain|>json<|message|>" + _dense(k)
               + "<|call|>", 1),
    "openai_gptoss": ("openai_gptoss", lambda k: "<|channel|>analysis<|message|>a" + " " * (12 * k)
                      + "b<|end|><|start|>assistant<|channel|>final<|message|>answer", None),
}


def _parser_lines(run: Any) -> int:
    """How many lines of gateway/parsers/ Python `run()` executes: the parsers' work, counted (a
    wall-clock bound would be flaky on a busy machine)."""
    here = os.path.dirname(tool_calls.__file__)
    count = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        count += event == "line"
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(here) else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        run()
    finally:
        sys.settrace(previous)
    return count


@pytest.mark.parametrize("case", LONG_STREAMS)
def test_streamed_parse_work_grows_linearly(case):
    """Twice the answer in 4-character chunks costs about twice the work (rescanning all that was
    held on every chunk cost four times: 4000 chunks took 1.5 s per stream)."""
    name, answer, num_calls = LONG_STREAMS[case]

    def streamed(k: int) -> int:
        text = answer(k)
        chunks = [text[i:i + 4] for i in range(0, len(text), 4)]
        out: list[Any] = []

        def run() -> None:
            if name in reasoning.NAMES:
                parser = reasoning.make(name)
                out.extend([*map(parser.feed, chunks), parser.finish()])
            else:
                parser = tool_calls.make(name, frozenset({"f"}))
                parsed = Parsed()
                for chunk in chunks:
                    parsed.add(parser.feed(chunk))
                out.append(parsed.add(parser.finish()))

        lines = _parser_lines(run)
        if name in reasoning.NAMES:
            assert ("".join(r for r, _c in out), "".join(c for _r, c in out)) == ("a" + " " * (12 * k) + "b", "answer")
        else:
            assert len(out[0].calls) == num_calls and out[0].content == "", out[0]
        return lines

    small, large = streamed(60), streamed(120)
    assert large <= 2.3 * small, (small, large)


def test_harmony_streams_reasoning_and_answer_as_they_come():
    """gpt-oss: the analysis streams as reasoning, the final message as the answer, a marker cut in two
    is held until decided; a JSON constraint leaves the format alone (the reasoning parser is off)."""
    parser = reasoning.make("openai_gptoss")
    assert parser.feed("<|chan") == ("", "")
    assert parser.feed("nel|>analysis<|message|>Let me ") == ("Let me ", "")
    assert parser.feed("see.<|en") == ("see.", "")
    assert parser.feed("d|><|start|>assistant<|channel|>final<|message|>Hi") == ("", "Hi")
    assert parser.feed(" there") == ("", " there")
    assert parser.finish() == ("", "")
    assert reasoning.think_first({"kind": "json_object", "spec": ""}, "openai_gptoss") is None
    calls = tool_calls.make("openai")
    assert calls.feed("<|channel|>final<|message|>Sure") == Parsed("Sure")
    assert calls.feed("<|end|><|start|>assistant<|channel|>commentary to=functions.get_time <|con") == Parsed()
    assert calls.feed("strain|>json<|message|>{}") == Parsed()  # held until the message closes
    assert calls.feed("<|call|>") == Parsed("", [TIME])
