"""Fuzzing the generation endpoints over real HTTP: whatever a client sends, the gateway answers
with no 5xx, and every 4xx is a JSON error body with a message in the API's error shape.

Bodies come from hypothesis: random JSON values of every type, valid requests with one field
replaced by anything (wrong types, huge and negative numbers, NaN, weird unicode, lone surrogates),
unknown fields, thousands of stop strings, deep nesting, invalid UTF-8 and other raw bytes. Valid
requests (small max_tokens) must succeed. The gateway is the real app on uvicorn; the workers are
the echo worker of test_gateway_support (the exact worker protocol over real Redis), so the run is
quick. The budget is fixed and the run deterministic (derandomize): ~150 examples per endpoint.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_gateway_support import EchoWorker, private_db, start_gateway

VOCAB = 49152
# The served name (the default model directory's), huggingface_hub's placeholder, and "" (vLLM: the
# default): any other `model` is a 404, which a valid body must not get.
MODELS = st.sampled_from(["SmolLM2-135M-Instruct", "dummy", ""])
ENDPOINTS = ["/generate", "/generate_stream", "/", "/v1/completions", "/v1/chat/completions"]
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])


# ---- the system under test ----

@contextlib.contextmanager
def echo_gateway(default_model_dir: Path, redis_url: str, db: int) -> Iterator[httpx.Client]:
    """The real gateway on uvicorn over its own Redis database, the echo worker behind it."""
    from gateway.tokenizer import PromptTokenizer

    url = private_db(redis_url, db)  # our own database: no other test's workers read our streams
    tokenizer = PromptTokenizer(default_model_dir)
    worker = EchoWorker(url, tokenizer.hf).start()
    server = start_gateway(default_model_dir, url, tokenizer, max_queue_wait=5.0)
    client = httpx.Client(base_url=server.url, timeout=30)
    try:
        yield client
    finally:
        client.close()
        server.stop()
        worker.stop()


@pytest.fixture(scope="module")
def gateway(default_model_dir, redis_url):
    with echo_gateway(default_model_dir, redis_url, 12) as client:
        yield client


# ---- strategies ----

HUGE_NUMBERS = st.sampled_from([10**400, -(10**400), 2**64, 2**64 - 1, 2**63, -(2**63) - 1, 2**53 + 1, 10**30,
                                -1, 0, 1e308, -1e308, 5e-324, 1e-300, -0.0, math.inf, -math.inf, math.nan,
                                1.5, 0.5, 16.0, 2.0000000001])
WEIRD_TEXT = st.one_of(
    st.text(max_size=40),  # any code point but surrogates
    st.text(st.characters(categories=["Cs", "Co", "Cn", "Cc", "Zs", "Mn"]), max_size=12),  # incl. lone surrogates
    st.sampled_from(["", " ", "\x00", "\u202e", "\ufeff", "😀" * 30, "é" * 200, "\\ud800", "<|im_end|>",
                     "<|im_start|>assistant", "{{ raise_exception('x') }}", "\n" * 50, "a" * 5000]),
)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), HUGE_NUMBERS,
                    st.floats(allow_nan=True, allow_infinity=True), WEIRD_TEXT)
JSON_VALUES = st.recursive(SCALARS, lambda children: st.one_of(
    st.lists(children, max_size=5), st.dictionaries(WEIRD_TEXT, children, max_size=5)), max_leaves=20)
MANY_STOPS = st.integers(17, 5000).map(lambda n: [f"stop{i}" for i in range(n)])
NESTED = st.integers(2, 900).map(lambda d: json.loads("[" * d + "]" * d))  # (json.dumps recurses: < 1000)

SAFE_TEXT = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=80)
STOP_LIST = st.lists(st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=20), max_size=4)
TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)


def _tgi_valid(compat: bool) -> st.SearchStrategy[dict[str, Any]]:
    params = st.fixed_dictionaries({"max_new_tokens": st.integers(1, 8)}, optional={
        "do_sample": st.booleans(), "temperature": st.floats(0.05, 2.0), "top_p": st.floats(0.05, 1.0),
        "top_k": st.integers(1, 100), "seed": st.integers(0, 2**64 - 1), "stop": STOP_LIST,
        "details": st.booleans(), "return_full_text": st.booleans(), "truncate": st.integers(1, 3000),
        "repetition_penalty": st.floats(0.5, 2.0), "decoder_input_details": st.just(False),
        "best_of": st.just(1), "watermark": st.just(False), "top_n_tokens": st.just(0),
    })
    optional = {"add_special_tokens": st.booleans()}
    if compat:
        optional["stream"] = st.booleans()
    return st.fixed_dictionaries({"inputs": SAFE_TEXT, "parameters": params}, optional=optional)


def _openai_common() -> dict[str, st.SearchStrategy[Any]]:
    return {"temperature": st.floats(0.0, 2.0), "top_p": st.floats(0.05, 1.0), "top_k": st.integers(-1, 100),
            "seed": st.integers(-(2**63), 2**64 - 1), "stop": st.one_of(SAFE_TEXT.filter(lambda s: len(s) <= 128),
                                                                        STOP_LIST),
            "ignore_eos": st.booleans(), "n": st.just(1), "user": SAFE_TEXT, "model": MODELS,
            "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=4), "repetition_penalty":
            st.floats(0.5, 2.0), "presence_penalty": st.floats(-2.0, 2.0), "frequency_penalty": st.floats(-2.0, 2.0),
            "min_p": st.floats(0.0, 1.0), "stream": st.booleans(),
            "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100.0, 100.0), max_size=5)}


def _with_stream_options(body: dict[str, Any], include: bool | None) -> dict[str, Any]:
    if body.get("stream") and include is not None:
        body = {**body, "stream_options": {"include_usage": include}}
    return body


def _openai_valid(chat: bool) -> st.SearchStrategy[dict[str, Any]]:
    if chat:
        content = st.one_of(st.none(), SAFE_TEXT, st.lists(
            st.fixed_dictionaries({"type": st.just("text"), "text": SAFE_TEXT}), max_size=3))
        message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
                                         "content": content})
        required = {"messages": st.lists(message, min_size=1, max_size=4)}
    else:
        required = {"prompt": st.one_of(SAFE_TEXT, TOKEN_IDS, SAFE_TEXT.map(lambda s: [s]))}
    tokens = st.sampled_from(["max_tokens", "max_completion_tokens"])
    body = st.builds(lambda base, key, n: {**base, key: n},
                     st.fixed_dictionaries(required, optional=_openai_common()), tokens, st.integers(1, 8))
    return st.builds(_with_stream_options, body, st.one_of(st.none(), st.booleans()))


def valid_bodies(endpoint: str) -> st.SearchStrategy[dict[str, Any]]:
    if endpoint.startswith("/v1/"):
        return _openai_valid(chat=endpoint.endswith("chat/completions"))
    return _tgi_valid(compat=endpoint == "/")


TGI_TOP = ["inputs", "parameters", "stream", "add_special_tokens"]
TGI_PARAMETERS = ["max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "seed", "stop", "truncate",
                  "details", "return_full_text", "repetition_penalty", "decoder_input_details", "best_of",
                  "typical_p", "grammar", "watermark", "top_n_tokens", "adapter_id", "frequency_penalty"]
OPENAI_COMMON = ["model", "max_tokens", "max_completion_tokens", "stream", "stream_options", "stop", "temperature",
                 "top_p", "seed", "n", "presence_penalty", "frequency_penalty", "logit_bias", "user", "logprobs",
                 "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
                 "response_format", "guided_json", "structured_outputs", "prompt_logprobs", "use_beam_search"]
COMPLETION_ONLY = ["prompt", "echo", "suffix", "best_of", "add_special_tokens"]
CHAT_ONLY = ["messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "functions",
             "function_call", "store", "metadata", "service_tier", "echo"]
UNKNOWN = ["unknown_field", "", "\u0000", "😀", "inputs ", "PROMPT", "parameters.max_new_tokens"]

# Odd values, weighted towards what breaks validators: numbers at and past every limit, wrong types.
BIG_INTS = st.sampled_from([10**400, -(10**400), 2**64, -(2**63) - 1, 10**20])  # past float / int64 / uint64
ODD_VALUES = st.one_of(BIG_INTS, HUGE_NUMBERS, HUGE_NUMBERS, SCALARS, JSON_VALUES, MANY_STOPS, NESTED,
                       st.lists(WEIRD_TEXT, max_size=20), st.lists(HUGE_NUMBERS, max_size=3),
                       st.dictionaries(WEIRD_TEXT, SCALARS, max_size=3))


def _paths(endpoint: str) -> list[tuple[str, ...]]:
    """Where a value can be put in a body of this endpoint: (field,), (parameters, field), ..."""
    if not endpoint.startswith("/v1/"):
        return [(k,) for k in TGI_TOP + UNKNOWN] + [("parameters", k) for k in TGI_PARAMETERS + UNKNOWN]
    if endpoint.endswith("chat/completions"):
        message = [("messages", 0, k) for k in ("role", "content", "name", "tool_calls")]
        parts = [("messages", 0, "content", 0, k) for k in ("type", "text")]
        return [(k,) for k in OPENAI_COMMON + CHAT_ONLY + UNKNOWN] + message + parts + [
            ("messages", 0), ("stream_options", "include_usage"), ("stream_options", "x"),
            ("logit_bias", "5"), ("logit_bias", "x")]
    return [(k,) for k in OPENAI_COMMON + COMPLETION_ONLY + UNKNOWN] + [
        ("prompt", 0), ("stream_options", "include_usage"), ("stream_options", "continuous_usage_stats"),
        ("stream_options", "x"), ("logit_bias", "5"), ("logit_bias", "x")]


def _put(body: dict[str, Any], path: tuple[Any, ...], value: Any, delete: bool) -> dict[str, Any]:
    """`body` with `value` at `path` (made where missing), or that field removed."""
    body = json.loads(json.dumps(body))  # a deep copy
    node: Any = body
    for i, key in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(node, dict):
            if not isinstance(node.get(key), (dict, list)):
                node[key] = [] if isinstance(nxt, int) else {}
            node = node[key]
        elif isinstance(node, list):
            while len(node) <= key:
                node.append([] if isinstance(nxt, int) else {})
            if not isinstance(node[key], (dict, list)):
                node[key] = [] if isinstance(nxt, int) else {}
            node = node[key]
    last = path[-1]
    if isinstance(node, dict):
        if delete:
            node.pop(last, None)
        else:
            node[last] = value
    elif isinstance(node, list) and isinstance(last, int):
        if delete:
            if last < len(node):
                node.pop(last)
        else:
            while len(node) <= last:
                node.append(None)
            node[last] = value
    return body


def mutated_bodies(valid: st.SearchStrategy[dict[str, Any]],
                   paths: list[tuple[Any, ...]]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid body with one to three fields replaced by odd values (or removed)."""
    edit = st.tuples(st.sampled_from(paths), ODD_VALUES, st.sampled_from([False, False, False, True]))

    def apply(body: dict[str, Any], edits: list[tuple[tuple[Any, ...], Any, bool]]) -> dict[str, Any]:
        for path, value, delete in edits:
            body = _put(body, path, value, delete)
        return body

    return st.builds(apply, valid, st.lists(edit, min_size=1, max_size=3))


def _encode(value: Any, ascii_only: bool) -> bytes:
    # allow_nan: Python writes NaN/Infinity, which Python's json (and so the gateway) accepts.
    # surrogatepass: a lone surrogate becomes bytes that are not valid UTF-8.
    return json.dumps(value, ensure_ascii=ascii_only, allow_nan=True).encode("utf-8", "surrogatepass")


RAW_BODIES = st.one_of(
    st.binary(max_size=300),
    st.sampled_from([b"", b" ", b"null", b"[]", b"{}", b"\"x\"", b"1e999", b"NaN", b"{\"inputs\": ",
                     b"{\"inputs\": \"\xff\xfe\"}", b"{\"prompt\": \"\xc3\x28\"}", b"\xef\xbb\xbf{}",
                     b"{\"inputs\": \"a\", \"inputs\": 5}", b"{\"prompt\": \"\\ud800\"}",
                     b"{\"messages\": [{\"role\": \"user\", \"content\": \"\\udfff\"}]}",
                     b"{\"inputs\": \"" + b"a" * (1 << 20) + b"\"}"]),
    st.integers(2, 200_000).map(lambda d: b"[" * d + b"]" * d),
    st.integers(2, 200_000).map(lambda d: b'{"inputs": "x", "parameters": ' + b'{"a":' * d + b"1" + b"}" * d + b"}"),
    st.builds(lambda b, n: b[: n], st.builds(_encode, JSON_VALUES, st.booleans()), st.integers(0, 50)),
)


def bodies(valid: st.SearchStrategy[dict[str, Any]], paths: list[tuple[Any, ...]]) -> st.SearchStrategy[tuple[str, bytes]]:
    """(kind, body bytes): kind "valid" must succeed; anything else must fail cleanly (or succeed)."""
    mutated = st.builds(_encode, mutated_bodies(valid, paths), st.booleans())
    return st.one_of(
        st.tuples(st.just("valid"), st.builds(_encode, valid, st.booleans())),
        st.tuples(st.just("mutated"), mutated), st.tuples(st.just("mutated"), mutated),
        st.tuples(st.just("mutated"), mutated),
        st.tuples(st.just("json"), st.builds(_encode, JSON_VALUES, st.booleans())),
        st.tuples(st.just("raw"), RAW_BODIES),
    )


# ---- the checks ----

def check_response(endpoint: str, kind: str, body: bytes, r: httpx.Response) -> None:
    where = f"{endpoint} {kind}: body {body[:200]!r}... -> {r.status_code} {r.text[:300]!r}"
    assert r.status_code < 500, where
    if r.status_code >= 400:
        assert r.headers.get("content-type", "").startswith("application/json"), where
        data = r.json()
        if endpoint.startswith("/v1/"):
            message = data["error"]["message"]
            assert isinstance(data["error"]["type"], str), where
        else:
            message = data["error"]
            assert isinstance(data["error_type"], str), where
        assert isinstance(message, str) and message.strip(), where
        assert kind != "valid", where
        return
    assert r.status_code == 200, where
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[5:].strip() for line in r.text.split("\n") if line.startswith("data:")]
        assert events, where
        if endpoint.startswith("/v1/"):
            assert events[-1] == "[DONE]", where
            parsed = [json.loads(e) for e in events[:-1]]
            assert all("error" not in e for e in parsed), where
            assert any(c["choices"] and c["choices"][0].get("finish_reason") for c in parsed), where
        else:
            parsed = [json.loads(e) for e in events]
            assert all("error" not in e for e in parsed), where
            assert parsed[-1]["generated_text"] is not None, where
    else:
        data = r.json()
        assert "error" not in (data[0] if isinstance(data, list) else data), where


Check = Callable[[str, str, bytes, httpx.Response], None]


def run_fuzz(gateway: httpx.Client, endpoint: str, cases: st.SearchStrategy[tuple[str, bytes]], check: Check,
             config: settings = FUZZ) -> None:
    """Post every case; the fuzzer must reach both sides (successes and clean rejections)."""
    seen: dict[int, int] = {}

    @config
    @given(case=cases)
    def run(case: tuple[str, bytes]) -> None:
        kind, body = case
        r = gateway.post(endpoint, content=body, headers={"content-type": "application/json"})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        check(endpoint, kind, body, r)

    run()
    assert seen.get(200, 0) > 0 and any(400 <= s < 500 for s in seen), seen
    assert gateway.get("/health").status_code == 200  # and the gateway is still fine


def post_at_the_limits(gateway: httpx.Client, endpoint: str, base: dict[str, Any], paths: list[tuple[Any, ...]],
                       check: Check) -> None:
    """Every field, set to each value that has broken a validator somewhere."""
    for path in paths:
        for value in LIMIT_VALUES:
            body = _encode(_put(base, path, value, delete=False), ascii_only=True)
            r = gateway.post(endpoint, content=body, headers={"content-type": "application/json"})
            check(endpoint, f"{path}={str(value)[:40]!r}", body, r)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_fuzz_endpoint(gateway: httpx.Client, endpoint: str) -> None:
    run_fuzz(gateway, endpoint, bodies(valid_bodies(endpoint), _paths(endpoint)), check_response)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_wrong_method_and_content_type(gateway: httpx.Client, endpoint: str) -> None:
    """Not the body: the rest of the request is fuzzable too (method, content type, form data)."""
    for r in (gateway.get(endpoint) if endpoint != "/" else gateway.put(endpoint),
              gateway.post(endpoint, data={"inputs": "x"}),
              gateway.post(endpoint, content=b"inputs=x", headers={"content-type": "text/plain"})):
        assert 400 <= r.status_code < 500, (endpoint, r.status_code, r.text)
        assert r.json()["error"], r.text


# Every field of every endpoint, set to each value that has broken a validator somewhere: the
# exhaustive complement of the random search above (a few thousand requests, a few seconds).
LIMIT_VALUES = [10**400, -(10**400), 2**64, 2**63, -(2**63) - 1, 2**31, 1e308, -1e308, -1, 0, 0.5, True, None, "",
                "x" * 200, [], {}, [None], [10**400], {"a": {}}, "\ud800", json.loads("[" * 500 + "]" * 500)]
BASE_BODIES = {
    "/generate": {"inputs": "Hello", "parameters": {"max_new_tokens": 3}},
    "/generate_stream": {"inputs": "Hello", "parameters": {"max_new_tokens": 3}},
    "/": {"inputs": "Hello", "parameters": {"max_new_tokens": 3}, "stream": False},
    "/v1/completions": {"prompt": "Hello", "max_tokens": 3},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3},
}


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_field_at_the_limits(gateway: httpx.Client, endpoint: str) -> None:
    post_at_the_limits(gateway, endpoint, BASE_BODIES[endpoint], _paths(endpoint), check_response)


# ---- OpenAPI-driven: bodies generated from the request schemas /openapi.json documents ----
# A small JSON-Schema -> hypothesis translation, for the subset the hand-written document uses
# ($ref, allOf, oneOf, enum, type lists, bounds, lengths, required, additionalProperties).

def from_schema(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy[Any]:
    if "$ref" in schema:
        node: Any = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        return from_schema(node, root)
    if "allOf" in schema:
        merged: dict[str, Any] = {"type": "object", "properties": {}, "required": []}
        for sub in schema["allOf"]:
            while "$ref" in sub:
                node = root
                for part in sub["$ref"].lstrip("#/").split("/"):
                    node = node[part]
                sub = node
            merged["properties"].update(sub.get("properties", {}))
            merged["required"] += sub.get("required", [])
        return from_schema(merged, root)
    if "oneOf" in schema:
        return st.one_of([from_schema(sub, root) for sub in schema["oneOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, root) for k in kind])
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return st.integers(min_value=schema.get("minimum"), max_value=schema.get("maximum"))
    if kind == "number":
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        return st.floats(min_value=lo, max_value=schema.get("maximum"), allow_nan=False, allow_infinity=False,
                         exclude_min="exclusiveMinimum" in schema)
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=60)
    if kind == "array":
        items = from_schema(schema.get("items", {}), root) if schema.get("items") else JSON_VALUES
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 6), 6))
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: from_schema(v, root) for k, v in props.items() if k in required},
            optional={k: from_schema(v, root) for k, v in props.items() if k not in required})
    return JSON_VALUES


def run_schema_bodies(gateway: httpx.Client, endpoint: str, check: Check,
                      prepare: Callable[[dict[str, Any]], None]) -> None:
    """Bodies from the endpoint's documented schema (after `prepare` keeps them short and reachable)
    are answered without a 5xx, and some succeed."""
    spec = gateway.get("/openapi.json").json()
    schema = spec["paths"][endpoint]["post"]["requestBody"]["content"]["application/json"]["schema"]
    seen: dict[int, int] = {}

    @settings(FUZZ, max_examples=60)
    @given(body=from_schema(schema, spec), ascii_only=st.booleans())
    def run(body: dict[str, Any], ascii_only: bool) -> None:
        prepare(body)
        raw = _encode(body, ascii_only)
        r = gateway.post(endpoint, content=raw, headers={"content-type": "application/json"})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        check(endpoint, "schema", raw, r)

    run()
    assert seen.get(200, 0) > 0, seen


def _short_run(body: dict[str, Any]) -> None:
    # Keep the run short (the schema sets no maximum), and keep the prompt real text.
    if isinstance(body.get("parameters"), dict) and "max_new_tokens" in body["parameters"]:
        body["parameters"]["max_new_tokens"] = min(body["parameters"]["max_new_tokens"], 8)
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(body.get(key), int):
            body[key] = min(body[key], 8)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_bodies_from_the_openapi_schema(gateway: httpx.Client, endpoint: str) -> None:
    """Whatever the documented schema allows is answered without a 5xx (and 4xx are clean)."""
    run_schema_bodies(gateway, endpoint, check_response, _short_run)
