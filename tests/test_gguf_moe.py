"""A Qwen3-MoE GGUF (llama.cpp's `qwen3moe`: Qwen3-30B-A3B's and Qwen3-Coder-30B-A3B's architecture),
written here as llama.cpp's converter writes one (ggml names, the experts stacked per layer as
`ffn_{gate,up,down}_exps`, no row permutation), from a tiny random-init checkpoint whose every layer
is a MoE with renormalized top-k weights, as the released models are.

What it checks: the config is completed as llama.cpp reads the file (transformers' reader leaves the
experts' width and `norm_topk_prob` at the config class's defaults); the file is read lazily (it was
read whole by transformers, the whole model dequantized to float32 at once); dequantized, its greedy
tokens are transformers' on the same weights; under `auto` its experts are served in the file's own
blocks: Q4_0 as 4-bit ops, Q5_0 requantized to Q8_0, never a dense stack.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from baton import LLM
from baton.model.gguf_embeddings import GGUFRowsEmbedding
from baton.model.linear import QuantizedLinear
from tests.qwen35_gguf import _copy_tokenizer, _stacked_experts
from tests.qwen35_gguf import add_attention_metadata
from tests.test_families import (SMALL, assert_first_tokens_near_ties, greedy, hf_greedy, prompts,  # noqa: F401
                                 save_with_tokenizer, tokens_of)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXPERTS, ACTIVE, EXPERT_WIDTH = 8, 2, 32
# the experts' types: gate and up as 4-bit blocks the kernel takes, down as a type it does not
GATE_UP_TYPE, DOWN_TYPE = "Q4_0", "Q5_0"


def build_qwen3_moe(out: Path, tokenizer_dir: Path) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**SMALL, num_experts=EXPERTS, num_experts_per_tok=ACTIVE,
                            moe_intermediate_size=EXPERT_WIDTH, norm_topk_prob=True, tie_word_embeddings=False)
    torch.manual_seed(31)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # as tests/test_families.py's build_family: logits far from uniform
        for name, param in model.named_parameters():
            if param.dim() >= 2 and not name.endswith("embed_tokens.weight"):
                param.mul_(5.0)
            elif name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn_like(param))
                if name == "model.norm.weight":
                    param.mul_(30.0)
    return save_with_tokenizer(model, out, tokenizer_dir)


def _quantized(data: np.ndarray, type_name: str) -> tuple[np.ndarray, Any]:
    import gguf

    kind = gguf.GGMLQuantizationType[type_name]
    return gguf.quants.quantize(data, kind), kind


def write_qwen3_moe_gguf(model_dir: Path, out: Path, tokenizer_gguf: Path) -> Path:
    """`model_dir` as llama.cpp's converter writes a Qwen3-MoE: every projection, the embedding and
    the head as Q8_0, the experts' gate and up as GATE_UP_TYPE and down as DOWN_TYPE, norms and the
    router float32."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    tensors = _stacked_experts(load_file(str(model_dir / "model.safetensors")))  # blk.N.ffn_*_exps: [E, out, in]
    writer = gguf.GGUFWriter(str(out), "qwen3moe")
    writer.add_name("Qwen3-MoE tiny")
    writer.add_feed_forward_length(cfg["intermediate_size"])
    add_attention_metadata(writer, cfg)
    writer.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    _copy_tokenizer(writer, tokenizer_gguf)
    leaves = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
              "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
              "mlp.gate.weight": "ffn_gate_inp.weight"}
    for name, tensor in tensors.items():
        data = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            parts = {"token_embd.weight": (data, "Q8_0")}
        elif name == "lm_head.weight":
            parts = {"output.weight": (data, "Q8_0")}
        elif name == "model.norm.weight":
            parts = {"output_norm.weight": (data, "F32")}
        elif name.startswith("blk."):
            parts = {name: (data, DOWN_TYPE if "down" in name else GATE_UP_TYPE)}
        else:
            block, leaf = name.removeprefix("model.layers.").split(".", 1)
            kind = "Q8_0" if leaf.startswith("self_attn.") and leaf.endswith("_proj.weight") else "F32"
            parts = {f"blk.{block}.{leaves[leaf]}": (data, kind)}
        for gguf_name, (value, kind) in parts.items():
            if kind == "F32":
                writer.add_tensor(gguf_name, np.ascontiguousarray(value, dtype=np.float32))
            else:
                blocks, raw_dtype = _quantized(np.ascontiguousarray(value), kind)
                writer.add_tensor(gguf_name, blocks, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory, default_model_dir, default_gguf_model_dir) -> dict[str, Path]:
    from baton.common.model_files import gguf_source

    root = tmp_path_factory.mktemp("gguf-qwen3moe")
    hf_dir = build_qwen3_moe(root / "hf", default_model_dir)
    tokenizer = gguf_source(default_gguf_model_dir)
    assert tokenizer is not None
    return {"hf": hf_dir, "gguf": write_qwen3_moe_gguf(hf_dir, root / "tiny-qwen3moe.gguf", tokenizer)}


def file_weights_checkpoint(files: dict[str, Path], into: Path) -> Path:
    """The checkpoint with the GGUF's weights (dequantized as transformers dequantizes them), saved
    beside its config: transformers' oracle for the file."""
    from transformers import AutoModelForCausalLM

    from baton.common.model_files import resolve_model
    from baton.model.gguf_checkpoint import GGUFCheckpoint, release_readers

    if (into / "model.safetensors").is_file():
        return into
    weights = GGUFCheckpoint(files["gguf"], resolve_model(str(files["gguf"])))
    state = {(name if name.startswith("lm_head") else f"model.{name}"): weights[name] for name in weights}
    release_readers()
    hf = AutoModelForCausalLM.from_pretrained(files["hf"], dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return save_with_tokenizer(hf, into, files["hf"])


def test_a_qwen3_moe_gguf_is_configured_as_llama_cpp_reads_it_and_read_lazily(qwen3_moe, prompts, caplog,
                                                                               tmp_path):
    """The experts' width and the renormalized top-k from the file (transformers' reader left 768 and
    False, the config class's defaults: another model's experts, unnormalized routing), no whole-file
    read, and the dequantized weights' greedy tokens equal transformers' on them: batched, chunked."""
    from baton.common.model_files import resolve_model
    from baton.model.gguf_checkpoint import GGUFCheckpoint, release_readers

    with caplog.at_level(logging.INFO):
        model_dir = resolve_model(str(qwen3_moe["gguf"]))
        checkpoint = GGUFCheckpoint(qwen3_moe["gguf"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["moe_intermediate_size"], config["norm_topk_prob"], config["mlp_only_layers"]) == (
        EXPERT_WIDTH, True, [])
    assert not any("reading the file whole" in r.getMessage() for r in caplog.records)
    assert checkpoint._eager is None and tuple(checkpoint["layers.0.mlp.experts.gate_up_proj"].shape) == (
        EXPERTS, 2 * EXPERT_WIDTH, SMALL["hidden_size"])
    release_readers()
    oracle = file_weights_checkpoint(qwen3_moe, tmp_path / "file-weights")
    expected = [hf_greedy(oracle, p) for p in prompts]
    assert len({t for row in expected for t in row}) >= 8
    llm = LLM(model=str(qwen3_moe["gguf"]), dtype="float32", quantization="none", num_kv_blocks=128)
    assert tokens_of(llm.generate(prompts, greedy())) == expected
    llm = LLM(model=str(qwen3_moe["gguf"]), dtype="float32", quantization="none", block_size=4,
              num_kv_blocks=128, max_num_batched_tokens=6)
    assert tokens_of(llm.generate(prompts, greedy())) == expected


def test_a_qwen3_moe_ggufs_experts_are_served_in_its_own_blocks(qwen3_moe, prompts, caplog, monkeypatch,
                                                                tmp_path):
    """Under `auto`: gate and up (Q4_0) as 4-bit ops whose weights are the file's, bit for bit; down
    (Q5_0, no kernel for it) requantized to Q8_0; no dense expert stack held; each expert's output
    the dense matmul's to the kernels' rounding; the first greedy token of each prompt transformers'
    float32 one but at near-ties."""
    from baton.common.model_files import resolve_model
    from baton.model.gguf_checkpoint import GGUFCheckpoint, release_readers

    monkeypatch.setenv("BATON_PACKED_CACHE", "off")
    read = record_whole_reads(monkeypatch)
    with caplog.at_level(logging.INFO, logger="baton.model.gguf_experts"):
        llm = LLM(model=str(qwen3_moe["gguf"]), num_kv_blocks=128)
    # the load check read its sampled experts alone: never a layer's whole dense stack
    assert not [target for target in read if ".experts_" in target], read
    served = [r.getMessage() for r in caplog.records if "MoE experts served" in r.getMessage()]
    layers = SMALL["num_hidden_layers"]
    assert served and f"{layers} Q4_0 stacks, {layers} Q5_0 requantized to Q8_0 stacks (" in served[0], served
    weights = GGUFCheckpoint(qwen3_moe["gguf"], resolve_model(str(qwen3_moe["gguf"])))
    # the untied input table: the file's Q8_0 rows read per lookup (never loaded), the loader's values
    model = llm.engine.runtime.model
    assert "embed_tokens.weight" not in read and isinstance(model.embed_tokens, GGUFRowsEmbedding)
    assert model.embed_tokens.type_name == "Q8_0" and model.embed_tokens.weight.numel() == 0
    ids = torch.tensor([3, 0, SMALL["vocab_size"] - 1, 3])
    with torch.no_grad():
        assert torch.equal(model.embed(ids), weights["embed_tokens.weight"][ids].to(torch.bfloat16))
    x = torch.randn(5, SMALL["hidden_size"], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for index, layer in enumerate(llm.engine.runtime.model.layers):
        moe = layer.mlp
        assert moe.experts_gate_up is None and moe.experts_down is None
        gate_up, down = (weights[f"layers.{index}.mlp.experts.{k}"] for k in ("gate_up_proj", "down_proj"))
        for expert, (gate_up_op, down_op) in enumerate(moe.expert_ops):
            for kind, stack in (("gate_up_proj", gate_up), ("down_proj", down)):
                assert torch.equal(weights.expert_slice(f"layers.{index}.mlp.experts.{kind}", expert), stack[expert])
            assert isinstance(gate_up_op, QuantizedLinear) and (gate_up_op.scheme, down_op.scheme) == ("q4", "q8_0")
            rows = gate_up_op.rows(torch.arange(gate_up_op.out_features), torch.float32)
            assert torch.equal(rows, gate_up[expert])
            requantized = down_op.rows(torch.arange(down_op.out_features), torch.float32)
            assert (requantized - down[expert]).abs().max() <= down[expert].abs().max() / 100
            gate, up = (x.float() @ gate_up[expert].T).chunk(2, dim=-1)
            reference = (torch.nn.functional.silu(gate) * up) @ down[expert].T
            with torch.no_grad():
                got = moe._expert(x, expert).float()
            assert (got - reference).abs().max() <= 0.03 * reference.abs().max(), (index, expert)
    release_readers()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(file_weights_checkpoint(qwen3_moe, tmp_path / "w"),
                                              dtype=torch.float32).eval()
    assert_first_tokens_near_ties(llm, hf, prompts)


def test_a_decode_steps_chosen_experts_run_at_once_with_the_loops_bits(qwen3_moe, prompts, monkeypatch):
    """A few tokens' chosen experts run as one native call per projection (`qgemv_rows`) instead of
    a loop over the experts: the layer's output is the loop's bit for bit at 1-4 tokens (each
    token's experts summed in the same order, each sum rounded alike), and greedy decoding gives
    the loop's tokens."""
    from baton.model import moe as moe_module

    monkeypatch.setenv("BATON_PACKED_CACHE", "off")
    llm = LLM(model=str(qwen3_moe["gguf"]), num_kv_blocks=128)
    layers = [layer.mlp for layer in llm.engine.runtime.model.layers]
    if layers[0].rows_kernel is None:
        pytest.skip("no native int8 kernel on this machine (AVX512-VNNI or AVX2)")
    generator = torch.Generator().manual_seed(5)
    for tokens in (1, 2, 3, 4):
        x = torch.randn(tokens, SMALL["hidden_size"], generator=generator).to(torch.bfloat16)
        for moe in layers:
            with torch.no_grad():
                monkeypatch.setattr(moe_module, "ROWS_AT_ONCE", 32)
                at_once = moe(x)
                monkeypatch.setattr(moe_module, "ROWS_AT_ONCE", 0)
                looped = moe(x)
            assert torch.equal(at_once, looped), tokens
    monkeypatch.setattr(moe_module, "ROWS_AT_ONCE", 0)
    looped_tokens = tokens_of(llm.generate(prompts, greedy()))
    monkeypatch.setattr(moe_module, "ROWS_AT_ONCE", 32)
    assert tokens_of(llm.generate(prompts, greedy())) == looped_tokens
    # without the native kernels (no AVX2, or switched off) the int8 experts dequantize per call and
    # run through the loop: no kernel to call at once
    monkeypatch.setenv("BATON_NATIVE_KERNELS", "off")
    plain = LLM(model=str(qwen3_moe["hf"]), quantization="int8", num_kv_blocks=128)
    moes = [layer.mlp for layer in plain.engine.runtime.model.layers]
    assert all(moe.expert_ops is not None and moe.rows_kernel is None for moe in moes)
    assert len(tokens_of(plain.generate(prompts[:1], greedy()))[0]) == greedy().max_tokens


def record_whole_reads(monkeypatch) -> list[str]:
    """The parameters the load reads whole through `UnreadWeights.read` (recorded as it runs)."""
    from baton.model.loader import UnreadWeights

    read: list[str] = []
    whole = UnreadWeights.read

    def recording(self: UnreadWeights, target: str) -> torch.Tensor:
        read.append(target)
        return whole(self, target)

    monkeypatch.setattr(UnreadWeights, "read", recording)
    return read


def test_a_moe_ggufs_expert_packs_are_written_once_and_mapped_by_the_next_worker(qwen3_moe, prompts, caplog,
                                                                                 monkeypatch, tmp_path):
    """The first load streams the expert packs into the machine's packed cache and serves them from
    the file (reading the experts it checks alone, never a whole stack); a second load maps that file
    and neither repacks nor reads an expert; both give the tokens of a load that keeps private packs."""
    from baton.model import loader

    monkeypatch.setenv("BATON_PACKED_CACHE", "off")
    private = tokens_of(LLM(model=str(qwen3_moe["gguf"]), num_kv_blocks=128).generate(prompts, greedy()))
    monkeypatch.setenv("BATON_PACKED_CACHE", "on")
    monkeypatch.setenv("BATON_CACHE", str(tmp_path / "cache"))
    reads = record_whole_reads(monkeypatch)
    expert_reads: list[tuple[str, int]] = []
    read_expert = loader.UnreadWeights.read_expert
    monkeypatch.setattr(loader.UnreadWeights, "read_expert", lambda self, target, expert: expert_reads.append(
        (target, expert)) or read_expert(self, target, expert))
    # written: the sampled experts of each stack (first, middle, last) read alone to check the packs
    checked = [(f"layers.{i}.mlp.{kind}", e) for i in range(SMALL["num_hidden_layers"])
               for kind in ("experts_gate_up", "experts_down") for e in (0, 4, 7)]  # of 8
    for verb, expected_reads in (("written to", checked), ("mapped from", [])):
        reads.clear()
        expert_reads.clear()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="baton.model.gguf_experts"):
            llm = LLM(model=str(qwen3_moe["gguf"]), num_kv_blocks=128)
        [served] = [r.getMessage() for r in caplog.records if "MoE experts served" in r.getMessage()]
        assert f"({verb} {tmp_path / 'cache' / 'packed'}" in served, served
        assert not [r for r in reads if ".experts_" in r], reads  # never a whole stack
        assert expert_reads == expected_reads
        ops = [op for layer in llm.engine.runtime.model.layers for pair in layer.mlp.expert_ops for op in pair]
        assert len(ops) == 2 * EXPERTS * SMALL["num_hidden_layers"] and all(op.shared for op in ops)
        assert tokens_of(llm.generate(prompts, greedy())) == private
