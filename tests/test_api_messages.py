"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the real `anthropic`
SDK over real HTTP: real uvicorn + real Redis, the echo worker standing in for the model workers."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from gateway.anthropic.reply import _Blocks
from gateway.errors import error_body, overloaded, unavailable
from gateway.tokenizer import PromptTokenizer
from tests.test_gateway_support import start_gateway, wait_until
from tests.test_structured_gateway import HERMES_TEMPLATE

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
HELLO = [{"role": "user", "content": "Hello"}]
# Hermes-style tools and tool calls, and the `enable_thinking` kwarg shown where the template gets it
THINKING_HERMES = HERMES_TEMPLATE + "{% if enable_thinking is defined %}[thinking={{ enable_thinking }}]{% endif %}"


def budget_in_use(base_url: str, key: str | None = None) -> int:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(base_url + "/stats", headers=headers, timeout=5).json()["token_budget"]["in_use"]


def sdk(server, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, **{"api_key": "unused", **kwargs}, max_retries=0)


def sse(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each Messages stream event; the name must be the data's type."""
    out = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        out.append((lines["event"], data))
    return out


@pytest.fixture(scope="module")
def hermes_server(default_model_dir, gw_redis_url, gw_echo_worker):
    """A gateway whose chat template renders tools and tool calls (auto tool calls are parsed), with
    qwen3's reasoning parser (an answer that opens <think> has reasoning)."""
    tokenizer = PromptTokenizer(default_model_dir, chat_template=THINKING_HERMES)
    server = start_gateway(default_model_dir, gw_redis_url, tokenizer, reasoning_parser="qwen3")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed_server(default_model_dir, gw_redis_url, gw_tokenizer, gw_echo_worker):
    server = start_gateway(default_model_dir, gw_redis_url, gw_tokenizer, api_key="sekrit", strict_api=True)
    yield server
    server.stop()


def test_create_answers_text_with_usage_and_the_prompt_as_templated(gw_server, gw_worker, gw_tokenizer):
    gw_worker.set_reply("Hi there, friend.")
    message = sdk(gw_server).messages.create(
        model=MODEL, max_tokens=64, system=[{"type": "text", "text": "Be brief."}], messages=HELLO,
        metadata={"user_id": "u1"}, extra_body={"temperature": 0.5, "top_k": 5})  # this SDK has no sampling args
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL
    assert [(b.type, b.text) for b in message.content] == [("text", "Hi there, friend.")]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    expected = gw_tokenizer.encode_chat([{"role": "system", "content": "Be brief."}, *HELLO])
    assert gw_worker.requests[-1].prompt_token_ids == expected
    assert message.usage.input_tokens == len(expected)
    assert message.usage.output_tokens == len(gw_worker.reply_ids)
    sampling = gw_worker.requests[-1].sampling
    assert sampling.temperature == 0.5 and sampling.top_k == 5 and sampling.max_tokens == 64
    assert wait_until(lambda: budget_in_use(gw_server.url) == 0)


def test_max_tokens_and_stop_sequences_end_the_answer(gw_server, gw_worker):
    client = sdk(gw_server)
    gw_worker.set_reply("one two three four five")
    cut = client.messages.create(model=MODEL, max_tokens=2, messages=HELLO)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    for stops in (["three"], ["zzz", "three", "four"]):
        stopped = client.messages.create(model=MODEL, max_tokens=64, messages=HELLO, stop_sequences=stops)
        assert stopped.content[0].text == "one two "
        assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "three")
    with client.messages.stream(model=MODEL, max_tokens=64, messages=HELLO, stop_sequences=["zzz", "four"]) as s:
        assert "".join(s.text_stream) == "one two three "
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "four")
    assert wait_until(lambda: budget_in_use(gw_server.url) == 0)


def test_stream_sends_anthropics_event_sequence(gw_server, gw_worker):
    gw_worker.set_reply("Streaming, in pieces: ü 😀.")
    with sdk(gw_server).messages.stream(model=MODEL, max_tokens=64, messages=HELLO) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 3 and "".join(pieces) == "Streaming, in pieces: ü 😀."
    assert final.content[0].text == "Streaming, in pieces: ü 😀." and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(gw_worker.reply_ids) and final.usage.input_tokens > 0
    r = httpx.post(gw_server.url + "/v1/messages", json={"model": MODEL, "max_tokens": 64, "messages": HELLO,
                                                         "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    kinds = [kind for kind, _ in events]
    assert kinds[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert events[0][1]["message"]["usage"]["input_tokens"] == final.usage.input_tokens
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta") == final.content[0].text
    assert wait_until(lambda: budget_in_use(gw_server.url) == 0)


def test_named_and_any_tool_choice_answer_tool_use(gw_server, gw_worker):
    client = sdk(gw_server)
    gw_worker.set_reply('{"city": "Paris"}')  # a named tool's output is its arguments
    named = dict(model=MODEL, max_tokens=64, messages=HELLO, tools=[WEATHER],
                 tool_choice={"type": "tool", "name": "get_weather"})
    message = client.messages.create(**named)
    [block] = message.content
    assert (block.type, block.name, block.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert block.id.startswith("toolu_") and message.stop_reason == "tool_use"
    with client.messages.stream(**named) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", {"city": "Paris"})]
    assert final.stop_reason == "tool_use"
    gw_worker.set_reply('[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                        '{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    anyone = {**named, "tool_choice": {"type": "any"}}
    both = client.messages.create(**anyone)
    assert [b.input for b in both.content] == [{"city": "Oslo"}, {"city": "Rome"}]
    r = httpx.post(gw_server.url + "/v1/messages", json={**anyone, "stream": True})
    events = sse(r.text)
    starts = [d["content_block"] for k, d in events if k == "content_block_start"]
    assert [(s["type"], s["name"]) for s in starts] == [("tool_use", "get_weather")] * 2
    parts = {0: "", 1: ""}
    for kind, data in events:
        if kind == "content_block_delta":
            assert data["delta"]["type"] == "input_json_delta"
            parts[data["index"]] += data["delta"]["partial_json"]
    assert [json.loads(p) for p in parts.values()] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    # disable_parallel_tool_use: the constraint allows one call (the worker sees the request's grammar)
    client.messages.create(**{**named, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert '"maxItems": 1' in gw_worker.requests[-1].sampling.structured["spec"]
    assert wait_until(lambda: budget_in_use(gw_server.url) == 0)


def test_tool_use_round_trip_through_a_template_that_renders_tools(hermes_server, gw_worker):
    client = sdk(hermes_server)
    gw_worker.set_reply('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                        '</tool_call>')
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.messages.create(model=MODEL, max_tokens=100, messages=asked, tools=[WEATHER])
    assert first.stop_reason == "tool_use"
    text, call = first.content
    assert text.text == "Let me look." and (call.name, call.input) == ("get_weather", {"city": "Paris"})
    with client.messages.stream(model=MODEL, max_tokens=100, messages=asked, tools=[WEATHER]) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["text", "tool_use"] and streamed.content[1].input == call.input
    gw_worker.set_reply("It is 18 degrees.")
    history = asked + [first.to_param(),  # the answer sent back as the SDK writes it
                       {"role": "user", "content": [
                           {"type": "tool_result", "tool_use_id": call.id,
                            "content": [{"type": "text", "text": "18C"}]},
                           {"type": "text", "text": "Thanks."}]}]
    answer = client.messages.create(model=MODEL, max_tokens=100, messages=history, tools=[WEATHER])
    assert answer.content[0].text == "It is 18 degrees." and answer.stop_reason == "end_turn"
    prompt = last_prompt(gw_worker)
    assert '<tool_call>get_weather {"city": "Paris"}</tool_call>' in prompt  # the call, as the template writes it
    assert "<|im_start|>tool\n18C<|im_end|>\n<|im_start|>user\nThanks." in prompt  # result first, then the text
    assert "<tools>get_weather;</tools>" in prompt
    failed = history[:-1] + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": "no such city", "is_error": True}]}]
    client.messages.create(model=MODEL, max_tokens=100, messages=failed, tools=[WEATHER])
    assert "<|im_start|>tool\nError: no such city<|im_end|>" in last_prompt(gw_worker)
    assert wait_until(lambda: budget_in_use(hermes_server.url) == 0)


def last_prompt(worker) -> str:
    """The text of the prompt the worker got for the last request."""
    return worker.tok.decode(worker.requests[-1].prompt_token_ids)


def test_count_tokens_counts_the_prompt_generation_runs(gw_server, gw_worker, hermes_server):
    client = sdk(gw_server)
    system = "You count."
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=HELLO)
    ran = client.messages.create(model=MODEL, max_tokens=8, system=system, messages=HELLO)
    assert counted.input_tokens == ran.usage.input_tokens == len(gw_worker.requests[-1].prompt_token_ids)
    # tools are part of the prompt where the template renders them
    plain = sdk(hermes_server).messages.count_tokens(model=MODEL, messages=HELLO)
    with_tools = sdk(hermes_server).messages.count_tokens(model=MODEL, messages=HELLO, tools=[WEATHER])
    assert with_tools.input_tokens > plain.input_tokens
    with pytest.raises(anthropic.BadRequestError, match="messages"):
        client.messages.count_tokens(model=MODEL, messages=[])


@pytest.mark.parametrize("change,field", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                {"type": "tool_result", "tool_use_id": 7}]}]},
     "messages.0.content.1.tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"messages": HELLO + [{"role": "assistant", "content": "Sure"}]}, "messages.1.role"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 9000}, "max_tokens"),  # beyond the model's context (8192)
    ({"stop_sequences": "x"}, "stop_sequences"),
    ({"tools": [{**WEATHER, "input_schema": {"type": "nonsense"}}]}, "tools.0.input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 64}}, "thinking.budget_tokens"),  # >= max_tokens
    ({"system": [{"type": "image"}]}, "system.0"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}, "output_config.format"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}, "tools": [WEATHER],
      "tool_choice": {"type": "any"}}, "tool_choice"),
])
def test_invalid_requests_are_400s_naming_the_field(gw_server, gw_worker, change, field):
    before = len(gw_worker.requests)
    with pytest.raises(anthropic.BadRequestError) as caught:  # extra_body: it replaces the fields given
        sdk(gw_server).messages.create(model=MODEL, max_tokens=64, messages=HELLO, extra_body=change)
    error = caught.value.body["error"]
    assert caught.value.body["type"] == "error" and error["type"] == "invalid_request_error"
    assert f"`{field}`" in error["message"] or error["message"].startswith(f"{field}: "), error["message"]
    assert len(gw_worker.requests) == before  # refused before anything ran


def test_required_fields_unknown_model_and_unknown_fields(gw_server, gw_worker):
    for missing in ("model", "max_tokens", "messages"):
        body = {"model": MODEL, "max_tokens": 8, "messages": HELLO}
        del body[missing]
        r = httpx.post(gw_server.url + "/v1/messages", json=body)
        assert r.status_code == 400, r.text
        assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": f"`{missing}` is required"}}
    with pytest.raises(anthropic.NotFoundError) as caught:
        sdk(gw_server).messages.create(model="claude-nope", max_tokens=8, messages=HELLO)
    assert caught.value.body["error"]["type"] == "not_found_error"
    raw = sdk(gw_server).messages.with_raw_response.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}, "shiny": 1}]}],
        thinking={"type": "enabled", "budget_tokens": 4}, extra_body={"service_tier": "auto"})
    assert set(raw.headers["x-baton-ignored-fields"].split(",")) == {"messages.0.content.0.shiny", "service_tier"}
    assert raw.parse().content[0].text


def test_api_key_as_x_api_key_or_bearer_and_strict_fields(keyed_server, gw_worker):
    gw_worker.set_reply("Keyed.")
    message = sdk(keyed_server, api_key="sekrit").messages.create(model=MODEL, max_tokens=8, messages=HELLO)
    assert message.content[0].text == "Keyed."
    bearer = anthropic.Anthropic(base_url=keyed_server.url, auth_token="sekrit", max_retries=0)
    assert bearer.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as caught:
        sdk(keyed_server, api_key="wrong").messages.create(model=MODEL, max_tokens=8, messages=HELLO)
    assert caught.value.body["error"]["type"] == "authentication_error"
    for path in ("/v1/messages", "/v1/messages/count_tokens"):  # no key at all
        r = httpx.post(keyed_server.url + path, json={"model": MODEL, "max_tokens": 8, "messages": HELLO})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError, match="service_tier"):  # --strict-api
        sdk(keyed_server, api_key="sekrit").messages.create(model=MODEL, max_tokens=8, messages=HELLO,
                                                            extra_body={"service_tier": "auto"})
    assert wait_until(lambda: budget_in_use(keyed_server.url, "sekrit") == 0)


def test_client_leaving_mid_stream_cancels_and_releases(gw_server, gw_worker):
    gw_worker.delay = 0.05
    gw_worker.set_reply("word " * 60)
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", gw_server.url + "/v1/messages",
                           json={"model": MODEL, "max_tokens": 200, "messages": HELLO, "stream": True}) as r:
            lines = r.iter_lines()  # kept: abandoning the iterator closes the connection at once
            while "content_block_delta" not in next(lines):
                pass
            assert budget_in_use(gw_server.url) > 0
            rid = gw_worker.requests[-1].request_id
    assert wait_until(lambda: rid in gw_worker.cancelled_ids())
    assert wait_until(lambda: budget_in_use(gw_server.url) == 0)


def test_client_leaving_before_the_answer_cancels_it(gw_server, gw_worker):
    gw_worker.hold = True  # the worker never answers: the client gives up first
    before = len(gw_worker.requests)
    with pytest.raises(anthropic.APITimeoutError):
        sdk(gw_server, timeout=0.5).messages.create(model=MODEL, max_tokens=50, messages=HELLO)
    assert wait_until(lambda: len(gw_worker.requests) == before + 1)
    rid = gw_worker.requests[-1].request_id
    assert wait_until(lambda: rid in gw_worker.cancelled_ids())
    assert wait_until(lambda: budget_in_use(gw_server.url) == 0)


def test_generation_failure_is_an_anthropic_error(gw_server, gw_worker):
    gw_worker.mode = "error"
    client = sdk(gw_server)
    with pytest.raises(anthropic.InternalServerError) as caught:
        client.messages.create(model=MODEL, max_tokens=8, messages=HELLO)
    assert caught.value.body["error"]["type"] == "api_error"
    with pytest.raises(anthropic.APIStatusError, match="boom"):  # after the stream started: event: error
        with client.messages.stream(model=MODEL, max_tokens=8, messages=HELLO) as stream:
            stream.get_final_message()
    assert wait_until(lambda: budget_in_use(gw_server.url) == 0)


def test_a_claude_code_shaped_request_streams(gw_server, gw_worker):
    """What Claude Code sends: `?beta=true`, beta headers, cached system blocks, a JSON-Schema-2020 tool
    schema with `cache_control`, `metadata.user_id`, and the fields this server does not know."""
    gw_worker.set_reply("Done.")
    tool = {**WEATHER, "cache_control": {"type": "ephemeral"},
            "input_schema": {**WEATHER["input_schema"], "$schema": "https://json-schema.org/draft/2020-12/schema",
                             "additionalProperties": False}}
    body = {"model": MODEL, "max_tokens": 512, "stream": True, "metadata": {"user_id": "user_abc"},
            "system": [{"type": "text", "text": "You are a CLI.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                       "cache_control": {"type": "ephemeral"}}]}],
            "tools": [tool], "temperature": 1, "context_management": {"edits": []}}
    headers = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
               "anthropic-version": "2023-06-01"}
    r = httpx.post(gw_server.url + "/v1/messages?beta=true", json=body, headers=headers)
    assert r.status_code == 200 and r.headers["x-baton-ignored-fields"] == "context_management"
    assert "".join(d["delta"].get("text", "") for k, d in sse(r.text) if k == "content_block_delta") == "Done."
    count = httpx.post(gw_server.url + "/v1/messages/count_tokens?beta=true", headers=headers,
                       json={k: body[k] for k in ("model", "system", "messages", "tools")})
    assert count.status_code == 200 and count.json()["input_tokens"] == len(gw_worker.requests[-1].prompt_token_ids)


def test_output_config_format_constrains_the_answer(gw_server, gw_worker):
    gw_worker.set_reply('{"city": "Paris"}')
    schema = WEATHER["input_schema"]
    message = sdk(gw_server).messages.create(model=MODEL, max_tokens=32, messages=HELLO,
                                             output_config={"format": {"type": "json_schema", "schema": schema}})
    assert json.loads(message.content[0].text) == {"city": "Paris"}
    structured = gw_worker.requests[-1].sampling.structured
    assert structured["kind"] == "json_schema" and json.loads(structured["spec"]) == schema


def test_thinking_reaches_the_template_as_enable_thinking(hermes_server, gw_worker):
    client = sdk(hermes_server)
    for thinking, shown in (({"type": "enabled", "budget_tokens": 1024}, "[thinking=True]"),
                            ({"type": "disabled"}, "[thinking=False]")):
        client.messages.create(model=MODEL, max_tokens=2048 - 100, messages=HELLO, thinking=thinking)
        assert last_prompt(gw_worker).endswith(shown)
    client.messages.create(model=MODEL, max_tokens=8, messages=HELLO)
    assert "[thinking=" not in last_prompt(gw_worker)


def test_reasoning_comes_back_as_a_thinking_block(hermes_server, gw_worker):
    gw_worker.set_reply("<think>Paris is in France.</think>It is Paris.")
    client = sdk(hermes_server)
    message = client.messages.create(model=MODEL, max_tokens=100, messages=HELLO)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking.strip() == "Paris is in France."
    assert message.content[1].text.strip() == "It is Paris."
    with client.messages.stream(model=MODEL, max_tokens=100, messages=HELLO) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == \
        [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content]
    r = httpx.post(hermes_server.url + "/v1/messages", json={"model": MODEL, "max_tokens": 100, "messages": HELLO,
                                                             "stream": True})
    deltas = [(d["index"], d["delta"]["type"]) for k, d in sse(r.text) if k == "content_block_delta"]
    assert {0: "thinking_delta", 1: "text_delta"} == dict(deltas)
    # sent back, the earlier turn's thinking is dropped (as templates drop past reasoning), its text kept
    history = HELLO + [message.to_param(), {"role": "user", "content": "And Spain?"}]
    raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=100, messages=history)
    assert "x-baton-ignored-fields" not in raw.headers
    assert "Paris is in France" not in last_prompt(gw_worker) and "It is Paris." in last_prompt(gw_worker)
    assert wait_until(lambda: budget_in_use(hermes_server.url) == 0)


def test_overload_and_outage_map_to_anthropics_error_types():
    assert error_body(overloaded("busy", 1), "anthropic") == {
        "type": "error", "error": {"type": "rate_limit_error", "message": "busy"}}
    assert error_body(unavailable("down", 1), "anthropic")["error"]["type"] == "overloaded_error"


def test_thinking_and_blocks_stream_one_block_at_a_time():
    """Chat's reasoning_content (from a reasoning parser) streams as a thinking block before the text."""
    blocks = _Blocks()
    out = blocks.feed({"reasoning_content": "Hmm."}) + blocks.feed({"reasoning_content": " Yes."})
    out += blocks.feed({"content": "Hi"}) + blocks.close()
    events = sse(b"".join(out).decode())
    assert [(k, d.get("index")) for k, d in events] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1)]
    assert events[0][1]["content_block"]["type"] == "thinking"
    assert events[2][1]["delta"] == {"type": "thinking_delta", "thinking": " Yes."}
    assert events[5][1]["delta"] == {"type": "text_delta", "text": "Hi"}


SAMPLES = {"model": MODEL, "max_tokens": 8, "messages": HELLO, "system": "Be brief.", "tools": [WEATHER],
           "tool_choice": {"type": "auto"}, "thinking": {"type": "enabled", "budget_tokens": 4},
           "output_config": {"effort": "low"}, "stream": False, "stop_sequences": ["\n\n"], "temperature": 0.7,
           "top_p": 0.9, "top_k": 40, "metadata": {"user_id": "u"}, "cache_salt": "tenant-a",
           "cache_control": {"type": "ephemeral"}}


def test_every_documented_field_is_accepted_and_not_ignored(gw_server, gw_worker):
    schemas = httpx.get(gw_server.url + "/openapi.json").json()["components"]["schemas"]
    fields = set(schemas["MessagesCountTokensRequest"]["properties"]) | set(
        schemas["MessagesRequest"]["allOf"][1]["properties"])
    assert fields == set(SAMPLES)
    r = httpx.post(gw_server.url + "/v1/messages", json=SAMPLES)  # every field at once
    assert r.status_code == 200 and "x-baton-ignored-fields" not in r.headers, r.text
    counted = {k: SAMPLES[k] for k in schemas["MessagesCountTokensRequest"]["properties"]}
    r = httpx.post(gw_server.url + "/v1/messages/count_tokens", json=counted)
    assert r.status_code == 200 and "x-baton-ignored-fields" not in r.headers, r.text


def test_openapi_documents_the_messages_paths(gw_server):
    spec = httpx.get(gw_server.url + "/openapi.json").json()
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert "post" in spec["paths"][path], path
    schemas = spec["components"]["schemas"]
    assert "max_tokens" in schemas["MessagesRequest"]["allOf"][1]["required"]
    assert schemas["MessagesCountTokensRequest"]["required"] == ["model", "messages"]
    assert set(spec["paths"]["/v1/messages"]["post"]["responses"]) >= {"200", "400", "401", "404", "429", "503"}
