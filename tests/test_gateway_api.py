"""End-to-end: real uvicorn + real Redis + real clients (openai, huggingface_hub, httpx) against
the gateway, with the echo worker standing in for the prefill/decode workers."""

from __future__ import annotations

import json

import httpx
from tests.test_gateway_support import DEFAULT_REPLY, wait_until

MODEL = "SmolLM2-135M-Instruct"  # the default model directory's name: the served name



def sse_events(text: str) -> list[str]:
    return [line[len("data:"):].strip() for line in text.split("\n") if line.startswith("data:")]


def budget_in_use(base_url: str) -> int:
    return httpx.get(base_url + "/stats", timeout=5).json()["token_budget"]["in_use"]


def test_tgi_generate_plain_and_details(gw_server, gw_worker):
    r = httpx.post(gw_server.url + "/generate", json={"inputs": "Say hello", "parameters": {"max_new_tokens": 64}})
    assert r.status_code == 200, r.text
    assert r.json() == {"generated_text": DEFAULT_REPLY}
    r = httpx.post(gw_server.url + "/generate",
                   json={"inputs": "Say hello", "parameters": {"max_new_tokens": 5, "details": True}})
    body = r.json()
    assert body["details"]["finish_reason"] == "length"
    assert body["details"]["generated_tokens"] == 5
    assert len(body["details"]["tokens"]) == 5
    assert DEFAULT_REPLY.startswith(body["generated_text"])
    # greedy by default (TGI's do_sample=false): temperature 0 reaches the worker
    assert gw_worker.requests[-1].sampling.temperature == 0.0
    assert gw_worker.requests[-1].sampling.max_tokens == 5
    assert wait_until(lambda: budget_in_use(gw_server.url) == 0)


def test_tgi_stream_events_wire_format(gw_server, gw_worker):
    r = httpx.post(gw_server.url + "/generate_stream",
                   json={"inputs": "hi", "parameters": {"max_new_tokens": 100, "details": True,
                                                        "do_sample": True, "seed": 7}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(e) for e in sse_events(r.text)]
    assert all(set(e) == {"index", "token", "generated_text", "details"} for e in events)
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["generated_text"] == DEFAULT_REPLY
    assert last["details"] == {"finish_reason": "eos_token", "generated_tokens": len(gw_worker.reply_ids),
                               "seed": 7, "input_length": last["details"]["input_length"]}
    assert last["token"]["special"] is True  # the EOS token
    assert "".join(e["token"]["text"] for e in events) == DEFAULT_REPLY
    assert gw_worker.requests[-1].sampling.seed == 7


def test_huggingface_hub_inference_client(gw_server, gw_worker, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    from huggingface_hub import InferenceClient

    client = InferenceClient(model=gw_server.url)
    stream = client.text_generation("Hi there", max_new_tokens=50, stream=True, details=True)
    outputs = list(stream)
    assert outputs[-1].generated_text == DEFAULT_REPLY
    assert outputs[-1].details.finish_reason == "eos_token"
    assert "".join(o.token.text for o in outputs) == DEFAULT_REPLY
    text = client.text_generation("Hi there", max_new_tokens=50)
    assert text == DEFAULT_REPLY
    out = client.text_generation("Hi there", max_new_tokens=3, details=True)
    assert out.details.finish_reason == "length" and out.details.generated_tokens == 3


def test_openai_completions_and_chat(gw_server, gw_worker, gw_tokenizer):
    import openai

    client = openai.OpenAI(base_url=gw_server.url + "/v1", api_key="unused", max_retries=0)
    c = client.completions.create(model=MODEL, prompt="Say hello", max_tokens=64)
    assert c.choices[0].text == DEFAULT_REPLY
    assert c.choices[0].finish_reason == "stop"
    assert c.usage.completion_tokens == len(gw_worker.reply_ids)
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert gw_worker.requests[-1].sampling.temperature == 1.0  # OpenAI default: sampling

    c = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=4, temperature=0)
    assert c.choices[0].finish_reason == "length" and c.usage.prompt_tokens == 4
    assert gw_worker.requests[-1].prompt_token_ids == [1, 2, 3, 4]
    assert gw_worker.requests[-1].sampling.temperature == 0.0

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.content == DEFAULT_REPLY
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == "stop"
    prompt_ids = gw_worker.requests[-1].prompt_token_ids
    text = gw_tokenizer.hf.apply_chat_template([{"role": "user", "content": "Hi"}],
                                               add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>assistant" in text
    assert prompt_ids == gw_tokenizer.hf(text, add_special_tokens=False)["input_ids"]


def test_openai_streaming_with_usage(gw_server, gw_worker):
    import openai

    client = openai.OpenAI(base_url=gw_server.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True,
        stream_options={"include_usage": True}, max_completion_tokens=200))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == DEFAULT_REPLY
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(gw_worker.reply_ids)
    assert gw_worker.requests[-1].sampling.max_tokens == 200

    gw_worker.tokens_per_event = 3
    stream = client.completions.create(model=MODEL, prompt="Hi", stream=True, max_tokens=7)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == gw_worker.tok.decode(gw_worker.reply_ids[:7])
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_raw_openai_stream_ends_with_done(gw_server, gw_worker):
    r = httpx.post(gw_server.url + "/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 3})
    assert r.text.endswith("data: [DONE]\n\n")
    assert all(e == "[DONE]" or json.loads(e)["object"] == "text_completion" for e in sse_events(r.text))


def test_info_models_health_openapi(gw_server):
    info = httpx.get(gw_server.url + "/info").json()
    # the model's own context (SmolLM2: max_position_embeddings 8192), a prompt all of it but one token
    assert info["max_input_tokens"] == 8191 and info["max_total_tokens"] == 8192
    assert info["model_id"] == "SmolLM2-135M-Instruct"
    models = httpx.get(gw_server.url + "/v1/models").json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
    health = httpx.get(gw_server.url + "/health")
    assert health.status_code == 200 and health.json()["redis"] == "ok"
    spec = httpx.get(gw_server.url + "/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    for path in ["/generate", "/generate_stream", "/", "/v1/completions", "/v1/chat/completions",
                 "/v1/models", "/info", "/health", "/stats", "/metrics", "/openapi.json", "/tokenize",
                 "/detokenize", "/version"]:
        assert path in spec["paths"], path
    for path, methods in spec["paths"].items():  # every documented operation exists
        for method in methods:
            r = httpx.request(method.upper(), gw_server.url + path, json={"inputs": ""} if method == "post" else None)
            assert r.status_code not in (404, 405), (method, path)
    r = httpx.get(gw_server.url + "/nope")
    assert r.status_code == 404 and "error" in r.json()
