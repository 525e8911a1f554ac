"""The model's generation_config.json sampling defaults (vLLM's `--generation-config auto|vllm`).

Unit tests of the reader and the filler (gateway.sampling_defaults), then the real gateway app on the
in-memory backend: what SamplingParams reach the workers when a request on each generation route
leaves the sampling fields unset or sets some of them, what /info reports, the start-up line, and
that `baton serve` / `python -m gateway` take the flag and refuse a file no request could follow.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from baton.common.finish_reason import FinishReason
from baton.common.protocol import PrefillRequest, TokenEvent
from baton.common.sampling_params import SamplingParams
from gateway.sampling_defaults import SamplingDefaults, load, read_generation_config

# Qwen3's generation_config.json, plus min_p and repetition_penalty so that every key is exercised.
QWEN3_LIKE = {"bos_token_id": 1, "do_sample": True, "eos_token_id": [2], "pad_token_id": 2,
              "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1,
              "transformers_version": "4.51.0"}
MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
SERVED = "qwen-like"


def write_config(model_dir: Path, config: Any) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "generation_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return model_dir


# ------------------------------------------------------------------ the reader and the filler


def test_the_models_sampling_keys_become_the_defaults(tmp_path: Path) -> None:
    defaults = read_generation_config(write_config(tmp_path, QWEN3_LIKE))
    assert defaults.as_dict() == MODEL_DEFAULTS  # eos, do_sample and the rest are not sampling defaults
    assert defaults.describe() == "temperature=0.6 top_p=0.95 top_k=20 min_p=0.05 repetition_penalty=1.1"


def test_do_sample_false_is_ignored_as_vllm_ignores_it(tmp_path: Path) -> None:
    defaults = read_generation_config(write_config(tmp_path, {"do_sample": False, "temperature": 0.7, "top_p": None}))
    assert defaults.as_dict() == {"temperature": 0.7}  # a null is no default either


def test_a_requests_own_values_win_field_by_field() -> None:
    defaults = SamplingDefaults(**MODEL_DEFAULTS)
    # Nothing set: every one is the model's.
    assert defaults.fill() == MODEL_DEFAULTS
    # A request's temperature 1.0 is its own choice, not "unset": it wins over the model's 0.6;
    # its top_k 0 means off, and wins over the model's 20; what it leaves unset stays the model's.
    filled = defaults.fill(temperature=1.0, top_k=0, top_p=None)
    assert filled == {**MODEL_DEFAULTS, "temperature": 1.0, "top_k": -1}
    # Without model defaults, the APIs' own neutral ones.
    assert SamplingDefaults().fill(top_p=0.5) == {"temperature": 1.0, "top_p": 0.5, "top_k": -1, "min_p": 0.0,
                                                  "repetition_penalty": 1.0}
    with pytest.raises(TypeError, match="seed"):
        defaults.fill(seed=1)


def test_vllm_mode_ignores_the_file_and_a_missing_file_sets_none(tmp_path: Path) -> None:
    model_dir = write_config(tmp_path / "m", QWEN3_LIKE)
    assert load(model_dir, "auto").as_dict() == MODEL_DEFAULTS
    assert load(model_dir, "vllm").as_dict() == {}
    assert load(tmp_path / "no-such-file-here", "auto").as_dict() == {}
    with pytest.raises(ValueError, match="--generation-config must be one of auto, vllm"):
        load(model_dir, "path/to/dir")


def test_top_k_zero_in_the_file_means_off(tmp_path: Path) -> None:
    defaults = read_generation_config(write_config(tmp_path, {"top_k": 0, "temperature": 0}))
    assert defaults.as_dict() == {"top_k": -1, "temperature": 0.0}  # temperature 0: greedy by default


@pytest.mark.parametrize("key, value", [
    ("top_p", 0), ("top_p", 1.5), ("temperature", -0.1), ("temperature", True), ("top_k", "20"),
    ("top_k", 2.5), ("top_k", -2), ("min_p", 2), ("repetition_penalty", 0),
])
def test_a_value_no_request_could_send_is_a_clear_error(tmp_path: Path, key: str, value: Any) -> None:
    model_dir = write_config(tmp_path, {**QWEN3_LIKE, key: value})
    with pytest.raises(ValueError) as err:
        read_generation_config(model_dir)
    message = str(err.value)
    assert f"`{key}`" in message and "generation_config.json" in message and "--generation-config vllm" in message


def test_a_malformed_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot read .*generation_config\.json.*--generation-config vllm"):
        read_generation_config(write_config(tmp_path / "a", '{"temperature": 0.6,'))
    with pytest.raises(ValueError, match="not a JSON object"):
        read_generation_config(write_config(tmp_path / "b", "[0.6]"))


# ------------------------------------------------------------------ through the gateway


@pytest.fixture
def qwen_like_dir(tmp_path: Path, default_model_dir: Path) -> Path:
    """The default model's files, with Qwen3's sampling defaults in its generation_config.json."""
    out = tmp_path / "qwen-like"
    out.mkdir()
    for entry in default_model_dir.iterdir():
        if entry.name != "generation_config.json":
            (out / entry.name).symlink_to(entry.resolve())
    return write_config(out, QWEN3_LIKE)


def _answer(reply_ids: list[int]) -> Any:
    def respond(req: PrefillRequest) -> Sequence[TokenEvent]:
        return [TokenEvent(req.request_id, 0, reply_ids[:2], [-0.5, -0.5], FinishReason.STOP,
                           num_prompt_tokens=len(req.prompt_token_ids))]
    return respond


class Gateway:
    def __init__(self, client: httpx.AsyncClient, backend: Any) -> None:
        self.client = client
        self.backend = backend

    async def sampling_sent(self, path: str, body: dict[str, Any]) -> SamplingParams:
        """What the request's (one) prefill carried to the workers."""
        before = len(self.backend.prefills)
        resp = await self.client.post(path, json=body)
        assert resp.status_code == 200, resp.text
        assert len(self.backend.prefills) == before + 1
        return self.backend.prefills[before].sampling


@contextlib.asynccontextmanager
async def running_gateway(model_dir: Path, gw_tokenizer: Any, **settings: Any) -> AsyncIterator[Gateway]:
    from gateway.app import create_app, in_memory_runtime
    from gateway.backend import InMemoryBackend
    from gateway.config import Settings

    reply = gw_tokenizer.encode_text("Hi there", add_special_tokens=False) + [gw_tokenizer.eos_token_id]
    backend = InMemoryBackend(_answer(reply))
    app = create_app(Settings(model_dir=model_dir, served_model_names=(SERVED,), max_batch_total_tokens=100_000,
                              event_timeout=10.0, responses_ttl=0, **settings),
                     tokenizer=gw_tokenizer, runtime=in_memory_runtime(backend))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            yield Gateway(client, backend)


def _warpers(sampling: SamplingParams) -> dict[str, float | int]:
    return {key: getattr(sampling, key) for key in MODEL_DEFAULTS}


CHAT = {"model": SERVED, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


async def test_requests_without_sampling_fields_sample_with_the_models_defaults(qwen_like_dir: Path,
                                                                                gw_tokenizer: Any) -> None:
    async with running_gateway(qwen_like_dir, gw_tokenizer) as gw:
        info = (await gw.client.get("/info")).json()
        assert info["sampling_defaults"] == MODEL_DEFAULTS and info["model_id"] == SERVED

        assert _warpers(await gw.sampling_sent("/v1/chat/completions", CHAT)) == MODEL_DEFAULTS
        completion = {"model": SERVED, "prompt": "Hi", "max_tokens": 4}
        assert _warpers(await gw.sampling_sent("/v1/completions", completion)) == MODEL_DEFAULTS
        messages = {"model": SERVED, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
        assert _warpers(await gw.sampling_sent("/v1/messages", messages)) == MODEL_DEFAULTS
        responses_body = {"model": SERVED, "input": "Hi", "max_output_tokens": 4, "store": False}
        assert _warpers(await gw.sampling_sent("/v1/responses", responses_body)) == MODEL_DEFAULTS
        answer = (await gw.client.post("/v1/responses", json=responses_body)).json()
        assert (answer["temperature"], answer["top_p"]) == (0.6, 0.95)  # the response says what applied


async def test_a_requests_own_values_override_the_models_field_by_field(qwen_like_dir: Path,
                                                                        gw_tokenizer: Any) -> None:
    async with running_gateway(qwen_like_dir, gw_tokenizer) as gw:
        # temperature 1.0 is asked for, not a default: it must win over the model's 0.6.
        sent = await gw.sampling_sent("/v1/chat/completions", {**CHAT, "temperature": 1.0, "top_k": 0})
        assert _warpers(sent) == {**MODEL_DEFAULTS, "temperature": 1.0, "top_k": -1}
        sent = await gw.sampling_sent("/v1/completions", {"model": SERVED, "prompt": "Hi", "max_tokens": 4,
                                                          "top_p": 0.5, "repetition_penalty": 1.0, "min_p": 0.0})
        assert _warpers(sent) == {**MODEL_DEFAULTS, "top_p": 0.5, "repetition_penalty": 1.0, "min_p": 0.0}
        # temperature 0 is greedy, whatever the model's warpers (the model's penalty still applies).
        sent = await gw.sampling_sent("/v1/chat/completions", {**CHAT, "temperature": 0})
        assert sent.greedy and _warpers(sent) == {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                                  "repetition_penalty": 1.1}
        sent = await gw.sampling_sent("/v1/messages", {"model": SERVED, "max_tokens": 4, "temperature": 0.2,
                                                       "messages": [{"role": "user", "content": "Hi"}]})
        assert _warpers(sent) == {**MODEL_DEFAULTS, "temperature": 0.2}


async def test_tgi_keeps_its_greedy_default_and_samples_with_the_models_warpers(qwen_like_dir: Path,
                                                                                gw_tokenizer: Any) -> None:
    async with running_gateway(qwen_like_dir, gw_tokenizer) as gw:
        greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.1}
        for path in ("/generate", "/"):
            # No do_sample and no warper: greedy, as TGI answers it (the model's penalty applies).
            sent = await gw.sampling_sent(path, {"inputs": "Hi", "parameters": {"max_new_tokens": 4}})
            assert sent.greedy and _warpers(sent) == greedy
        sent = await gw.sampling_sent("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 4,
                                                                                  "do_sample": False}})
        assert sent.greedy and _warpers(sent) == greedy
        # Sampled: the warpers it leaves unset are the model's.
        sent = await gw.sampling_sent("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 4,
                                                                                  "do_sample": True}})
        assert _warpers(sent) == MODEL_DEFAULTS
        sent = await gw.sampling_sent("/generate_stream", {"inputs": "Hi", "parameters": {"max_new_tokens": 4,
                                                                                         "top_k": 5}})
        assert _warpers(sent) == {**MODEL_DEFAULTS, "top_k": 5}


async def test_generation_config_vllm_ignores_the_models_defaults(qwen_like_dir: Path, gw_tokenizer: Any) -> None:
    neutral = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    async with running_gateway(qwen_like_dir, gw_tokenizer, generation_config="vllm") as gw:
        assert (await gw.client.get("/info")).json()["sampling_defaults"] == {}
        assert _warpers(await gw.sampling_sent("/v1/chat/completions", CHAT)) == neutral
        sent = await gw.sampling_sent("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 4,
                                                                                  "do_sample": True}})
        assert _warpers(sent) == neutral


def test_the_start_up_line_names_the_defaults_and_a_bad_file_stops_start_up(
        qwen_like_dir: Path, gw_tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    from gateway.app import create_app
    from gateway.config import Settings

    with caplog.at_level(logging.INFO, logger="gateway.sampling_defaults"):
        create_app(Settings(model_dir=qwen_like_dir, max_batch_total_tokens=100_000), tokenizer=gw_tokenizer)
    assert ("sampling defaults from generation_config.json: temperature=0.6 top_p=0.95 top_k=20 min_p=0.05 "
            "repetition_penalty=1.1") in caplog.text

    write_config(qwen_like_dir, {**QWEN3_LIKE, "top_p": 0})
    load.cache_clear()  # read once per directory: this one changed under the same path
    with pytest.raises(ValueError, match="`top_p` must be in"):
        create_app(Settings(model_dir=qwen_like_dir, max_batch_total_tokens=100_000), tokenizer=gw_tokenizer)
    # --generation-config vllm does not read it: the gateway starts.
    create_app(Settings(model_dir=qwen_like_dir, max_batch_total_tokens=100_000, generation_config="vllm"),
               tokenizer=gw_tokenizer)


# ------------------------------------------------------------------ the flags


def test_the_flag_reaches_the_gateway_from_baton_serve(qwen_like_dir: Path) -> None:
    from baton.cli.serve import ThreadPlan, add_serve_arguments, build_child_specs
    from gateway.__main__ import parse_args
    from tests.test_cli import child_config

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--generation-config", "vllm"])
    gateway = build_child_specs(args, qwen_like_dir, "redis://127.0.0.1:1/0", ThreadPlan([1], [1], cpus=2),
                                python="py")[-1]
    assert child_config(gateway).generation_config == "vllm"
    plain = build_child_specs(parser.parse_args([]), qwen_like_dir, "redis://x", ThreadPlan([1], [1], cpus=2),
                              python="py")[-1]
    assert child_config(plain).generation_config == "auto"  # the gateway's own default
    with pytest.raises(SystemExit):  # a typo fails in `baton serve`, before any worker loads the model
        parser.parse_args(["--generation-config", "hf"])

    assert parse_args(["--model", str(qwen_like_dir), "--generation-config", "vllm"]).generation_config == "vllm"
    assert parse_args(["--model", str(qwen_like_dir)]).generation_config == "auto"


def test_baton_serve_refuses_a_bad_generation_config_before_starting_anything(
        qwen_like_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from baton.cli.serve import add_serve_arguments, run
    from tests.test_gateway_support import free_port

    write_config(qwen_like_dir, {**QWEN3_LIKE, "temperature": -1})
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert run(parser.parse_args(["--model", str(qwen_like_dir), "--port", str(free_port())])) == 2
    assert "`temperature` must be >= 0" in capsys.readouterr().err
