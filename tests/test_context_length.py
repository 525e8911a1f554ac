"""The context comes from the model (its config.json, RoPE scaling included), `--max-model-len` lowers
it, and a request past it gets each API's own "context too long" answer: OpenAI's
`context_length_exceeded` code and sentence (what the openai, LangChain and LiteLLM clients match),
Anthropic's and TGI's wording on their routes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from baton.common.context_length import context_length_of, model_context_length
from gateway.config import FALLBACK_CONTEXT, Settings
from tests.test_gateway_support import start_gateway


@pytest.mark.parametrize("config,expected", [
    ({"max_position_embeddings": 8192}, 8192),
    ({"text_config": {"max_position_embeddings": 262144}, "vision_config": {}}, 262144),  # a VLM checkpoint
    ({"max_position_embeddings": 40960, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 32768}}, 131072),
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}}, 8192),
    # transformers 5's rope_parameters: default rope changes nothing
    ({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, 4096),
    # llama3 and longrope configs state the stretched length already
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 131072),
    ({"n_positions": 1024, "max_position_embeddings": 2048}, 1024),  # the smallest declared length wins
    ({"hidden_size": 64}, None),
])
def test_the_context_a_config_declares(config, expected):
    assert context_length_of(config) == expected


def _model_dir(tmp_path: Path, default_model_dir: Path, **config_changes) -> Path:
    """The default model's files with its config.json changed."""
    out = tmp_path / "model"
    out.mkdir()
    for f in default_model_dir.iterdir():
        if f.is_file() and f.name != "config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((default_model_dir / "config.json").read_text())
    config.update(config_changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_settings_take_the_models_context_and_refuse_a_longer_one(tmp_path, default_model_dir):
    model = _model_dir(tmp_path, default_model_dir, max_position_embeddings=32768)
    assert model_context_length(model) == 32768
    s = Settings(model_dir=model)
    s.validate()
    assert (s.max_total_tokens, s.max_model_len, s.max_input_tokens) == (32768, 32768, 32767)
    lower = Settings(model_dir=model, max_model_len=4096)
    lower.validate()
    assert (lower.max_total_tokens, lower.max_input_tokens) == (4096, 4095)
    with pytest.raises(ValueError, match="longer than the model's context .32768 tokens"):
        Settings(model_dir=model, max_model_len=65536).validate()
    with pytest.raises(ValueError, match="same limit"):
        Settings(model_dir=model, max_model_len=4096, max_total_tokens=2048).validate()
    Settings(model_dir=model, max_model_len=4096, max_total_tokens=4096).validate()  # the same value twice is fine
    bare = tmp_path / "bare"
    shutil.copytree(model, bare, symlinks=True, ignore=shutil.ignore_patterns("config.json"))
    assert Settings(model_dir=bare).max_total_tokens == FALLBACK_CONTEXT  # a config declaring none


@pytest.fixture(scope="module")
def short_gateway(default_model_dir, gw_redis_url, gw_tokenizer):
    server = start_gateway(default_model_dir, gw_redis_url, gw_tokenizer, max_model_len=64)
    yield server
    server.stop()


LONG_CHAT = [{"role": "user", "content": "tell me about rivers " * 30}]  # ~120 tokens > 63


def test_openai_answers_context_length_exceeded(short_gateway):
    r = httpx.post(short_gateway.url + "/v1/chat/completions",
                   json={"model": "SmolLM2-135M-Instruct", "messages": LONG_CHAT})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert error["type"] == "invalid_request_error"
    assert "maximum context length is 64 tokens" in error["message"]
    r = httpx.post(short_gateway.url + "/v1/completions",
                   json={"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 100})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert "maximum context length is 64 tokens. However, you requested 101 tokens (1 in the prompt, 100 in the " \
           "completion)" in error["message"]
    # the SDK's own error carries the code a client branches on
    client = openai.OpenAI(base_url=short_gateway.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=LONG_CHAT)
    assert caught.value.code == "context_length_exceeded"
    # a prompt of token ids past the context, refused before tokenizing anything
    r = httpx.post(short_gateway.url + "/v1/completions",
                   json={"model": "SmolLM2-135M-Instruct", "prompt": [5] * 100})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_anthropic_and_tgi_say_it_their_way(short_gateway):
    r = httpx.post(short_gateway.url + "/v1/messages",
                   json={"model": "SmolLM2-135M-Instruct", "max_tokens": 200,
                         "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "exceed context limit" in body["error"]["message"] and "> 64" in body["error"]["message"]
    r = httpx.post(short_gateway.url + "/v1/messages",
                   json={"model": "SmolLM2-135M-Instruct", "max_tokens": 1, "messages": LONG_CHAT})
    assert r.status_code == 400 and "prompt is too long" in r.json()["error"]["message"], r.text
    r = httpx.post(short_gateway.url + "/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 100}})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert "`inputs` tokens + `max_new_tokens` must be <= 64" in r.json()["error"]
    info = httpx.get(short_gateway.url + "/info").json()
    assert (info["max_total_tokens"], info["max_input_tokens"]) == (64, 63)
    assert httpx.get(short_gateway.url + "/v1/models").json()["data"][0]["max_model_len"] == 64
