"""Gemma 4 from a GGUF, as llama.cpp's converter writes one (tests/gemma4_gguf.py: its output checked key
for key and tensor for tensor against the converter's): transformers' reader of a `gemma4` file raised on
an "E" model's per-layer arrays, and read the rest with its config class's defaults (every 6th layer
full, 256-wide per-layer inputs, no MoE block, no KV sharing, the sliding layers' head width), so
`baton serve gemma-4-E2B-it-Q8_0.gguf` (Ollama's default model, ggml-org's file) failed, and a 26B-A4B
file would have run another model (and held its experts dequantized: ~50 GB in bf16 for a 16 GB
Q4_K_M file). Now the config is rebuilt from what the converter writes
(baton.common.gguf_config), the tensors the converter renames by hand are found
(baton.common.gguf_names), and the experts are served as the file's blocks as every GGUF MoE's are."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from baton import LLM
from baton.engine.window_blocks import freeable_window
from baton.model.gguf_embeddings import GGUFRowsEmbedding
from baton.model.kv_groups import kv_groups
from baton.model.quant import QuantizedLinear
from tests.gguf_files import gguf_files_once
from tests.gemma4_gguf import write_gemma4_gguf
from tests.test_families import (assert_bf16_near_ties_only, family_dir,  # noqa: F401
                                 greedy, hf_greedy, prompts, tokens_of)
from tests.test_gguf_moe import record_whole_reads
from tests.test_gguf_qwen35 import hf_over_the_files_weights
from tests.test_quant import native  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# the config keys a Gemma 4 model is made of (per_layer_config: each full layer's head width and KV heads)
CONFIG_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "layer_types", "sliding_window", "num_kv_shared_layers", "use_double_wide_mlp",
               "hidden_size_per_layer_input", "vocab_size_per_layer_input", "attention_k_eq_v", "enable_moe_block",
               "num_experts", "top_k_experts", "moe_intermediate_size", "final_logit_softcapping", "rope_parameters",
               "tie_word_embeddings", "vocab_size")
_BUILT: dict[str, dict[str, Path]] = {}


@pytest.fixture(scope="module")
def gemma4_gguf(family_dir, tmp_path_factory, default_gguf_model_dir):  # noqa: F811
    """get(family) -> {"hf": the checkpoint, "f32" / "q8_0": its GGUFs}, built once per family."""
    return gguf_files_once(lambda family, _: family_dir(family), write_gemma4_gguf, _BUILT, tmp_path_factory,
                           default_gguf_model_dir)


class _Kept(logging.Handler):
    """The messages a logger lets through (its filters applied)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("family", ["gemma4_text", "gemma4_text_moe", "gemma4"])
def test_a_gemma4_gguf_reads_as_its_checkpoint(family, gemma4_gguf):
    """The checkpoint's config (the layer pattern, each layer's head width and KV heads, the shared layers
    and their double-wide MLP, K = V, per-layer inputs, the MoE block, the full layers' partial rotary),
    and every tensor of its text model the checkpoint's, `layer_scalar` and the router's scales included
    (a vision-language checkpoint's file holds its text model alone)."""
    from safetensors.torch import load_file

    from baton.common.model_files import resolve_model
    from baton.model.loader import _read_tensors

    files = gemma4_gguf(family)
    # transformers' reader, blind to the file's layer pattern, warned that its default pattern's last
    # layer (4 and 6 layers here, 35 in E2B) is not full: about a config Baton never uses
    logger, kept = logging.getLogger("transformers.models.gemma4.configuration_gemma4"), _Kept()
    logger.addHandler(kept)
    try:
        model_dir = resolve_model(str(files["f32"]))
    finally:
        logger.removeHandler(kept)
    assert not [m for m in kept.messages if "Last layer must use" in m], kept.messages
    config = json.loads((model_dir / "config.json").read_text())
    expected = json.loads((files["hf"] / "config.json").read_text())
    expected = expected.get("text_config", expected)
    assert config["model_type"] == "gemma4_text"
    for key in CONFIG_KEYS:
        assert config.get(key) == expected.get(key), key
    def per_layer(c: dict) -> list[tuple[int, int]]:  # (head width, KV heads) of each layer, defaults resolved
        over = {int(i): o for i, o in c["per_layer_config"].items()}
        return [(over.get(i, {}).get("head_dim", c["head_dim"]),
                 over.get(i, {}).get("num_key_value_heads", c["num_key_value_heads"])) for i in range(c["num_hidden_layers"])]

    assert per_layer(config) == per_layer(expected)
    tensors = _read_tensors(model_dir)
    checkpoint = {name.removeprefix("model.").removeprefix("language_model."): t
                  for name, t in load_file(files["hf"] / "model.safetensors").items()
                  if not name.startswith(("model.vision_tower.", "model.embed_vision."))}
    assert set(tensors) == set(checkpoint)
    for name, tensor in checkpoint.items():
        assert torch.equal(tensors[name], tensor.to(tensors[name].dtype)), name


@pytest.mark.parametrize("family", ["gemma4_text", "gemma4_text_moe"])
def test_a_gemma4_gguf_gives_transformers_tokens(family, gemma4_gguf, prompts):  # noqa: F811
    """float32 from the file: transformers' greedy tokens on the checkpoint, batched, in prefill chunks
    across blocks, and with the window's blocks released (or preempted and recomputed)."""
    files = gemma4_gguf(family)
    expected = [hf_greedy(files["hf"], p) for p in prompts]
    assert len({t for r in expected for t in r}) >= 8
    model = str(files["f32"])
    llm = LLM(model=model, dtype="float32", num_kv_blocks=128)
    assert llm.engine.runtime.model.config.model_type == "gemma4_text"
    assert tokens_of(llm.generate(prompts, greedy())) == expected
    llm = LLM(model=model, dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=6)
    assert tokens_of(llm.generate(prompts, greedy())) == expected
    tables = kv_groups(llm.engine.model_config).num_tables
    llm = LLM(model=model, dtype="float32", block_size=4, num_kv_blocks=20 * tables + 1)
    assert tokens_of(llm.generate(prompts, greedy())) == expected
    if freeable_window(llm.engine.model_config) is None:
        assert llm.engine.scheduler.num_preemptions > 0
    else:
        assert llm.engine.block_manager.num_released_blocks > 0


def test_a_gemma4_ggufs_projections_are_served_from_its_own_blocks(native, gemma4_gguf, prompts, caplog,  # noqa: F811
                                                                   monkeypatch):
    """Q8_0, bf16 with --quantization auto: every projection the file's blocks, the fused q|k of a K = V
    layer and the q alone of a shared layer included (it looked for a v_proj the file has not, and the
    load failed); the greedy tokens transformers' float32 ones over the same weights but at near-ties."""
    monkeypatch.setenv("BATON_PACKED_CACHE", "off")  # repacked here (a shared file made earlier logs otherwise)
    from baton.common.model_files import resolve_model
    from baton.model.gguf_checkpoint import GGUFCheckpoint

    files = gemma4_gguf("gemma4_text")
    with caplog.at_level(logging.INFO, logger="baton.model"):
        llm = LLM(model=str(files["q8_0"]), num_kv_blocks=128)
    served = next(r.getMessage() for r in caplog.records if "served in its own quantization" in r.getMessage())
    # 6 layers x (qkv, o, gate_up, down) + the head (the tied embedding's blocks)
    assert served.endswith("25 Q8_0"), served
    layers = llm.engine.runtime.model.layers
    for layer in layers:
        assert isinstance(layer.self_attn.qkv, QuantizedLinear) and layer.self_attn.qkv.scheme == "q8_0"
    assert [layer.self_attn.qkv_parts for layer in layers] == ["qkv", "qkv", "qk", "qkv", "q", "q"]
    # the per-layer table: the file's rows, read per lookup (no copy in the model), the loader's values
    model = llm.engine.runtime.model
    table = model.embed_tokens_per_layer
    # (F32 in this file: its rows are 6 x 8 wide, not whole Q8_0 blocks; Q8_0 tables: test_gguf_moe)
    assert isinstance(table, GGUFRowsEmbedding) and table.type_name == "F32" and table.weight.numel() == 0
    assert any("embed_tokens_per_layer served as the file's F32 rows" in r.getMessage() for r in caplog.records)
    assert "embed_tokens_per_layer: the GGUF's F32 rows, read per lookup" in llm.engine.runtime.plan_report()
    dequantized = GGUFCheckpoint(files["q8_0"], resolve_model(str(files["q8_0"])))["embed_tokens_per_layer.weight"]
    ids = torch.tensor([0, 5, table.num_embeddings - 1, 5, 17])
    with torch.no_grad():
        assert torch.equal(table(ids), dequantized[ids].to(torch.bfloat16))
    hf = hf_over_the_files_weights({"hf": files["hf"], "q8_0": files["q8_0"]})
    assert_bf16_near_ties_only(llm, hf, prompts, "gemma4-q8_0")


def test_a_gemma4_moe_ggufs_experts_are_served_from_its_own_blocks(native, gemma4_gguf, monkeypatch):  # noqa: F811
    """Gemma 4's experts (the converter's joined gate_up stack and the down stack) as the file's Q8_0 blocks,
    one op per expert and kind, never dequantized to a dense stack nor read whole: each op's weight is the
    file's expert dequantized, bit for bit, and the block's output the dense experts' to the kernel's rounding."""
    from baton.common.model_files import resolve_model
    from baton.model.gguf_checkpoint import GGUFCheckpoint, release_readers

    monkeypatch.setenv("BATON_PACKED_CACHE", "off")
    files = gemma4_gguf("gemma4_text_moe")
    read = record_whole_reads(monkeypatch)
    llm = LLM(model=str(files["q8_0"]), num_kv_blocks=128)
    assert not [target for target in read if ".experts" in target], read
    assert "experts  x4   Q8_0 blocks per expert, native" in llm.engine.runtime.plan_report()
    file_weights = GGUFCheckpoint(files["q8_0"], resolve_model(str(files["q8_0"])))
    for index, layer in enumerate(llm.engine.runtime.model.layers):
        moe = layer.experts
        assert moe.experts_gate_up is None and moe.experts_down is None and len(moe.expert_ops) == moe.num_experts
        for kind, which in (("gate_up_proj", 0), ("down_proj", 1)):
            stack = file_weights[f"layers.{index}.experts.{kind}"]
            for expert, ops in enumerate(moe.expert_ops):
                op = ops[which]
                assert isinstance(op, QuantizedLinear) and op.scheme == "q8_0"
                assert torch.equal(op.rows(torch.arange(op.out_features), torch.float32), stack[expert])
                assert torch.equal(file_weights.expert_slice(f"layers.{index}.experts.{kind}", expert), stack[expert])
        # the block on fixed routes (a tiny MoE's routing flips at bf16's rounding: tokens would not
        # say whether the experts are right): the dense float32 experts' sum to the kernel's rounding
        # (it quantizes the activations per block of 32, as llama.cpp's does)
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(index)).to(torch.bfloat16)
        chosen = torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2], [3, 0]])
        weights = torch.softmax(torch.randn(5, 2, generator=torch.Generator().manual_seed(9)), dim=-1)
        gate_ups, downs = (file_weights[f"layers.{index}.experts.{kind}"] for kind in ("gate_up_proj", "down_proj"))
        reference = torch.zeros(5, 64)
        for t in range(5):
            for k in range(2):
                gate, up = (x[t].float() @ gate_ups[chosen[t, k]].T).chunk(2)
                reference[t] += weights[t, k] * (torch.nn.functional.gelu(gate, approximate="tanh") * up
                                                 @ downs[chosen[t, k]].T)
        with torch.no_grad():
            got = moe.mix(x, weights, chosen).float()
        assert (got - reference).abs().max() <= 0.03 * reference.abs().max(), index
    release_readers()
