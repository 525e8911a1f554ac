"""Shared fixtures: a private redis-server per test session, the real default model, a tiny model."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytest_plugins = ["tests.test_gateway_support"]  # the gateway tests' gw_* fixtures

os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing in tests may reach a hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def redis_server():
    from baton.cli.redis_server import start_private_redis

    server = start_private_redis()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def default_gguf_model_dir() -> Path:
    """The default model as `baton serve` serves it: converted from its GGUF, whose Q4_1 blocks the
    engine serves as they are (`--quantization auto`)."""
    from baton.common.model_files import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory, default_gguf_model_dir) -> Path:
    """The default model as a plain Hugging Face checkpoint: the converted directory's files without
    its GGUF source record, and the weights transformers dequantizes from the GGUF as safetensors, so
    that Baton serves them in --dtype, the weights the transformers oracle runs."""
    from baton.common.gguf_names import NAMES_FILE
    from baton.common.model_files import GGUF_SOURCE_FILE, transformers_source

    out = tmp_path_factory.mktemp("hf-checkpoint") / default_gguf_model_dir.name
    out.mkdir()
    for entry in default_gguf_model_dir.iterdir():
        if entry.name not in (GGUF_SOURCE_FILE, NAMES_FILE):
            (out / entry.name).symlink_to(entry)
    if not list(out.glob("*.safetensors")):  # the weights live in the GGUF: dequantized here, once
        import torch
        from transformers import AutoModelForCausalLM

        path, kwargs = transformers_source(default_gguf_model_dir)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
        model.hf_quantizer = None  # plain fp32 weights now: saving with the quantizer attached fails
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out / ".weights")
        for entry in (out / ".weights").iterdir():
            if entry.name.endswith((".safetensors", ".safetensors.index.json")):
                entry.rename(out / entry.name)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A random-init Llama of the default model's architecture, shrunk, with the real tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=2, rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    # Plain random init is useless for parity: its logits are near-uniform (greedy hinges on float
    # ties) or, with big embeddings, it just repeats the last input token (broken attention would
    # still pass). Scaled-up layers make the output depend on the whole context, and a scaled
    # final norm keeps the top logits far apart.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2 and name != "model.embed_tokens.weight":
                param.mul_(5.0)
        model.model.norm.weight.mul_(30.0)
    model.save_pretrained(out)
    for name in os.listdir(default_model_dir):
        if name.startswith("tokenizer") or name.endswith(".jinja") or name == "special_tokens_map.json":
            shutil.copy(default_model_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls gain nothing from threads, and on a busy 2-core machine two threads spin
    against each other (a step goes from ~5 ms to ~250 ms)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
