"""The API fields clients send beyond plain sampling (issue 12), through real HTTP and real clients:
OpenAI's penalties, min_p and logit_bias reaching the workers' SamplingParams; TGI's do_sample rule;
unknown fields ignored (and reported) or, with strict_api, refused; known-but-unsupported fields
refused by name; served model names and 404 for others; /tokenize, /detokenize, /version; and the
OpenAPI document naming every field the gateway accepts."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import uuid

import httpx
import pytest
from tests.test_gateway_support import DEFAULT_REPLY, start_gateway

HEADER = "x-baton-ignored-fields"
CHAT = [{"role": "user", "content": "Hi"}]


def sse_events(text: str) -> list[str]:
    return [line[len("data:"):].strip() for line in text.split("\n") if line.startswith("data:")]


@pytest.fixture(scope="module")
def named_gateway(default_model_dir, gw_redis_url, gw_tokenizer, gw_echo_worker):
    """Served as two names, with unknown fields refused."""
    server = start_gateway(default_model_dir, gw_redis_url, gw_tokenizer, max_queue_wait=5.0,
                           served_model_names=("alpha", "beta"), strict_api=True)
    yield server
    server.stop()


# ---- OpenAI sampling fields -> SamplingParams ----

def test_penalties_min_p_and_logit_bias_reach_the_workers(gw_server, gw_worker, default_model_dir):
    import openai

    client = openai.OpenAI(base_url=gw_server.url + "/v1", api_key="unused", max_retries=0)
    c = client.completions.create(model=default_model_dir.name, prompt="Say hello", max_tokens=8,
                                  presence_penalty=0.5, frequency_penalty=-1.25, logit_bias={"42": -100, "7": 5},
                                  extra_body={"min_p": 0.05})
    assert c.choices[0].text
    s = gw_worker.requests[-1].sampling
    assert (s.presence_penalty, s.frequency_penalty, s.min_p) == (0.5, -1.25, 0.05)
    assert sorted(map(tuple, s.logit_bias)) == [(7, 5.0), (42, -100.0)]
    assert all(isinstance(pair[0], int) for pair in s.logit_bias)

    chat = client.chat.completions.create(model=default_model_dir.name, messages=CHAT, max_tokens=4,
                                          presence_penalty=-2, frequency_penalty=2, logit_bias={"0": 0.5},
                                          extra_body={"min_p": 1})
    assert chat.choices[0].message.content
    s = gw_worker.requests[-1].sampling
    assert (s.presence_penalty, s.frequency_penalty, s.min_p, s.logit_bias) == (-2.0, 2.0, 1.0, [[0, 0.5]])

    # Defaults: nothing edits the logits.
    client.completions.create(model=default_model_dir.name, prompt="x", max_tokens=2)
    s = gw_worker.requests[-1].sampling
    assert (s.presence_penalty, s.frequency_penalty, s.min_p, s.logit_bias) == (0.0, 0.0, 0.0, [])


BAD_SAMPLING = [
    ({"presence_penalty": 2.5}, "presence_penalty", "<= 2"),
    ({"presence_penalty": "high"}, "presence_penalty", "number"),
    ({"frequency_penalty": -3}, "frequency_penalty", ">= -2"),
    ({"min_p": 1.5}, "min_p", "<= 1"),
    ({"min_p": -0.1}, "min_p", ">= 0"),
    ({"logit_bias": {"50256": -100}}, "logit_bias", "token id 50256 outside [0, 49152)"),
    ({"logit_bias": {"1": 150}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"1": -100.5}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"-1": 3}}, "logit_bias", "token ids"),
    ({"logit_bias": {"the": 3}}, "logit_bias", "token ids"),
    ({"logit_bias": {"1": "3"}}, "logit_bias", "numbers"),
    ({"logit_bias": {"1": True}}, "logit_bias", "numbers"),
    ({"logit_bias": [[1, 2]]}, "logit_bias", "object"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("fields,param,fragment", BAD_SAMPLING, ids=[f"{p}:{i}" for i, (_f, p, _m) in
                                                                     enumerate(BAD_SAMPLING)])
def test_out_of_range_sampling_fields_are_400_naming_the_field(gw_server, path, fields, param, fragment):
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": CHAT}
    r = httpx.post(gw_server.url + path, json={**body, **fields, "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert f"`{param}`" in error["message"] and fragment in error["message"], error["message"]


def test_greedy_openai_request_drops_min_p(gw_server, gw_worker):
    r = httpx.post(gw_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0,
                                                           "min_p": 0.5, "presence_penalty": 1})
    assert r.status_code == 200, r.text
    s = gw_worker.requests[-1].sampling
    assert s.temperature == 0.0 and s.min_p == 0.0 and s.presence_penalty == 1.0  # penalties still apply


# ---- vLLM's cache_salt, on every generation endpoint ----

SALTED = [  # path, a body without the salt, where the salt goes
    ("/v1/completions", {"prompt": "x", "max_tokens": 2}, None),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}, None),
    ("/v1/responses", {"input": "x", "max_output_tokens": 2, "store": False}, None),
    ("/v1/messages", {"model": "SmolLM2-135M-Instruct", "messages": CHAT, "max_tokens": 2}, None),
    ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 2}}, "parameters"),
    ("/generate_stream", {"inputs": "x", "parameters": {"max_new_tokens": 2}}, "parameters"),
    ("/", {"inputs": "x", "parameters": {"max_new_tokens": 2}}, "parameters"),
]


def _salted(body: dict, where: str | None, salt: object) -> dict:
    if where is None:
        return {**body, "cache_salt": salt}
    return {**body, where: {**body[where], "cache_salt": salt}}


@pytest.mark.parametrize("path,body,where", SALTED, ids=[p for p, _b, _w in SALTED])
def test_cache_salt_reaches_the_workers_from_every_endpoint(gw_server, gw_worker, path, body, where):
    salt = f"tenant-{uuid.uuid4().hex}"
    r = httpx.post(gw_server.url + path, json=_salted(body, where, salt))
    assert r.status_code == 200 and HEADER not in r.headers, r.text
    assert gw_worker.requests[-1].sampling.cache_salt == salt
    r = httpx.post(gw_server.url + path, json=body)  # unsalted: the shared cache, as before
    assert r.status_code == 200, r.text
    assert gw_worker.requests[-1].sampling.cache_salt is None


@pytest.mark.parametrize("path,body,where", SALTED, ids=[p for p, _b, _w in SALTED])
@pytest.mark.parametrize("salt,fragment", [("", "non-empty"), (7, "string"), ("s" * 1025, "at most 1024")],
                         ids=["empty", "number", "too-long"])
def test_a_bad_cache_salt_is_a_4xx_in_the_apis_style(gw_server, gw_worker, path, body, where, salt, fragment):
    before = len(gw_worker.requests)
    r = httpx.post(gw_server.url + path, json=_salted(body, where, salt))
    error = r.json()
    if path == "/v1/messages":
        assert r.status_code == 400 and error["type"] == "error", r.text
        assert error["error"]["type"] == "invalid_request_error" and "cache_salt" in error["error"]["message"]
        message = error["error"]["message"]
    elif path.startswith("/v1/"):
        assert r.status_code == 400 and error["error"]["param"] == "cache_salt", r.text
        message = error["error"]["message"]
    else:
        assert r.status_code == 422 and error["error_type"] == "validation", r.text
        message = error["error"]
        assert "`parameters.cache_salt`" in message
    assert fragment in message, message
    assert len(gw_worker.requests) == before  # nothing reached a worker


# ---- TGI's do_sample ----

TGI_SAMPLING = [  # parameters, sampled?
    ({}, False),
    ({"do_sample": False}, False),
    ({"do_sample": True}, True),
    ({"temperature": 0.7}, True),
    ({"temperature": 1.0}, False),  # a temperature of 1 warps nothing
    ({"top_p": 0.9}, True),
    ({"top_p": 1.0}, False),
    ({"top_k": 20}, True),
    ({"typical_p": 1.0}, False),
    ({"do_sample": False, "temperature": 0.5, "top_k": 3}, True),  # TGI: do_sample OR any warper
    ({"do_sample": True, "temperature": 0}, False),  # temperature 0 is greedy whatever else
    ({"repetition_penalty": 1.3}, False),  # not a warper
]


@pytest.mark.parametrize("parameters,sampled", TGI_SAMPLING, ids=[json.dumps(p) for p, _s in TGI_SAMPLING])
def test_tgi_samples_when_do_sample_or_a_warper_is_set(gw_server, gw_worker, parameters, sampled):
    r = httpx.post(gw_server.url + "/generate", json={"inputs": "Hello", "parameters": {
        **parameters, "max_new_tokens": 3, "details": True}})
    assert r.status_code == 200, r.text
    s = gw_worker.requests[-1].sampling
    details = r.json()["details"]
    if sampled:
        assert s.temperature == parameters.get("temperature", 1.0) and not s.greedy
        assert s.top_p == parameters.get("top_p", 1.0) and s.top_k == parameters.get("top_k", -1)
        assert details["seed"] is not None and details["seed"] == s.seed  # TGI reports it for replay
    else:
        assert s.temperature == 0.0 and s.top_p == 1.0 and s.top_k == -1
        assert details["seed"] is None
    assert s.repetition_penalty == parameters.get("repetition_penalty", 1.0)


def test_huggingface_hub_temperature_alone_samples(gw_server, gw_worker, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    from huggingface_hub import InferenceClient

    out = InferenceClient(model=gw_server.url).text_generation("Hi", max_new_tokens=3, temperature=0.6,
                                                               details=True)
    assert out.details.seed is not None and gw_worker.requests[-1].sampling.temperature == 0.6


# ---- unknown fields ----

def _ignored(r: httpx.Response) -> list[str]:
    return r.headers[HEADER].split(",")


def test_unknown_fields_are_ignored_and_listed(gw_server, gw_worker):
    r = httpx.post(gw_server.url + "/v1/completions", json={
        "prompt": "x", "max_tokens": 3, "skip_special_tokens": True, "chat_template_kwargs": {"a": 1}})
    assert r.status_code == 200, r.text
    assert _ignored(r) == ["chat_template_kwargs", "skip_special_tokens"]
    r = httpx.post(gw_server.url + "/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 3, "stream": True, "x_weird": [1],
        "stream_options": {"include_usage": True, "future_option": 1}})
    assert r.status_code == 200 and sse_events(r.text)[-1] == "[DONE]"
    assert _ignored(r) == ["x_weird", "stream_options.future_option"]
    r = httpx.post(gw_server.url + "/generate", json={"inputs": "x", "top_level": 1,
                                                      "parameters": {"max_new_tokens": 2, "nope": None}})
    assert r.status_code == 200 and _ignored(r) == ["top_level", "parameters.nope"]
    r = httpx.post(gw_server.url + "/generate_stream", json={"inputs": "x", "parameters": {"adapter": "a"}})
    assert r.status_code == 200 and _ignored(r) == ["parameters.adapter"]
    r = httpx.post(gw_server.url + "/", json={"inputs": "x", "parameters": {"max_new_tokens": 2}, "extra": 0})
    assert r.status_code == 200 and _ignored(r) == ["extra"]
    # A request without unknown fields has no header.
    r = httpx.post(gw_server.url + "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200 and HEADER not in r.headers


def test_ignored_field_names_are_logged_once_and_safe_in_the_header(gw_server, gw_worker, caplog):
    name = f"field_{uuid.uuid4().hex[:8]}"
    caplog.set_level(logging.WARNING, logger="gateway.validation")
    for _ in range(3):
        r = httpx.post(gw_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, name: 1})
        assert r.status_code == 200 and _ignored(r) == [name]
    assert sum(name in rec.getMessage() for rec in caplog.records) == 1
    # Names are client text: the header stays ASCII, one element per name, no CR/LF.
    odd = ["a,b", "😀", "", "x\r\nSet-Cookie: y", "z" * 500]
    r = httpx.post(gw_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, **{k: 1 for k in odd}})
    assert r.status_code == 200, r.text
    shown = _ignored(r)
    assert len(shown) == len(odd) and all(s.isascii() and len(s) <= 64 * 3 for s in shown)
    assert "a%2Cb" in shown and '""' in shown and "set-cookie" not in {k.lower() for k in r.headers}


def test_strict_api_refuses_unknown_fields(named_gateway, gw_worker):
    r = httpx.post(named_gateway.url + "/v1/completions", json={"prompt": "x", "whatever": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "whatever"
    assert "`whatever`" in r.json()["error"]["message"]
    r = httpx.post(named_gateway.url + "/v1/chat/completions", json={
        "messages": CHAT, "stream": True, "stream_options": {"x": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.x"
    r = httpx.post(named_gateway.url + "/generate", json={"inputs": "x", "bogus": 1})
    assert r.status_code == 422 and "`bogus`" in r.json()["error"]
    r = httpx.post(named_gateway.url + "/generate", json={"inputs": "x", "parameters": {"nope": 1}})
    assert r.status_code == 422 and "`parameters.nope`" in r.json()["error"]
    r = httpx.post(named_gateway.url + "/tokenize", json={"prompt": "x", "extra": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "extra"
    # Known fields are still fine, and nothing is listed.
    r = httpx.post(named_gateway.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "min_p": 0.1})
    assert r.status_code == 200 and HEADER not in r.headers


UNSUPPORTED = [  # known fields we cannot honour (or values out of range): refused by name
    ("/v1/completions", {"n": 17}, "n"),
    ("/v1/completions", {"n": 2, "best_of": 1}, "best_of"),
    ("/v1/completions", {"best_of": 3, "stream": True}, "best_of"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": ["a"] * 65}, "prompt"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/generate", {"top_n_tokens": 6}, "parameters.top_n_tokens"),
    ("/generate", {"best_of": 2}, "parameters.best_of"),  # greedy
    ("/generate", {"best_of": 5, "do_sample": True}, "parameters.best_of"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    # structured output and tools: invalid values (tests/test_structured_api.py has more)
    ("/v1/completions", {"guided_json": {"type": "nope"}}, "guided_json"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),  # without tools
    ("/v1/chat/completions", {"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
    ("/generate", {"grammar": {"type": "regex", "value": "(a"}}, "parameters.grammar.value"),
    ("/generate", {"typical_p": 0.5}, "parameters.typical_p"),
    ("/generate", {"watermark": True}, "parameters.watermark"),
]


@pytest.mark.parametrize("path,fields,param", UNSUPPORTED, ids=[f"{p}:{n}" for p, _f, n in UNSUPPORTED])
def test_known_but_unsupported_fields_are_refused_by_name(gw_server, path, fields, param):
    if path == "/generate":
        body = {"inputs": "x", "parameters": fields}
    else:
        body = {"prompt": "x", **fields} if path == "/v1/completions" else {"messages": CHAT, **fields}
    r = httpx.post(gw_server.url + path, json=body)
    if path == "/generate":
        assert r.status_code == 422 and f"`{param}`" in r.json()["error"], r.text
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert f"`{param}`" in r.json()["error"]["message"]


def test_neutral_values_of_unsupported_fields_are_accepted(gw_server, gw_worker, monkeypatch):
    # What clients send by default: huggingface_hub puts decoder_input_details=false in every call.
    ok = [
        ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 2, "decoder_input_details": False,
                                                      "best_of": 1, "top_n_tokens": 0, "grammar": None}}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "n": 1, "logprobs": False, "tools": [],
                                  "response_format": {"type": "text"}, "tool_choice": "auto", "echo": False}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": None, "echo": False, "best_of": 1,
                             "guided_json": None, "use_beam_search": False}),
    ]
    for path, body in ok:
        r = httpx.post(gw_server.url + path, json=body)
        assert r.status_code == 200, (path, r.text)
        assert HEADER not in r.headers


# ---- served model names ----

def test_served_model_names(named_gateway, gw_worker):
    import openai

    listed = httpx.get(named_gateway.url + "/v1/models").json()
    assert [m["id"] for m in listed["data"]] == ["alpha", "beta"]
    assert all(m["object"] == "model" and m["max_model_len"] == 8192 for m in listed["data"])  # the model's
    client = openai.OpenAI(base_url=named_gateway.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["alpha", "beta"]
    assert client.completions.create(model="beta", prompt="x", max_tokens=2).model == "beta"
    assert client.chat.completions.create(model="alpha", messages=CHAT, max_tokens=2).model == "alpha"
    r = httpx.post(named_gateway.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "alpha"  # no model: the first name
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gamma", prompt="x", max_tokens=2)
    assert info.value.status_code == 404
    r = httpx.post(named_gateway.url + "/v1/chat/completions", json={"model": "gamma", "messages": CHAT})
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model `gamma` does not exist.", "type": "NotFoundError",
                                  "param": "model", "code": 404}}
    assert httpx.get(named_gateway.url + "/info").json()["model_id"] == "alpha"


def test_default_served_name_is_the_model_directory(gw_server, gw_worker, default_model_dir):
    name = default_model_dir.name
    assert [m["id"] for m in httpx.get(gw_server.url + "/v1/models").json()["data"]] == [name]
    r = httpx.post(gw_server.url + "/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == name
    r = httpx.post(gw_server.url + "/v1/completions", json={"model": "gpt-4o", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_huggingface_hub_chat_against_the_url(named_gateway, gw_worker, monkeypatch):
    """huggingface_hub's chat_completion sends a placeholder `model` when given a URL: served."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    from huggingface_hub import InferenceClient

    out = InferenceClient(model=named_gateway.url).chat_completion(CHAT, max_tokens=64)
    assert out.choices[0].message.content == DEFAULT_REPLY
    assert gw_worker.requests[-1].sampling.max_tokens == 64


# ---- /tokenize, /detokenize, /version ----

def test_tokenize_and_detokenize(gw_server, gw_worker, gw_tokenizer, default_model_dir):
    text = "Hello, naïve café 😀"
    r = httpx.post(gw_server.url + "/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == gw_tokenizer.encode_text(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 8192 and body["token_strs"] is None
    strs = httpx.post(gw_server.url + "/tokenize", json={"prompt": text, "return_token_strs": True,
                                                         "model": default_model_dir.name}).json()["token_strs"]
    assert strs == gw_tokenizer.hf.convert_ids_to_tokens(body["tokens"])
    back = httpx.post(gw_server.url + "/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}

    # Chat: exactly the ids a chat completion sends to the workers.
    chat = httpx.post(gw_server.url + "/tokenize", json={"messages": CHAT}).json()
    r = httpx.post(gw_server.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    assert r.status_code == 200 and chat["tokens"] == gw_worker.requests[-1].prompt_token_ids
    bare = httpx.post(gw_server.url + "/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"] and chat["tokens"][:bare["count"]] == bare["tokens"]
    special = gw_tokenizer.hf.all_special_ids[0]
    kept = httpx.post(gw_server.url + "/detokenize", json={"tokens": [special]}).json()["prompt"]
    assert kept == gw_tokenizer.hf.convert_ids_to_tokens(special)  # special tokens are kept


BAD_TOKENIZE = [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", {"prompt": "x", "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "model"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_TOKENIZE, ids=[f"{p}:{i}" for i, (p, *_r) in
                                                                     enumerate(BAD_TOKENIZE)])
def test_tokenizer_endpoints_answer_openai_errors(gw_server, path, body, status, param):
    r = httpx.post(gw_server.url + path, json=body)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["param"] == param
    r = httpx.post(gw_server.url + path, content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]


def test_version(gw_server):
    r = httpx.get(gw_server.url + "/version")
    assert r.status_code == 200 and r.json() == {"version": importlib.metadata.version("baton")}


# ---- stream_options.continuous_usage_stats ----

def test_continuous_usage_stats(gw_server, gw_worker):
    r = httpx.post(gw_server.url + "/v1/completions", json={
        "prompt": "x", "max_tokens": 6, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert all(c["usage"] is not None for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] < 6
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)
    # Without include_usage it changes nothing (vLLM's rule).
    r = httpx.post(gw_server.url + "/v1/completions", json={
        "prompt": "x", "max_tokens": 3, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in json.loads(e) for e in sse_events(r.text)[:-1])


# ---- the OpenAPI document names what is accepted ----

# A valid value for every field the OpenAI request schemas document; a field documented without
# one here fails the test, so the document, the validation and this list move together.
SAMPLES = {
    "model": "SmolLM2-135M-Instruct", "max_tokens": 2, "max_completion_tokens": 2, "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "stop": ["zzz"],
    "temperature": 0.5, "top_p": 0.9, "seed": 3, "n": 1, "top_k": 5, "repetition_penalty": 1.1,
    "ignore_eos": False, "stop_token_ids": [2], "user": "u", "presence_penalty": 0.3, "frequency_penalty": 0.2,
    "logit_bias": {"5": 1.5}, "min_p": 0.05, "response_format": {"type": "text"},
    "prompt": "Hello", "echo": True, "add_special_tokens": False, "messages": CHAT,
    "logprobs": 2, "top_logprobs": 2, "prompt_logprobs": 1, "best_of": 1, "min_tokens": 1,
    "guided_json": {"type": "object"}, "guided_regex": "[a-z]+", "guided_choice": ["a", "b"],
    "guided_grammar": 'start: "a"', "structured_outputs": {"regex": "[0-9]"},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": False,
    "cache_salt": "tenant-a",
    # documented as not implemented: accepted at their neutral value
    "use_beam_search": False, "suffix": "",
}
# One output constraint per request: sent together, all but the first of these are left out.
EXCLUSIVE = ["guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "tool_choice"]
CHAT_SAMPLES = {"logprobs": True, "chat_template_kwargs": {"enable_thinking": False},  # chat's logprobs is a flag
                # accepted and unused, or not implemented and accepted at their neutral value
                "store": False, "metadata": {"k": "v"}, "service_tier": "auto", "functions": [],
                "function_call": "none", "echo": False}
COMPANIONS = {"stream_options": {"stream": True}, "top_logprobs": {"logprobs": True},  # what a field needs
              "tool_choice": {"tools": SAMPLES["tools"]}}


def _documented(spec: dict, name: str) -> set[str]:
    schema = spec["components"]["schemas"][name]
    props: set[str] = set()
    for part in schema.get("allOf", [schema]):
        if "$ref" in part:
            props |= _documented(spec, part["$ref"].rsplit("/", 1)[1])
        props |= set(part.get("properties", {}))
    return props


@pytest.mark.parametrize("path,schema", [("/v1/completions", "CompletionRequest"),
                                         ("/v1/chat/completions", "ChatRequest")])
def test_every_documented_openai_field_is_accepted(gw_server, gw_worker, path, schema):
    spec = httpx.get(gw_server.url + "/openapi.json").json()
    fields = _documented(spec, schema)
    assert {"presence_penalty", "frequency_penalty", "min_p", "logit_bias"} <= fields
    chat = path != "/v1/completions"
    samples = {**SAMPLES, **CHAT_SAMPLES} if chat else SAMPLES
    assert not fields - set(samples), fields - set(samples)
    base = {"messages": CHAT} if chat else {"prompt": "Hello"}
    for field in sorted(fields):
        body = {**base, "max_tokens": 2, field: samples[field], **COMPANIONS.get(field, {})}
        r = httpx.post(gw_server.url + path, json=body)
        assert r.status_code == 200 and HEADER not in r.headers, (field, r.text)
    together = {f for f in fields if f not in EXCLUSIVE[1:]}
    r = httpx.post(gw_server.url + path, json={**base, **{f: samples[f] for f in together}})
    assert r.status_code == 200 and HEADER not in r.headers, r.text
    assert spec["components"]["schemas"]["OpenAICommon"]["properties"]["model"]["enum"] == ["SmolLM2-135M-Instruct"]
    for endpoint in ("/tokenize", "/detokenize"):
        assert "post" in spec["paths"][endpoint]
    assert "get" in spec["paths"]["/version"]


# ---- the gateway's flags ----

def test_served_model_name_and_strict_api_flags(monkeypatch):
    from gateway.__main__ import parse_args

    monkeypatch.setattr("baton.common.model_files.resolve_model", lambda model: "/models/Some-Model")
    monkeypatch.delenv("BATON_STRICT_API", raising=False)
    default = parse_args([])
    assert default.served_model_names == ("Some-Model",) and default.model_name == "Some-Model"
    assert default.strict_api is False
    named = parse_args(["--served-model-name", "a", "org/b", "a", "--strict-api"])
    assert named.served_model_names == ("a", "org/b") and named.model_name == "a" and named.strict_api
    assert parse_args(["--model-name", "legacy"]).served_model_names == ("legacy",)  # the older flag
    monkeypatch.setenv("BATON_STRICT_API", "1")
    assert parse_args([]).strict_api is True


def test_min_tokens_reaches_the_workers_and_delays_stop_strings(gw_server, gw_worker):
    # The echo worker answers DEFAULT_REPLY ("Hello! ..."): "!" is its second token.
    body = {"prompt": "x", "max_tokens": 6, "stop": ["!"]}
    r = httpx.post(gw_server.url + "/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello"
    r = httpx.post(gw_server.url + "/v1/completions", json={**body, "min_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith("Hello!")  # the stop string came too early
    assert gw_worker.requests[-1].sampling.min_tokens == 3
    r = httpx.post(gw_server.url + "/v1/completions", json={**body, "min_tokens": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
