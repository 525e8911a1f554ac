"""Fuzzing the APIs added after the first five (Responses, Anthropic Messages, embeddings, TEI's
/embed) the way tests/test_fuzz.py fuzzes those: valid bodies succeed; one to three fields
replaced by odd values, random JSON and raw bytes are answered with no 5xx, and every 4xx is a
JSON error in that API's own shape (OpenAI's for Responses and embeddings, Anthropic's for
Messages, TEI's for /embed). Real app on uvicorn, the echo worker over real Redis (it answers an
embedding request with a vector of the model's hidden size).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import strategies as st

from tests.test_fuzz import (SAFE_TEXT, STOP_LIST, TOKEN_IDS, UNKNOWN, _short_run, bodies, echo_gateway,
                             post_at_the_limits, run_fuzz, run_schema_bodies)

SERVED = "SmolLM2-135M-Instruct"  # the default model directory's name: what Messages' `model` must say
ENDPOINTS = ["/v1/responses", "/v1/messages", "/v1/embeddings", "/embed"]


@pytest.fixture(scope="module")
def gateway(default_model_dir, redis_url):
    with echo_gateway(default_model_dir, redis_url, 11) as client:
        yield client


# ---- valid bodies, and where a value can be put in one ----

_TEXT_PART = st.fixed_dictionaries({"type": st.just("input_text"), "text": SAFE_TEXT})
_RESPONSES_ITEM = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer"]),
                                         "content": st.one_of(SAFE_TEXT, st.lists(_TEXT_PART, min_size=1, max_size=2))})
_BLOCK = st.fixed_dictionaries({"type": st.just("text"), "text": SAFE_TEXT})


def valid_bodies(endpoint: str) -> st.SearchStrategy[dict[str, Any]]:
    if endpoint == "/v1/responses":
        return st.fixed_dictionaries(
            {"input": st.one_of(SAFE_TEXT, st.lists(_RESPONSES_ITEM, min_size=1, max_size=3)),
             "max_output_tokens": st.integers(1, 8)},
            optional={"instructions": SAFE_TEXT, "temperature": st.floats(0.0, 2.0), "top_p": st.floats(0.05, 1.0),
                      "stream": st.booleans(), "store": st.booleans(), "user": SAFE_TEXT, "model": st.just(SERVED),
                      "text": st.just({"format": {"type": "text"}}), "metadata": st.just({"k": "v"})})
    if endpoint == "/v1/messages":
        message = st.fixed_dictionaries({"role": st.just("user"),
                                         "content": st.one_of(SAFE_TEXT, st.lists(_BLOCK, min_size=1, max_size=2))})
        return st.fixed_dictionaries(
            {"model": st.just(SERVED), "max_tokens": st.integers(1, 8), "messages": st.lists(message, min_size=1,
                                                                                             max_size=2)},
            optional={"system": st.one_of(SAFE_TEXT, st.lists(_BLOCK, min_size=1, max_size=2)),
                      "stop_sequences": STOP_LIST, "temperature": st.floats(0.0, 1.0), "top_p": st.floats(0.05, 1.0),
                      "top_k": st.integers(1, 100), "stream": st.booleans(), "metadata": st.just({"user_id": "u"})})
    if endpoint == "/v1/embeddings":
        return st.fixed_dictionaries(
            {"input": st.one_of(SAFE_TEXT, st.lists(SAFE_TEXT, min_size=1, max_size=3), TOKEN_IDS)},
            optional={"encoding_format": st.sampled_from(["float", "base64"]), "dimensions": st.integers(1, 64),
                      "model": st.just(SERVED), "user": SAFE_TEXT})
    return st.fixed_dictionaries({"inputs": st.one_of(SAFE_TEXT, st.lists(SAFE_TEXT, min_size=1, max_size=3))},
                                 optional={"normalize": st.booleans(), "truncate": st.booleans()})


FIELDS = {
    "/v1/responses": ["input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "store",
                      "previous_response_id", "text", "tools", "tool_choice", "parallel_tool_calls", "metadata",
                      "reasoning", "include", "truncation", "model", "user", "stream_options"],
    "/v1/messages": ["model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k",
                     "stream", "tools", "tool_choice", "thinking", "metadata"],
    "/v1/embeddings": ["input", "model", "encoding_format", "dimensions", "user", "truncate_prompt_tokens"],
    "/embed": ["inputs", "normalize", "truncate", "truncation_direction", "prompt_name"],
}
NESTED = {
    "/v1/responses": [("input", 0), ("input", 0, "role"), ("input", 0, "content"), ("input", 0, "content", 0, "type"),
                      ("input", 0, "content", 0, "text"), ("input", 0, "type"), ("text", "format"),
                      ("text", "format", "type"), ("text", "format", "schema"), ("tools", 0), ("tools", 0, "type")],
    "/v1/messages": [("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"),
                     ("messages", 0, "content", 0, "type"), ("messages", 0, "content", 0, "text"), ("system", 0),
                     ("tools", 0, "name"), ("tools", 0, "input_schema"), ("tool_choice", "type"),
                     ("thinking", "type"), ("thinking", "budget_tokens")],
    "/v1/embeddings": [("input", 0), ("input", 1)],
    "/embed": [("inputs", 0)],
}
BASE_BODIES = {
    "/v1/responses": {"input": "Hello", "max_output_tokens": 3, "store": False},
    "/v1/messages": {"model": SERVED, "max_tokens": 3, "messages": [{"role": "user", "content": "Hello"}]},
    "/v1/embeddings": {"input": "Hello"},
    "/embed": {"inputs": "Hello"},
}


def _paths(endpoint: str) -> list[tuple[Any, ...]]:
    return [(k,) for k in FIELDS[endpoint] + UNKNOWN] + NESTED[endpoint]


# ---- the checks, each API in its own shape ----

def _error_message(endpoint: str, data: Any, where: str) -> Any:
    if endpoint == "/v1/messages":
        assert data["type"] == "error" and isinstance(data["error"]["type"], str), where
        return data["error"]["message"]
    if endpoint == "/embed":
        assert isinstance(data["error_type"], str), where
        return data["error"]
    assert isinstance(data["error"]["type"], str), where
    return data["error"]["message"]


def _sse_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[5:]) for line in text.split("\n") if line.startswith("data:") and line[5:].strip()
            != "[DONE]"]


def check_response(endpoint: str, kind: str, body: bytes, r: httpx.Response) -> None:
    where = f"{endpoint} {kind}: body {body[:200]!r}... -> {r.status_code} {r.text[:300]!r}"
    assert r.status_code < 500, where
    if r.status_code >= 400:
        assert r.headers.get("content-type", "").startswith("application/json"), where
        message = _error_message(endpoint, r.json(), where)
        assert isinstance(message, str) and message.strip(), where
        assert kind != "valid", where
        return
    assert r.status_code == 200, where
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = _sse_events(r.text)
        assert events, where
        kinds = [e.get("type") for e in events]
        if endpoint == "/v1/messages":
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "error" not in kinds, where
        else:
            assert kinds[0] == "response.created", where
            assert kinds[-1] in ("response.completed", "response.incomplete"), where
            assert "error" not in kinds and "response.failed" not in kinds, where
        return
    data = r.json()
    if endpoint == "/embed":
        assert isinstance(data, list) and data and all(isinstance(v, list) and v for v in data), where
    elif endpoint == "/v1/embeddings":
        assert data["object"] == "list" and data["data"], where
    elif endpoint == "/v1/messages":
        assert data["type"] == "message" and data["stop_reason"], where
    else:
        assert data["object"] == "response" and data["status"] in ("completed", "incomplete"), where


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_fuzz_endpoint(gateway: httpx.Client, endpoint: str) -> None:
    run_fuzz(gateway, endpoint, bodies(valid_bodies(endpoint), _paths(endpoint)), check_response)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_field_at_the_limits(gateway: httpx.Client, endpoint: str) -> None:
    post_at_the_limits(gateway, endpoint, BASE_BODIES[endpoint], _paths(endpoint), check_response)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_wrong_method_and_content_type(gateway: httpx.Client, endpoint: str) -> None:
    for r in (gateway.put(endpoint), gateway.post(endpoint, data={"input": "x"}),
              gateway.post(endpoint, content=b"input=x", headers={"content-type": "text/plain"})):
        assert 400 <= r.status_code < 500, (endpoint, r.status_code, r.text)
        assert _error_message(endpoint, r.json(), r.text), r.text


def _reachable_short_run(body: dict[str, Any]) -> None:
    _short_run(body)
    if "messages" in body and "max_tokens" in body:  # Messages: any other model name is a 404
        body["model"] = SERVED


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_bodies_from_the_openapi_schema(gateway: httpx.Client, endpoint: str) -> None:
    """Whatever /openapi.json documents for the endpoint is answered without a 5xx."""
    run_schema_bodies(gateway, endpoint, check_response, _reachable_short_run)
