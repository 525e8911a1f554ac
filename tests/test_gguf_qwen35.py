"""Qwen3.5 from a GGUF, as llama.cpp's converter writes one (tests/qwen35_gguf.py: its tensors checked
bit for bit against the converter's output): the config, tokenizer and chat template read from the
file's metadata, the tensors through transformers' conversion mapping for `qwen35`
(baton.model.gguf_mapped), the value heads llama.cpp tiles un-tiled. The model is tiny and
random-init, with 2 key heads and 4 value heads (so the reorder is not the identity) and the
attention layer last of four (`full_attention_interval`, as released checkpoints have it: the file
says it by the interval)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from baton.model.linear import QuantizedLinear

from baton import LLM
from tests.qwen35_gguf import write_qwen35_gguf
from tests.test_families import (assert_bf16_near_ties_only, greedy, hf_greedy, prompts,  # noqa: F401 (a fixture)
                                 tokens_of)
from tests.test_hybrid import build_hybrid

pytestmark = pytest.mark.usefixtures("one_torch_thread")

INTERVAL_LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


_BUILT: dict[str, dict[str, Path]] = {}


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory, default_model_dir, default_gguf_model_dir):
    """get(family) -> {"hf": the checkpoint, "f32" / "q8_0": its GGUFs}, built once per family."""
    from baton.common.model_files import gguf_source

    tokenizer = gguf_source(default_gguf_model_dir)
    assert tokenizer is not None

    def get(family: str) -> dict[str, Path]:
        if family not in _BUILT:
            root = tmp_path_factory.mktemp(f"gguf-{family}")
            hf_dir = build_hybrid(family, root / "hf", default_model_dir, layer_types=INTERVAL_LAYERS)
            _BUILT[family] = {"hf": hf_dir,
                              "f32": write_qwen35_gguf(hf_dir, root / f"tiny-{family}.F32.gguf", tokenizer),
                              "q8_0": write_qwen35_gguf(hf_dir, root / f"tiny-{family}.Q8_0.gguf", tokenizer, q8_0=True)}
        return _BUILT[family]

    return get


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])  # qwen35, qwen35moe
def test_a_qwen35_gguf_gives_the_checkpoints_greedy_tokens(family, qwen35, prompts):  # noqa: F811
    """float32 from the file (dequantized, converted; MoE experts stacked per layer in the file) is the
    checkpoint transformers runs: the same greedy tokens batched, in prefill chunks across blocks,
    and preempted and recomputed."""
    files = qwen35(family)
    expected = [hf_greedy(files["hf"], p) for p in prompts]
    assert len({t for r in expected for t in r}) >= 8
    llm = LLM(model=str(files["f32"]), dtype="float32", num_kv_blocks=128)
    config = llm.engine.runtime.model.config
    assert (config.num_layers, config.model_type) == (4, family)
    assert tokens_of(llm.generate(prompts, greedy())) == expected
    llm = LLM(model=str(files["f32"]), dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=6)
    assert tokens_of(llm.generate(prompts, greedy())) == expected
    llm = LLM(model=str(files["f32"]), dtype="float32", block_size=4, num_kv_blocks=21)
    assert tokens_of(llm.generate(prompts, greedy())) == expected
    assert llm.engine.scheduler.num_preemptions > 0


def test_a_qwen35_gguf_is_served_from_its_own_blocks(qwen35, prompts, caplog, monkeypatch):  # noqa: F811
    """Q8_0: every projection is served as the file's blocks: the attention, MLP, head and the state
    layers' input projections with the value-head rows reordered as stored (a block never spans
    rows); out_proj, whose columns the reorder moves, as stored, its input read in the reorder
    (`QuantizedLinear.input_order`; it was dequantized to bf16, and ran 5x slower on a CPU without
    bf16 instructions). Greedy bf16 tokens follow transformers' float32 over the same (dequantized)
    weights but at near-ties."""
    from transformers import AutoModelForCausalLM

    from baton.model.gguf_checkpoint import GGUFCheckpoint, release_readers
    from baton.common.model_files import resolve_model

    monkeypatch.setenv("BATON_PACKED_CACHE", "off")  # repacked here (a shared file made earlier logs otherwise)
    files = qwen35("qwen3_5_text")
    with caplog.at_level(logging.INFO, logger="baton.model.gguf_weights"):
        llm = LLM(model=str(files["q8_0"]), num_kv_blocks=128)
    served = next(r.getMessage() for r in caplog.records if "served in its own quantization" in r.getMessage())
    # 1 attention layer (qkv, o) + 4 MLPs (gate_up, down) + 3 state layers (qkv, z) + the head; 3 out_proj
    assert served.endswith("17 Q8_0, 3 Q8_0 (input reordered)"), served
    out_proj = llm.engine.runtime.model.layers[0].linear_attn.out
    assert isinstance(out_proj, QuantizedLinear) and out_proj.input_order is not None
    assert not torch.equal(out_proj.input_order, torch.arange(out_proj.in_features))
    model_dir = resolve_model(str(files["q8_0"]))
    file_weights = GGUFCheckpoint(files["q8_0"], model_dir)
    hf = AutoModelForCausalLM.from_pretrained(files["hf"], dtype=torch.float32).eval()
    state = {f"model.{name}": file_weights[name] for name in file_weights if not name.startswith("mtp.")}
    if "model.lm_head.weight" in state:
        state["lm_head.weight"] = state.pop("model.lm_head.weight")
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if m != "lm_head.weight"], (missing, unexpected)
    release_readers()
    assert_bf16_near_ties_only(llm, hf, prompts, "qwen35-q8_0")
