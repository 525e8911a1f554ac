"""Bad input never produces a 5xx: malformed bodies, wrong types, unsupported fields, out-of-range
values and over-limit prompts get 4xx with a message naming the problem (unknown fields, ignored by
default, are covered in test_gateway_api_fields). Also: body size limit,
API key auth, and the /metrics counters."""

from __future__ import annotations

import re

import httpx
import pytest
from tests.test_gateway_support import start_gateway


LONG = "hello " * 8300  # > max_input_tokens (8191: the default model's context of 8192, less one)

# (path, body, expected status, a fragment the error message must contain)
BAD_JSON_BODIES = [
    ("/generate", {}, 422, "`inputs` is required"),
    ("/generate", {"inputs": ""}, 422, "cannot be empty"),
    ("/generate", {"inputs": 5}, 422, "must be a string"),
    ("/generate", {"inputs": "x", "parameters": []}, 422, "must be an object"),
    ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 0}}, 422, "max_new_tokens"),
    ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": -5}}, 422, "max_new_tokens"),
    ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": "10"}}, 422, "must be an integer"),
    ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": True}}, 422, "must be an integer"),
    ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 10**30}}, 422, "`max_new_tokens` must be <= 8192"),
    ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 8192}}, 422, "must be <= 8192. Given: 1 `inputs` tokens and 8192"),
    ("/generate", {"inputs": "x", "parameters": {"top_p": 0}}, 422, "top_p"),
    ("/generate", {"inputs": "x", "parameters": {"top_p": 1.5}}, 422, "top_p"),
    ("/generate", {"inputs": "x", "parameters": {"temperature": -1}}, 422, "temperature"),
    ("/generate", {"inputs": "x", "parameters": {"top_k": 0}}, 422, "top_k"),
    ("/generate", {"inputs": "x", "parameters": {"seed": -1}}, 422, "seed"),
    ("/generate", {"inputs": "x", "parameters": {"stop": "x"}}, 422, "list of strings"),
    ("/generate", {"inputs": "x", "parameters": {"stop": ["a"] * 17}}, 422, "at most 16"),
    ("/generate", {"inputs": "x", "parameters": {"stop": ["x" * 500]}}, 422, "at most 128"),
    ("/generate", {"inputs": "x", "parameters": {"stop": [""]}}, 422, "empty string"),
    ("/generate", {"inputs": "x", "parameters": {"best_of": 2}}, 422, "needs sampling"),
    ("/generate", {"inputs": "x", "parameters": {"grammar": {"type": "xml", "value": {}}}}, 422, "grammar"),
    ("/generate", {"inputs": LONG}, 422, "`inputs` must have less than 8192 tokens"),
    ("/generate_stream", {"inputs": LONG}, 422, "`inputs` must have less than 8192 tokens"),
    ("/", {"inputs": "x", "stream": "yes"}, 422, "boolean"),
    ("/v1/completions", {}, 400, "`prompt` is required"),
    ("/v1/completions", {"prompt": ""}, 400, "cannot be empty"),
    ("/v1/completions", {"prompt": []}, 400, "cannot be empty"),
    ("/v1/completions", {"prompt": ["a", 5]}, 400, "`prompt` must be"),
    ("/v1/completions", {"prompt": [1, -3]}, 400, "outside"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "outside"),
    ("/v1/completions", {"prompt": {"a": 1}}, 400, "`prompt` must be"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "`n`"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, 400, "`echo`"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}, 400, "must be an integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 999999}, 400, "maximum context length is 8192 tokens. However, you requested 1000000 tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": "high"}, 400, "must be a number"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "`stop`"),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 17}, 400, "at most 16"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "only allowed"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 3}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, 400, "`logprobs`"),
    ("/v1/completions", {"prompt": LONG}, 400, "maximum context length is 8192 tokens"),
    ("/v1/chat/completions", {}, 400, "`messages` is required"),
    ("/v1/chat/completions", {"messages": []}, 400, "non-empty"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "image_url input is not served"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "picture"}]}]}, 400,
     "only text parts"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": []}]}]}, 400,
     "only text parts"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
     400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "`tools[0]`"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 99}, 400, "`n`"),
]

RAW_BODIES = [
    ("/generate", b"{not json", 422, "malformed JSON"),
    ("/generate", b"", 422, "empty"),
    ("/generate", b"[1, 2]", 422, "JSON object"),
    ("/generate", b'{"inputs": "\xff\xfe"}', 422, "UTF-8"),
    ("/generate", b'{"inputs": "\\ud800"}', 422, "surrogate"),
    ("/generate", b'{"inputs": "x", "parameters": {"temperature": NaN, "do_sample": true}}', 422, "finite"),
    ("/generate", b"[" * 100_000 + b"]" * 100_000, 422, "JSON"),
    ("/v1/completions", b"nope", 400, "malformed JSON"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xc3"}]}', 400, "UTF-8"),
    ("/", b"null", 422, "JSON object"),
]


def check_error(r: httpx.Response, path: str, status: int, fragment: str) -> None:
    assert r.status_code == status, (path, r.status_code, r.text)
    body = r.json()
    if path.startswith("/v1/"):
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["type"] == "invalid_request_error"
        message = body["error"]["message"]
    else:
        assert body["error_type"] == "validation"
        message = body["error"]
    assert fragment.lower() in message.lower(), (fragment, message)


@pytest.mark.parametrize("path,body,status,fragment", BAD_JSON_BODIES,
                         ids=[f"{p}:{i}" for i, (p, *_rest) in enumerate(BAD_JSON_BODIES)])
def test_bad_json_bodies(gw_server, path, body, status, fragment):
    check_error(httpx.post(gw_server.url + path, json=body), path, status, fragment)


@pytest.mark.parametrize("path,raw,status,fragment", RAW_BODIES,
                         ids=[f"{p}:{i}" for i, (p, *_rest) in enumerate(RAW_BODIES)])
def test_bad_raw_bodies(gw_server, path, raw, status, fragment):
    r = httpx.post(gw_server.url + path, content=raw, headers={"content-type": "application/json"})
    check_error(r, path, status, fragment)


def test_body_size_limit_is_413(default_model_dir, gw_redis_url, gw_tokenizer, gw_echo_worker):
    server = start_gateway(default_model_dir, gw_redis_url, gw_tokenizer, max_body_bytes=1 << 20)
    try:
        big = {"inputs": "x" * (1 << 20)}
        r = httpx.post(server.url + "/generate", json=big)
        assert r.status_code == 413 and r.json()["error_type"] == "payload_too_large"

        def chunks():  # no Content-Length: the limit is enforced while reading
            for _ in range(40):
                yield b" " * 65536

        r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    finally:
        server.stop()


def test_wrong_method_is_json_405(gw_server):
    r = httpx.get(gw_server.url + "/generate")
    assert r.status_code == 405 and "error" in r.json()


def test_valid_edge_inputs_succeed(gw_server, gw_worker):
    ok = [
        ("/generate", {"inputs": " ", "parameters": {"max_new_tokens": 3, "stop": [], "details": False,
                                                      "decoder_input_details": False, "typical_p": 1.0,
                                                      "watermark": False, "best_of": 1}}),
        ("/generate", {"inputs": "x" , "parameters": {"truncate": 1, "return_full_text": True}}),
        ("/generate", {"inputs": "x", "parameters": {"do_sample": True, "temperature": 0.5, "top_p": 1.0,
                                                      "top_k": 5, "repetition_penalty": 1.1}}),
        ("/v1/completions", {"prompt": ["only one"], "max_tokens": 2, "n": 1, "echo": False, "logprobs": None}),
        ("/v1/completions", {"prompt": [[1, 2, 3]], "max_tokens": 2.0, "seed": -5, "user": "u"}),
        ("/v1/chat/completions", {"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]},
                                               {"role": "user", "content": "b"}],
                                  "response_format": {"type": "text"}, "tool_choice": "none",
                                  "ignore_eos": True, "min_tokens": 2, "stop_token_ids": [2]}),
    ]
    for path, body in ok:
        r = httpx.post(gw_server.url + path, json=body)
        assert r.status_code == 200, (path, body, r.text)
    r = httpx.post(gw_server.url + "/generate", json={"inputs": "abc", "parameters": {"return_full_text": True}})
    assert r.json()["generated_text"].startswith("abc")


def test_api_key(default_model_dir, gw_redis_url, gw_tokenizer, gw_worker):
    import openai

    server = start_gateway(default_model_dir, gw_redis_url, gw_tokenizer, api_key="s3cret")
    try:
        r = httpx.post(server.url + "/generate", json={"inputs": "x"})
        assert r.status_code == 401 and r.json()["error_type"] == "authentication"
        r = httpx.post(server.url + "/generate", json={"inputs": "x"}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        r = httpx.get(server.url + "/stats")
        assert r.status_code == 401
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=default_model_dir.name, prompt="x", max_tokens=2)
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=default_model_dir.name, prompt="x", max_tokens=2).choices[0].text
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            r = httpx.post(server.url + path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            r = httpx.post(server.url + path, json=body, headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200, path
        assert httpx.get(server.url + "/version").status_code == 200  # open: probes need no key
        assert httpx.get(server.url + "/info").status_code == 401  # deny by default (tests/test_auth.py)
        r = httpx.post(server.url + "/generate", json={"inputs": "x"}, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
        assert httpx.get(server.url + "/stats", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/metrics").status_code == 200
    finally:
        server.stop()


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m and m.group(1) == name and all(f'{k}="{v}"' in (m.group(2) or "") for k, v in labels.items()):
            total += float(m.group(3))
    return total


def test_metrics_move(gw_server, gw_worker):
    before = httpx.get(gw_server.url + "/metrics").text
    assert 'model_name="SmolLM2-135M-Instruct"' in before
    httpx.post(gw_server.url + "/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 4}})
    httpx.post(gw_server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 100})
    httpx.post(gw_server.url + "/generate", json={"inputs": ""})
    after = httpx.get(gw_server.url + "/metrics").text
    n = len(gw_worker.reply_ids)
    assert metric(after, "baton:generation_tokens_total") - metric(before, "baton:generation_tokens_total") == 4 + n
    assert metric(after, "baton:prompt_tokens_total") > metric(before, "baton:prompt_tokens_total")
    for reason in ("length", "stop"):
        assert (metric(after, "baton:request_success_total", finished_reason=reason)
                - metric(before, "baton:request_success_total", finished_reason=reason)) == 1
    assert (metric(after, "baton:request_rejections_total", reason="validation")
            - metric(before, "baton:request_rejections_total", reason="validation")) == 1
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert metric(after, f"baton:{hist}_count") > metric(before, f"baton:{hist}_count"), hist
    for gauge in ("num_requests_running", "num_requests_waiting", "token_budget_in_use", "token_budget_total"):
        assert f"baton:{gauge}{{" in after, gauge
