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
from typing import Any

import pytest
import torch

from baton.model.linear import QuantizedLinear

from baton import LLM
from tests.gguf_files import gguf_files_once
from tests.qwen35_gguf import write_qwen35_gguf
from tests.test_gguf_moe import record_whole_reads
from tests.test_families import (assert_bf16_near_ties_only, assert_first_tokens_near_ties, greedy,  # noqa: F401
                                 hf_greedy, prompts, tokens_of)
from tests.test_hybrid import build_hybrid

pytestmark = pytest.mark.usefixtures("one_torch_thread")

INTERVAL_LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


_BUILT: dict[str, dict[str, Path]] = {}


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory, default_model_dir, default_gguf_model_dir):
    """get(family) -> {"hf": the checkpoint, "f32" / "q8_0": its GGUFs}, built once per family."""
    def checkpoint(family: str, root: Path) -> Path:
        return build_hybrid(family, root / "hf", default_model_dir, layer_types=INTERVAL_LAYERS)

    return gguf_files_once(checkpoint, write_qwen35_gguf, _BUILT, tmp_path_factory, default_gguf_model_dir)


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
    assert_bf16_near_ties_only(llm, hf_over_the_files_weights(files), prompts, "qwen35-q8_0")


def hf_over_the_files_weights(files: dict[str, Path]) -> Any:
    """transformers' model of the checkpoint, float32, holding the GGUF's (dequantized) weights."""
    from transformers import AutoModelForCausalLM

    from baton.common.model_files import resolve_model
    from baton.model.gguf_checkpoint import GGUFCheckpoint, release_readers

    model_dir = resolve_model(str(files["q8_0"]))
    file_weights = GGUFCheckpoint(files["q8_0"], model_dir)
    hf = AutoModelForCausalLM.from_pretrained(files["hf"], dtype=torch.float32).eval()
    state = {f"model.{name}": file_weights[name] for name in file_weights if not name.startswith("mtp.")}
    if "model.lm_head.weight" in state:
        state["lm_head.weight"] = state.pop("model.lm_head.weight")
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if m != "lm_head.weight"], (missing, unexpected)
    release_readers()
    return hf


def test_a_qwen35_moe_ggufs_experts_are_served_from_its_own_blocks(qwen35, prompts, caplog,  # noqa: F811
                                                                    monkeypatch):
    """A MoE's experts (most of its bytes) as the file's blocks, one Q8_0 op per expert and kind, never
    dequantized to a dense stack (the loader leaves the stacks unread; the load check reads its
    sampled experts alone, never a whole stack): each op's weight is transformers' dequantization of
    the file's expert bit for bit, each expert's output the dense matmul's to the kernel's rounding (it quantizes
    the activations per block of 32, as llama.cpp's does), and the first greedy token of each prompt
    transformers' float32 one but at near-ties. (Later tokens are not compared: this tiny MoE's
    routing flips at the kernels' rounding, dense experts served beside Q8_0 projections drift as far.)"""
    from baton.common.model_files import resolve_model
    from baton.model.gguf_checkpoint import GGUFCheckpoint, release_readers

    monkeypatch.setenv("BATON_PACKED_CACHE", "off")
    files = qwen35("qwen3_5_moe_text")
    read = record_whole_reads(monkeypatch)
    with caplog.at_level(logging.INFO, logger="baton.model.gguf_experts"):
        llm = LLM(model=str(files["q8_0"]), num_kv_blocks=128)
    assert not [target for target in read if ".experts_" in target], read  # sampled experts read alone
    served = [r.getMessage() for r in caplog.records if "MoE experts served" in r.getMessage()]
    assert served and "8 Q8_0 stacks (" in served[0], served  # 4 MoE layers x (gate_up, down)
    file_weights = GGUFCheckpoint(files["q8_0"], resolve_model(str(files["q8_0"])))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for index, layer in enumerate(llm.engine.runtime.model.layers):
        moe = layer.mlp
        assert moe.experts_gate_up is None and moe.experts_down is None  # no dense copy held
        assert moe.expert_ops is not None and len(moe.expert_ops) == moe.num_experts
        stacks = [file_weights[f"layers.{index}.mlp.experts.{kind}"] for kind in ("gate_up_proj", "down_proj")]
        for expert, ops in enumerate(moe.expert_ops):
            for op, stack, kind in zip(ops, stacks, ("gate_up_proj", "down_proj")):
                assert torch.equal(file_weights.expert_slice(f"layers.{index}.mlp.experts.{kind}", expert),
                                   stack[expert])
                assert isinstance(op, QuantizedLinear) and op.scheme == "q8_0"
                assert torch.equal(op.rows(torch.arange(op.out_features), torch.float32), stack[expert])
            gate, up = (x.float() @ stacks[0][expert].T).chunk(2, dim=-1)
            reference = (torch.nn.functional.silu(gate) * up) @ stacks[1][expert].T
            with torch.no_grad():
                got = moe._expert(x, expert).float()
            assert (got - reference).abs().max() <= 0.03 * reference.abs().max(), (index, expert)
    release_readers()
    assert_first_tokens_near_ties(llm, hf_over_the_files_weights(files), prompts)
