"""Structured output and tools through real HTTP: gateway, prefill and decode workers, Redis.

The tiny random-init model is the point: a random model constrained by a grammar still answers
valid JSON (the prefill worker samples the first token under the mask, the decode worker the rest,
each with the matcher rebuilt from the tokens it got). Strings are length-capped in the schemas so
that a random model closes them well before max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from tests.cluster import Cluster
from tests.test_structured_engine import SCHEMA

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
NUMBER = {"type": "integer", "minimum": 0, "maximum": 1000}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": NUMBER, "b": NUMBER},
                                  "required": ["a", "b"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Describe a customer as JSON."}]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with Cluster(tiny_model_dir, prefill=1, decode=1) as c:
        yield c


def chat(cluster, body: dict, status: int = 200) -> dict:
    response = httpx.post(cluster.base_url + "/v1/chat/completions", json={"messages": MESSAGES, **body},
                          timeout=120)
    assert response.status_code == status, response.text
    return response.json()


def test_50_seeded_sampled_json_schema_requests_all_validate(cluster):
    body = {"messages": MESSAGES, "temperature": 1.0, "max_tokens": 150,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "customer", "schema": SCHEMA, "strict": True}}}

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=300) as client:
            responses = await asyncio.gather(*(client.post("/v1/chat/completions", json={**body, "seed": seed})
                                               for seed in range(50)))
        for r in responses:
            assert r.status_code == 200, r.text
        return [r.json()["choices"][0] for r in responses]

    choices = asyncio.run(run())
    texts = set()
    for choice in choices:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        texts.add(choice["message"]["content"])
    assert len(texts) > 5  # different seeds, different answers (the tiny model is peaked)


def test_json_object_guided_choice_regex_and_structured_outputs(cluster):
    out = chat(cluster, {"response_format": {"type": "json_object"}, "temperature": 0, "max_tokens": 200})
    if out["choices"][0]["finish_reason"] == "stop":  # an open object may run to max_tokens
        assert isinstance(json.loads(out["choices"][0]["message"]["content"]), dict)
    else:
        assert out["choices"][0]["message"]["content"].startswith("{")
    choices = ["alpha", "beta (2)", "gamma.delta"]
    for seed in range(5):
        out = chat(cluster, {"guided_choice": choices, "seed": seed, "max_tokens": 20})
        assert out["choices"][0]["message"]["content"] in choices
        assert out["choices"][0]["finish_reason"] == "stop"
    pattern = r"[A-Z]{2}-[0-9]{3,5}"
    for seed in range(5):
        out = chat(cluster, {"guided_regex": pattern, "seed": seed, "max_tokens": 20})
        assert re.fullmatch(pattern, out["choices"][0]["message"]["content"]), out
    out = chat(cluster, {"structured_outputs": {"choice": ["yes", "no"]}, "max_tokens": 5})
    assert out["choices"][0]["message"]["content"] in ("yes", "no")
    out = chat(cluster, {"structured_outputs": {"json": SCHEMA}, "max_tokens": 150, "seed": 3})
    jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), SCHEMA)
    out = chat(cluster, {"guided_grammar": 'root ::= "up" | "down"', "max_tokens": 5})  # GBNF
    assert out["choices"][0]["message"]["content"] in ("up", "down")
    # completions too, and a schema given as JSON text (vLLM accepts both)
    r = httpx.post(cluster.base_url + "/v1/completions", timeout=60, json={
        "prompt": "A customer:", "guided_json": json.dumps(SCHEMA), "max_tokens": 150, "seed": 4})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMA)


def test_streamed_structured_output(cluster):
    with httpx.stream("POST", cluster.base_url + "/v1/chat/completions", timeout=60, json={
            "messages": MESSAGES, "stream": True, "seed": 9, "max_tokens": 150,
            "guided_json": SCHEMA}) as r:
        assert r.status_code == 200
        text = ""
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text += delta.get("content") or ""
    jsonschema.validate(json.loads(text), SCHEMA)


def test_tgi_grammar_json_and_regex(cluster):
    for seed in range(3):
        r = httpx.post(cluster.base_url + "/generate", timeout=60, json={
            "inputs": "A customer:", "parameters": {"max_new_tokens": 150, "do_sample": True, "seed": seed,
                                                    "grammar": {"type": "json", "value": SCHEMA}, "details": True}})
        assert r.status_code == 200, r.text
        assert r.json()["details"]["finish_reason"] == "eos_token"
        jsonschema.validate(json.loads(r.json()["generated_text"]), SCHEMA)
    with httpx.stream("POST", cluster.base_url + "/generate_stream", timeout=60, json={
            "inputs": "Code:", "parameters": {"max_new_tokens": 20,
                                              "grammar": {"type": "regex", "value": "[a-f]{4}[0-9]"}}}) as r:
        assert r.status_code == 200
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert re.fullmatch("[a-f]{4}[0-9]", events[-1]["generated_text"])
    r = httpx.post(cluster.base_url + "/generate", timeout=60, json={
        "inputs": "x", "parameters": {"max_new_tokens": 150, "grammar": {
            "type": "json_schema", "value": {"name": "c", "schema": SCHEMA}}}})
    jsonschema.validate(json.loads(r.json()["generated_text"]), SCHEMA)


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": 'root ::= "a" | undefined_rule'}, "guided_grammar"),
    ({"structured_outputs": {"regex": "(x"}}, "structured_outputs.regex"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "missing"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_invalid_specs_are_a_400_naming_the_field(cluster, body, field):
    error = chat(cluster, body, status=400)["error"]
    assert error["param"] == field, error
    assert f"`{field}`" in error["message"]


def test_tgi_invalid_grammar_is_a_422(cluster):
    r = httpx.post(cluster.base_url + "/generate", timeout=30, json={
        "inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "(unclosed"}}})
    assert r.status_code == 422
    assert "parameters.grammar.value" in r.text


def test_tool_choice_named_and_required(cluster):
    import openai

    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)
    schemas = {"get_weather": WEATHER["function"]["parameters"], "add": ADD["function"]["parameters"]}
    for seed in range(3):
        named = client.chat.completions.create(
            model="", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, ADD],
            tool_choice={"type": "function", "function": {"name": "add"}}, seed=seed, max_tokens=60)
        choice = named.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas["add"])

        # one call (parallel_tool_calls false), then any number: a random model may go on adding
        # calls until max_tokens, and then the answer is the text so far ("length")
        for parallel in (False, True):
            required = client.chat.completions.create(
                model="", messages=[{"role": "user", "content": "Use a tool."}], tools=[WEATHER, ADD],
                tool_choice="required", seed=seed, max_tokens=200, parallel_tool_calls=parallel)
            choice = required.choices[0]
            if choice.finish_reason == "length" and parallel:
                assert choice.message.tool_calls is None and choice.message.content.startswith("[")
                continue
            assert choice.finish_reason == "tool_calls", choice
            assert len(choice.message.tool_calls) == 1 or parallel
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    # "none" and "auto" (SmolLM2's template renders no tools): plain text
    for mode in ("none", "auto"):
        plain = client.chat.completions.create(
            model="", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice=mode,
            max_tokens=5, temperature=0)
        assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content is not None


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_tool_calls_streamed_as_openai_does(cluster, tool_choice):
    import openai

    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
        tool_choice=tool_choice, seed=5, max_tokens=120, stream=True, parallel_tool_calls=False)
    calls: dict[int, dict] = {}
    finish = None
    first_call_delta = None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        assert not choice.delta.content
        for delta in choice.delta.tool_calls or []:
            if first_call_delta is None:
                first_call_delta = delta
            entry = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id:
                entry["id"] = delta.id
            if delta.function and delta.function.name:
                entry["name"] = delta.function.name
            if delta.function and delta.function.arguments:
                entry["arguments"] += delta.function.arguments
    assert finish == "tool_calls"
    # the first delta names the call: index, id, type and function name
    assert first_call_delta.id and first_call_delta.type == "function" and first_call_delta.function.name
    assert len(calls) >= 1
    for entry in calls.values():
        assert entry["id"].startswith("call_") and entry["name"] == "get_weather"
        jsonschema.validate(json.loads(entry["arguments"]), WEATHER["function"]["parameters"])


def test_tool_messages_reach_the_template(cluster):
    """An assistant's tool_calls and the tool's answer are in the prompt (SmolLM2's template does
    not render tool_calls: they are written into the assistant's content)."""
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Rome", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "21 degrees, sunny"},
    ]
    plain = chat(cluster, {"messages": messages[:1], "max_tokens": 1, "temperature": 0})
    full = chat(cluster, {"messages": messages, "tools": [WEATHER], "max_tokens": 1, "temperature": 0})
    assert full["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 20
    r = httpx.post(cluster.base_url + "/tokenize", timeout=30, json={"messages": messages})
    if r.status_code == 200 and "tokens" in r.json():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(cluster.model_dir))
        text = tok.decode(r.json()["tokens"])
        assert "21 degrees, sunny" in text


def test_sigkill_decode_worker_mid_structured_stream(tiny_model_dir):
    """Requests resumed on the other decode worker after a crash rebuild their matcher from the
    tokens so far: every answer is exactly what one uninterrupted engine samples, and valid."""
    import signal

    from baton import LLM, SamplingParams
    from baton.common.structured import json_schema

    schema = {"type": "object", "properties": {"xs": {"type": "array", "minItems": 24, "maxItems": 24,
                                                      "items": {"type": "integer", "minimum": 0, "maximum": 99}}},
              "required": ["xs"], "additionalProperties": False}
    prompts = [f"Numbers, list {i}:" for i in range(8)]

    async def stream(client: httpx.AsyncClient, prompt: str, seed: int, counter: list[int]) -> list[int]:
        ids: list[int] = []
        async with client.stream("POST", "/generate_stream", json={"inputs": prompt, "parameters": {
                "max_new_tokens": 150, "do_sample": True, "seed": seed,
                "grammar": {"type": "json", "value": schema}}}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    event = json.loads(line[5:])
                    assert "error" not in event, event
                    if not event["token"]["special"]:
                        ids.append(event["token"]["id"])
                    counter[0] += 1
        return ids

    async def run(cluster: Cluster) -> list[list[int]]:
        counter = [0]
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=180) as client:
            tasks = [asyncio.create_task(stream(client, p, seed, counter)) for seed, p in enumerate(prompts)]
            while counter[0] < 100 and not all(t.done() for t in tasks):
                await asyncio.sleep(0.01)
            cluster.kill("decode-0", signal.SIGKILL)
            return await asyncio.gather(*tasks)

    with Cluster(tiny_model_dir, prefill=1, decode=2, decode_args=("--max-num-seqs", "4")) as cluster:
        got = asyncio.run(run(cluster))
        assert cluster.procs["decode-0"].poll() is not None
    reference = LLM(model=str(tiny_model_dir), dtype="float32", enable_prefix_caching=False)
    expected = reference.generate(prompts, [SamplingParams(temperature=1.0, seed=seed, max_tokens=150,
                                                           structured=json_schema(schema))
                                            for seed in range(len(prompts))])
    for ids, out in zip(got, expected):
        assert out.outputs[0].finish_reason == "stop"
        assert ids == [t for t in out.outputs[0].token_ids if t != 2]
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_auto_tool_calls_parsed_from_a_template_that_renders_tools(tiny_model_dir, tmp_path):
    """tool_choice auto with a Hermes-style template: `<tool_call>` blocks in the answer become
    tool_calls (here a regex makes the random model write one), streamed or not."""
    import openai

    from tests.test_structured_gateway import HERMES_TEMPLATE

    template = tmp_path / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", "unit": "c"\}\}\n</tool_call>'
    with Cluster(tiny_model_dir, prefill=1, decode=1, gateway_args=("--chat-template", str(template))) as cluster:
        client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)
        kwargs = dict(model="", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], max_tokens=80,
                      extra_body={"guided_regex": call})
        answer = client.chat.completions.create(**kwargs)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [tool_call] = choice.message.tool_calls
        assert tool_call.function.name == "get_weather"
        jsonschema.validate(json.loads(tool_call.function.arguments), WEATHER["function"]["parameters"])
        calls, finish = [], None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            finish = chunk.choices[0].finish_reason or finish
            calls += chunk.choices[0].delta.tool_calls or []
        assert finish == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
        # without a call in the answer, auto answers text
        plain = client.chat.completions.create(**{**kwargs, "extra_body": {"guided_regex": "[a-z]{3}"}})
        assert plain.choices[0].message.tool_calls is None and len(plain.choices[0].message.content) == 3
