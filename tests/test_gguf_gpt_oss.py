"""gpt-oss from a GGUF, as llama.cpp's converter writes one (tests/gpt_oss_gguf.py: its output checked
tensor for tensor against the converter's): transformers' own reader raised on the file's YaRN keys, so
`baton serve gpt-oss-20b-mxfp4.gguf` (llama.cpp's and Ollama's gpt-oss) failed before loading. Now the
config is read as the checkpoint's (YaRN without truncation, the window's alternation, the head width),
the tensors as OpenAI's checkpoint names them, MXFP4 experts kept as blocks (baton.model.gguf_gpt_oss),
and the one gpt-oss load path serves them: Q8_0 expert ops without loss, or dequantized."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from baton import LLM
from baton.engine.window_blocks import freeable_window
from baton.model.kv_groups import kv_groups
from tests.gpt_oss_gguf import write_gpt_oss_gguf
from tests.test_families import (assert_bf16_near_ties_only, family_dir, greedy, hf_greedy, hf_model,  # noqa: F401
                                 prompts, tokens_of)
from tests.test_moe_quant import gpt_oss_mxfp4, moe_ops_native
from tests.test_quant import native  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def gpt_oss_gguf(family_dir, tmp_path_factory, default_gguf_model_dir) -> dict[str, Path]:  # noqa: F811
    """{"gguf": the file, "checkpoint": the MXFP4 checkpoint it was written from, "oracle": that model
    dequantized, with the SwiGLU limit a GGUF's config gets (7.0, llama.cpp's constant for gpt-oss:
    the file does not carry it; the tiny family model clamps at 1.0)}."""
    from baton.common.model_files import gguf_source

    root = tmp_path_factory.mktemp("gpt-oss-gguf")
    mxfp4, dequantized = gpt_oss_mxfp4(family_dir("gpt_oss"), root)
    oracle = root / "oracle"
    shutil.copytree(dequantized, oracle)
    config = json.loads((oracle / "config.json").read_text())
    (oracle / "config.json").write_text(json.dumps({**config, "swiglu_limit": 7.0}))
    gguf_file = write_gpt_oss_gguf(mxfp4, root / "tiny-gpt-oss-mxfp4.gguf", gguf_source(default_gguf_model_dir))
    return {"gguf": gguf_file, "checkpoint": mxfp4, "oracle": oracle}


def test_a_gpt_oss_gguf_reads_as_openais_checkpoint(gpt_oss_gguf):
    """The config the checkpoint has (YaRN with truncate false, sliding even layers, the head width); every
    tensor the checkpoint's, MXFP4 blocks and scales byte for byte, read one at a time."""
    from safetensors.torch import load_file

    from baton.common.model_files import resolve_model
    from baton.model.loader import _read_tensors

    model_dir = resolve_model(str(gpt_oss_gguf["gguf"]))
    config = json.loads((model_dir / "config.json").read_text())
    expected = json.loads((gpt_oss_gguf["checkpoint"] / "config.json").read_text())
    for key in ("head_dim", "intermediate_size", "sliding_window", "layer_types", "num_local_experts",
                "num_experts_per_tok", "num_key_value_heads"):
        assert config[key] == expected[key], key
    assert config["rope_parameters"] == expected["rope_parameters"]  # (truncate false included)
    assert config["swiglu_limit"] == 7.0
    tensors = _read_tensors(model_dir)
    checkpoint = {name.removeprefix("model."): t for name, t in load_file(gpt_oss_gguf["checkpoint"] / "model.safetensors").items()}
    assert set(tensors) == set(checkpoint)
    for name, tensor in checkpoint.items():
        assert torch.equal(tensors[name], tensor.to(tensors[name].dtype)), name


def test_a_gpt_oss_gguf_gives_transformers_tokens(gpt_oss_gguf, prompts):  # noqa: F811
    """float32, its experts dequantized (--quantization none): transformers' greedy tokens on the same
    weights, batched, in prefill chunks across blocks, and preempted and recomputed."""
    expected = [hf_greedy(gpt_oss_gguf["oracle"], p) for p in prompts]
    assert len({t for r in expected for t in r}) >= 8
    model = str(gpt_oss_gguf["gguf"])
    llm = LLM(model=model, dtype="float32", num_kv_blocks=128, quantization="none")
    assert llm.engine.runtime.model.config.model_type == "gpt_oss"
    assert tokens_of(llm.generate(prompts, greedy())) == expected
    llm = LLM(model=model, dtype="float32", quantization="none", block_size=4, num_kv_blocks=128,
              max_num_batched_tokens=6)
    assert tokens_of(llm.generate(prompts, greedy())) == expected
    # 4-token blocks, as the family test sizes them: preempted, or the window's blocks released
    tables = kv_groups(llm.engine.model_config).num_tables
    llm = LLM(model=model, dtype="float32", quantization="none", block_size=4, num_kv_blocks=20 * tables + 1)
    assert tokens_of(llm.generate(prompts, greedy())) == expected
    if freeable_window(llm.engine.model_config) is None:
        assert llm.engine.scheduler.num_preemptions > 0
    else:
        assert llm.engine.block_manager.num_released_blocks > 0


def test_a_gpt_oss_ggufs_mxfp4_experts_are_served_as_q8_0_blocks(native, gpt_oss_gguf, prompts):  # noqa: F811
    """bf16 with --quantization auto: the file's MXFP4 experts become Q8_0 ops without loss, as a
    safetensors checkpoint's do (never a dense stack), and the tokens are transformers' but at near-ties."""
    llm = LLM(model=str(gpt_oss_gguf["gguf"]), dtype="bfloat16", num_kv_blocks=128)
    runtime = llm.engine.runtime
    assert all(moe_ops_native(runtime.model))
    assert "experts  x3   Q8_0 blocks per expert, native" in runtime.plan_report()
    assert_bf16_near_ties_only(llm, hf_model(gpt_oss_gguf["oracle"]), prompts, "gpt_oss")
