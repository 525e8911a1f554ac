"""`/v1/responses` (OpenAI's Responses API) through the real `openai` SDK over real HTTP: a real
uvicorn gateway and real Redis, the echo worker standing in for the model (its reply is what the
"model" says; what it received is the prompt the chat template rendered)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.test_gateway_api import MODEL, budget_in_use
from tests.test_gateway_support import start_gateway, wait_until
from tests.test_structured_gateway import HERMES_TEMPLATE

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)  # built once: the union is large
WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city", "parameters": SCHEMA}


@pytest.fixture(scope="module")
def hermes_server(default_model_dir, gw_redis_url, gw_echo_worker):
    """A gateway whose chat template renders tools (so "auto" parses <tool_call> blocks), with
    storing disabled (--responses-ttl 0) and --strict-api."""
    from gateway.tokenizer import PromptTokenizer

    tokenizer = PromptTokenizer(default_model_dir, chat_template=HERMES_TEMPLATE)
    server = start_gateway(default_model_dir, gw_redis_url, tokenizer, max_queue_wait=5.0, responses_ttl=0,
                           strict_api=True)
    yield server
    server.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def last_prompt(worker, server=None) -> str:
    return worker.tok.decode(worker.requests[-1].prompt_token_ids)


def raw_events(server, body: dict) -> list[dict]:
    """A stream's events read off the wire, each checked against the SDK's own types (strictly:
    the SDK itself builds them leniently); the `event:` line names each one."""
    r = httpx.post(server.url + "/v1/responses", json={**body, "stream": True}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = []
    for frame in r.text.strip().split("\n\n"):
        head, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == "event: " + event["type"]
        STREAM_EVENT.validate_python(event)
        events.append(event)
    return events


def test_create_with_a_string(gw_server, gw_worker):
    gw_worker.set_reply("Hello there.")
    resp = client(gw_server).responses.create(model=MODEL, input="Say hi")
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.status == "completed"
    assert resp.output_text == "Hello there."
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert resp.usage.output_tokens == len(gw_worker.reply_ids) and resp.usage.input_tokens > 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.model == "SmolLM2-135M-Instruct" and resp.store is True and resp.error is None
    assert resp.tools == [] and resp.tool_choice == "auto" and resp.text.format.type == "text"
    assert "Say hi" in last_prompt(gw_worker)
    assert budget_in_use(gw_server.url) == 0


def test_items_and_instructions_reach_the_template(gw_server, gw_worker):
    gw_worker.set_reply("Fine.")
    resp = client(gw_server).responses.create(
        model=MODEL,
        instructions="Answer tersely.", max_output_tokens=64, temperature=0.0,
        input=[{"role": "developer", "content": "Be kind."},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "How "},
                                                                {"type": "input_text", "text": "are you?"}]},
               {"role": "assistant", "content": [{"type": "output_text", "text": "Well, and you?"}]},
               {"type": "reasoning", "id": "rs_1", "summary": []},
               {"role": "user", "content": "Say more."}])
    assert resp.output_text == "Fine." and resp.instructions == "Answer tersely."
    assert resp.max_output_tokens == 64 and resp.temperature == 0.0
    prompt = last_prompt(gw_worker)
    at = [prompt.index(s) for s in ("Answer tersely.", "Be kind.", "How are you?", "Well, and you?", "Say more.")]
    assert at == sorted(at), prompt
    assert gw_worker.requests[-1].sampling.temperature == 0.0


def test_stream_events_in_order(gw_server, gw_worker):
    gw_worker.set_reply("One two three.")
    with client(gw_server).responses.stream(model=MODEL, input="Count") as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == "One two three."
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.output_text == "One two three." and final.status == "completed" and final.usage.output_tokens > 0
    assert final.id == events[0].response.id
    stored = client(gw_server).responses.retrieve(final.id)
    assert stored.output_text == "One two three." and stored.id == final.id
    raw = raw_events(gw_server, {"input": "Count"})
    assert [e["type"] for e in raw] == types and raw[-1]["response"]["output"][0]["content"][0]["text"] == "One two three."
    assert budget_in_use(gw_server.url) == 0


def test_previous_response_id_continues_the_conversation(gw_server, gw_worker):
    c = client(gw_server)
    gw_worker.set_reply("Nice to meet you, Ada.")
    first = c.responses.create(model=MODEL, instructions="Only the first turn's rules.", input="My name is Ada.")
    gw_worker.set_reply("Your name is Ada.")
    second = c.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?")
    assert second.previous_response_id == first.id and second.output_text == "Your name is Ada."
    prompt = last_prompt(gw_worker)
    at = [prompt.index(s) for s in ("My name is Ada.", "Nice to meet you, Ada.", "What is my name?")]
    assert at == sorted(at), prompt
    assert "Only the first turn's rules." not in prompt  # instructions are not carried over (OpenAI's rule)
    gw_worker.set_reply("Still Ada.")
    c.responses.create(model=MODEL, previous_response_id=second.id, input="Again?")
    assert "My name is Ada." in last_prompt(gw_worker) and "Your name is Ada." in last_prompt(gw_worker)
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        c.responses.create(model=MODEL, previous_response_id=first.id, input="x")
    assert err.value.body["param"] == "previous_response_id" and first.id in err.value.message


def test_unstored_and_unknown_previous_responses(gw_server, gw_worker):
    c = client(gw_server)
    unstored = c.responses.create(model=MODEL, input="x", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as err:
        c.responses.create(model=MODEL, previous_response_id="resp_" + "0" * 32, input="x")
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(model=MODEL, previous_response_id="chatcmpl-1", input="x")
    assert err.value.body["param"] == "previous_response_id"
    r = httpx.get(gw_server.url + "/v1/responses/not-an-id")
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"


def test_text_format_json_schema_is_a_structured_constraint(gw_server, gw_worker):
    gw_worker.set_reply('{"city": "Paris"}')
    resp = client(gw_server).responses.create(
        model=MODEL,
        input="Where?", text={"format": {"type": "json_schema", "name": "place", "schema": SCHEMA, "strict": True}})
    assert json.loads(resp.output_text) == {"city": "Paris"}
    structured = gw_worker.requests[-1].sampling.structured
    assert structured["kind"] == "json_schema" and json.loads(structured["spec"])["required"] == ["city"]
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "place"
    from pydantic import BaseModel

    class City(BaseModel):
        city: str

    parsed = client(gw_server).responses.parse(model=MODEL, input="Where?", text_format=City)
    assert parsed.output_parsed == City(city="Paris")  # the SDK's own schema reached the engine
    assert "city" in json.loads(gw_worker.requests[-1].sampling.structured["spec"])["properties"]
    client(gw_server).responses.create(model=MODEL, input="Any JSON", text={"format": {"type": "json_object"}})
    assert gw_worker.requests[-1].sampling.structured["kind"] == "json_object"


def test_named_tool_choice_streams_the_call(gw_server, gw_worker):
    gw_worker.set_reply('{"city": "Paris"}')
    with client(gw_server).responses.stream(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                            tool_choice={"type": "function", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert gw_worker.requests[-1].sampling.structured is not None  # the arguments' schema constrains the output
    [call] = final.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"} and call.id.startswith("fc_")
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == call.arguments
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done[0].arguments == call.arguments and done[0].item_id == call.id
    assert final.tools[0].name == "get_weather" and final.tool_choice.name == "get_weather"
    raw = raw_events(gw_server, {"input": "x", "tools": [WEATHER],
                                 "tool_choice": {"type": "function", "name": "get_weather"}})
    assert [e["type"] for e in raw] == [e.type for e in events]


def test_function_call_round_trip(hermes_server, gw_worker):
    c = client(hermes_server)
    gw_worker.set_reply('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    first = c.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER])
    assert "get_weather" in last_prompt(gw_worker)  # the template rendered the tools
    [call] = first.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    gw_worker.set_reply("It is 18C in Paris.")
    answer = c.responses.create(model=MODEL, tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18C, sunny"}])
    assert answer.output_text == "It is 18C in Paris." and answer.output[0].type == "message"
    prompt = last_prompt(gw_worker)
    assert prompt.index('<tool_call>get_weather {"city": "Paris"}') < prompt.index("18C, sunny"), prompt
    gw_worker.set_reply('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    with c.responses.stream(model=MODEL, input="And Oslo?", tools=[WEATHER]) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert "response.function_call_arguments.done" in types and types[-1] == "response.completed"
    assert json.loads(stream.get_final_response().output[0].arguments) == {"city": "Oslo"}
    raw = raw_events(hermes_server, {"input": "And Oslo?", "tools": [WEATHER]})
    assert [e["type"] for e in raw] == types
    assert budget_in_use(hermes_server.url) == 0


def test_storing_disabled(hermes_server, gw_worker):
    c = client(hermes_server)
    resp = c.responses.create(model=MODEL, input="x")  # store defaults to true: accepted, nothing kept
    assert resp.store is False
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(model=MODEL, previous_response_id=resp.id, input="y")
    assert err.value.body["param"] == "previous_response_id" and "--responses-ttl" in err.value.message
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(resp.id)


def test_strict_api_refuses_unknown_fields_by_name(hermes_server, gw_worker):
    r = httpx.post(hermes_server.url + "/v1/responses", json={"input": "x", "text": {"odd": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.odd", r.text
    r = httpx.post(hermes_server.url + "/v1/responses", json={"input": "x", "bogus": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bogus", r.text


def test_client_leaving_a_stream_cancels_it(gw_server, gw_worker):
    gw_worker.set_reply("word " * 200)
    gw_worker.delay = 0.05
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", gw_server.url + "/v1/responses", json={"input": "x", "stream": True}) as r:
            lines = r.iter_lines()  # (kept: dropping the iterator closes the connection at once)
            while "response.output_text.delta" not in next(lines):
                pass
            assert budget_in_use(gw_server.url) > 0
            rid = gw_worker.requests[-1].request_id
    assert wait_until(lambda: rid in gw_worker.cancelled_ids())
    assert wait_until(lambda: budget_in_use(gw_server.url) == 0)


def test_max_output_tokens_makes_it_incomplete(gw_server, gw_worker):
    c = client(gw_server)
    resp = c.responses.create(model=MODEL, input="Talk", max_output_tokens=3)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3 and resp.output[0].status == "incomplete"
    with c.responses.stream(model=MODEL, input="Talk", max_output_tokens=3) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


def test_worker_failure_mid_stream_is_response_failed(gw_server, gw_worker):
    gw_worker.mode = "error"
    with client(gw_server).responses.stream(model=MODEL, input="x") as stream:
        events = list(stream)
    assert events[-1].type == "response.failed" and "boom" in events[-1].response.error.message
    with pytest.raises(openai.APIStatusError):
        client(gw_server).responses.create(model=MODEL, input="x")
    assert wait_until(lambda: budget_in_use(gw_server.url) == 0)


@pytest.mark.parametrize("body,param", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "output": "1"}]},
     "input[1].call_id"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{**WEATHER, "parameters": {"type": "nope"}}]}, "tools[0].parameters"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice.name"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "nope"}}}},
     "text.format.schema"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 100_000}, "max_output_tokens"),
    ({"input": "x", "temperature": 5}, "temperature"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "model": "gpt-4o"}, "model"),
    ({"input": "x", "store": "yes"}, "store"),
])
def test_validation_errors_name_the_field(gw_server, gw_worker, body, param):
    r = httpx.post(gw_server.url + "/v1/responses", json=body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert "messages" not in error["message"] and "response_format" not in error["message"], error


def test_unknown_fields_are_ignored_and_named(gw_server, gw_worker):
    r = httpx.post(gw_server.url + "/v1/responses",
                   json={"input": "x", "bogus": 1, "text": {"verbosity": "low", "odd": 2},
                         "reasoning": {"effort": "low"}, "include": ["reasoning.encrypted_content"]})
    assert r.status_code == 200, r.text
    assert r.headers["x-baton-ignored-fields"] == "bogus,text.odd"
    assert r.json()["reasoning"]["effort"] == "low"
    assert budget_in_use(gw_server.url) == 0


def test_reasoning_content_becomes_a_reasoning_item():
    """Chat's `reasoning_content` (a reasoning parser's) -> a `reasoning` item before the message,
    streamed as reasoning_text deltas; every event is valid for the SDK's own types."""
    from gateway.responses.output import ResponseBuilder

    builder = ResponseBuilder({"id": "resp_1", "model": "m", "tools": [], "tool_choice": "auto",
                               "parallel_tool_calls": True})
    builder.start()
    for delta in ({"role": "assistant", "content": ""}, {"reasoning_content": "Let me "},
                  {"reasoning_content": "think."}, {"content": "42"}):
        builder.feed(delta)
    final = builder.finish("stop", {"input_tokens": 1, "input_tokens_details": {"cached_tokens": 0,
                                    "cache_write_tokens": 0}, "output_tokens": 2,
                                    "output_tokens_details": {"reasoning_tokens": 1}, "total_tokens": 3})
    builder.complete()
    events = builder.drain()
    for event in events:
        STREAM_EVENT.validate_python(event)
    response = Response.model_validate(final)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "Let me think." and response.output_text == "42"
    types = [e["type"] for e in events]
    assert types.count("response.reasoning_text.delta") == 2 and "response.reasoning_text.done" in types
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")


SAMPLES = {"model": MODEL, "input": "x", "instructions": "Be brief.", "tools": [WEATHER], "tool_choice": "auto",
           "parallel_tool_calls": False, "text": {"format": {"type": "json_object"}, "verbosity": "low"},
           "max_output_tokens": 8, "temperature": 0.5, "top_p": 0.9, "stream": False, "store": False,
           "previous_response_id": None, "metadata": {"k": "v"}, "user": "u", "truncation": "disabled",
           "reasoning": {"effort": "low", "summary": None}, "cache_salt": "tenant-a",
           # accepted without effect, and the not-implemented fields at their neutral value (documented too)
           "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k", "safety_identifier": "s",
           "stream_options": {"include_usage": True}, "background": False, "service_tier": "auto", "top_logprobs": 0,
           "max_tool_calls": None, "conversation": None, "prompt": None}


def test_openapi_documents_the_routes_and_every_field_is_accepted(gw_server, gw_worker):
    spec = httpx.get(gw_server.url + "/openapi.json").json()
    assert "post" in spec["paths"]["/v1/responses"]
    assert {"get", "delete"} <= set(spec["paths"]["/v1/responses/{response_id}"])
    fields = set(spec["components"]["schemas"]["ResponsesRequest"]["properties"])
    assert fields == set(SAMPLES), fields ^ set(SAMPLES)
    for name in sorted(fields):
        r = httpx.post(gw_server.url + "/v1/responses", json={"input": "x", "max_output_tokens": 4, name: SAMPLES[name]})
        assert r.status_code == 200 and "x-baton-ignored-fields" not in r.headers, (name, r.text)
    r = httpx.post(gw_server.url + "/v1/responses", json=SAMPLES)
    assert r.status_code == 200 and "x-baton-ignored-fields" not in r.headers, r.text
