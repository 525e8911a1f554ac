"""The gateway's side of structured output and tools, without a cluster: field parsing, tool
messages through the chat template, parsing and streaming tool calls."""

from __future__ import annotations

import json

import pytest

from gateway.errors import ApiError
from gateway.structured import openai_structured, tgi_structured
from gateway.tools import ToolCalling, ToolStream, assistant_message, for_template, parse_tools
from gateway.validation import Fields

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


def openai(body: dict) -> dict | None:
    return openai_structured(Fields(body, 400))


def test_openai_fields_map_to_one_constraint():
    assert openai({}) is None
    assert openai({"response_format": {"type": "text"}}) is None
    assert openai({"response_format": {"type": "json_object"}}) == {"kind": "json_object", "spec": ""}
    rf = openai({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}})
    assert rf == {"kind": "json_schema", "spec": json.dumps(SCHEMA)}
    assert openai({"guided_json": json.dumps(SCHEMA)}) == rf
    assert openai({"structured_outputs": {"json": SCHEMA}}) == rf
    assert openai({"guided_regex": "a+"}) == {"kind": "regex", "spec": "a+"}
    assert openai({"structured_outputs": {"choice": ["x", "y"]}})["kind"] == "choice"
    assert openai({"guided_grammar": 'start: "x"'})["kind"] == "grammar"
    assert openai({"structured_outputs": {"json_object": True}})["kind"] == "json_object"
    with pytest.raises(ApiError, match="structured_outputs"):
        openai({"structured_outputs": {"regex": "a", "choice": ["a"]}})
    with pytest.raises(ApiError, match="whitespace_pattern"):
        openai({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}})
    with pytest.raises(ApiError, match="guided_regex"):
        openai({"response_format": {"type": "json_object"}, "guided_regex": "a"})


def test_tgi_grammar():
    p = lambda grammar: tgi_structured(Fields({"grammar": grammar}, 422, prefix="parameters."))  # noqa: E731
    assert p({"type": "json", "value": SCHEMA})["kind"] == "json_schema"
    assert p({"type": "json", "value": json.dumps(SCHEMA)})["kind"] == "json_schema"
    assert p({"type": "regex", "value": "[0-9]+"}) == {"kind": "regex", "spec": "[0-9]+"}
    with pytest.raises(ApiError) as err:
        p({"type": "regex", "value": "(["})
    assert err.value.status == 422 and "parameters.grammar.value" in str(err.value)
    with pytest.raises(ApiError):
        p({"type": "lark", "value": "x"})


def test_tool_choice_modes():
    f = lambda body: parse_tools(Fields(body, 400), False)  # noqa: E731
    assert f({}) == (None, None)
    calling, constraint = f({"tools": [TOOL]})
    assert calling.mode == "auto" and constraint is None
    calling, constraint = f({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert calling.mode == "named" and json.loads(constraint["spec"]) == SCHEMA
    calling, constraint = f({"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False})
    array = json.loads(constraint["spec"])
    assert array["type"] == "array" and array["maxItems"] == 1
    assert array["items"]["properties"]["name"] == {"const": "f"}
    with pytest.raises(ApiError, match="response_format"):
        parse_tools(Fields({"tools": [TOOL], "tool_choice": "required"}, 400), True)


def test_answers_and_streams():
    named = ToolCalling([TOOL], "named", name="f")
    message, finish = assistant_message(named, '{"a": 1}', "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    required = ToolCalling([TOOL], "required")
    message, finish = assistant_message(required, '[{"name": "f", "arguments": {"a": 2}}]', "stop")
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 2}
    message, finish = assistant_message(required, '[{"name": "f", "argu', "length")  # cut short: text
    assert finish == "length" and message["content"] == '[{"name": "f", "argu' and "tool_calls" not in message
    auto = ToolCalling([TOOL], "auto", parse_tags=True)
    message, finish = assistant_message(auto, 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 3}}\n</tool_call>',
                                        "stop")
    assert message["content"] == "Sure." and message["tool_calls"][0]["function"]["name"] == "f"
    assert assistant_message(ToolCalling([TOOL], "auto"), "<tool_call>{}</tool_call>", "stop")[0]["content"]

    stream = ToolStream(named)
    first, _ = stream.rewrite({"role": "assistant", "content": ""}, None)
    assert first["tool_calls"][0]["function"] == {"name": "f", "arguments": ""} and first["content"] is None
    delta, _ = stream.rewrite({"content": '{"a"'}, None)
    assert delta == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}
    assert stream.rewrite({}, "stop") == ({}, "tool_calls")
    stream = ToolStream(required)
    assert stream.rewrite({"content": '[{"name": "f", '}, None) == ({}, None)
    delta, finish = stream.rewrite({"content": '"arguments": {"a"'}, None)  # named first
    assert delta["tool_calls"][0]["index"] == 0 and delta["tool_calls"][0]["id"].startswith("call_")
    assert delta["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    delta, finish = stream.rewrite({"content": ': 4}}, {"name": "f", "arguments": {'}, None)
    assert delta["tool_calls"] == [{"index": 0, "function": {"arguments": '{"a": 4}'}},
                                   {"index": 1, "id": delta["tool_calls"][1]["id"], "type": "function",
                                    "function": {"name": "f", "arguments": ""}}]
    delta, finish = stream.rewrite({"content": '"a": 5}}]'}, "stop")
    assert finish == "tool_calls" and delta["tool_calls"] == [{"index": 1, "function": {"arguments": '{"a": 5}'}}]


def test_tool_messages_through_templates(default_model_dir):
    from gateway.tokenizer import PromptTokenizer
    from gateway.openai.validation import parse_messages

    messages = parse_messages([
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": '{"a": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "name": "f", "content": "3"},
    ], 100)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 3}  # an object, as templates want
    assert messages[2]["tool_call_id"] == "call_9"
    smol = PromptTokenizer(default_model_dir)  # its template renders no tool_calls: written into content
    text = smol.hf.decode(smol.encode_chat(messages, tools=[TOOL]))
    assert '<tool_call>\n{"name": "f", "arguments": {"a": 3}}\n</tool_call>' in text
    hermes = PromptTokenizer(default_model_dir, chat_template=HERMES_TEMPLATE)
    text = hermes.hf.decode(hermes.encode_chat(messages, tools=[TOOL]))
    assert '<tools>f;</tools>' in text and '<tool_call>f {"a": 3}</tool_call>' in text
    assert for_template(messages, HERMES_TEMPLATE) is messages
