"""MoE experts on the native Q8_0 kernel (issue 41): gpt-oss's MXFP4 experts repacked as Q8_0 without
loss (the same weights, bit for bit), each expert's gate_up and down a QuantizedLinear, the dense stacks
gone; served so, a tiny gpt-oss gives transformers' greedy tokens on the dequantized checkpoint but at
near-ties (the kernel quantizes the activations per block of 32); `baton plan` names the form."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from baton import LLM
from baton.model.linear import QuantizedLinear, dequantize_q8_0
from baton.model.mxfp4 import dequantize, repack_q8_0
from tests.test_families import (assert_bf16_near_ties_only, family_dir, hf_model, prompts,  # noqa: F401
                                 with_mxfp4_experts)
from tests.test_quant import native  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_mxfp4(experts: int, rows: int, inputs: int, seed: int, low: int = 120, high: int = 125
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, inputs // 32, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(low, high, (experts, rows, inputs // 32), dtype=torch.uint8, generator=generator)
    return blocks, scales


def test_mxfp4_blocks_repack_into_q8_0_without_loss(native):
    """Every code and every exponent but the overflowing ones (255 makes 6 * 2^128: inf either way):
    d * q is transformers' dequantized weight exactly in fp32, before and after the native pack."""
    blocks, scales = random_mxfp4(3, 40, 128, seed=1, low=0, high=255)
    scales[0, 0, :2] = torch.tensor([0, 1], dtype=torch.uint8)  # 2^-128: d is an fp32 subnormal, still exact
    q, d = repack_q8_0(blocks, scales)
    assert q.dtype == torch.int8 and d.dtype == torch.float32 and int(q.abs().max()) == 12
    reference = dequantize(blocks, scales, torch.float32).transpose(1, 2)  # F.linear's [out, in]
    for e in range(3):
        assert torch.equal(dequantize_q8_0(q[e], d[e]), reference[e])
        op = QuantizedLinear.q8_0(q[e], d[e], None, native)
        assert torch.equal(op.rows(torch.arange(40), torch.float32), reference[e])  # the pack keeps d in fp32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_repacked_expert_through_the_kernel_is_the_dequantized_matmul(native, dtype):
    """The native kernel on the repacked blocks equals F.linear on the dequantized weight to the
    activations' per-block int8 quantization (test_quant's bound for Q8_0)."""
    blocks, scales = random_mxfp4(1, 96, 64, seed=2)
    q, d = repack_q8_0(blocks, scales)
    weight = dequantize(blocks, scales, torch.float32).transpose(1, 2)[0]
    bias = torch.randn(96)
    x = torch.randn(7, 64).to(dtype)
    out = QuantizedLinear.q8_0(q[0], d[0], bias, native)(x)
    ref = F.linear(x.float(), weight, bias)
    assert out.dtype == dtype
    assert (out.float() - ref).abs().max().item() <= 0.02 * ref.abs().max().item()


def gpt_oss_mxfp4(model_dir: Path, out: Path) -> tuple[Path, Path]:
    """The tiny gpt-oss with random MXFP4 experts (as gpt-oss ships them, quant_method mxfp4), and the
    same model with transformers' dequantization of them as dense tensors."""
    if (out / "mxfp4").exists():
        return out / "mxfp4", out / "dequantized"
    from safetensors.torch import load_file

    packed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, (name, tensor) in enumerate(sorted(load_file(model_dir / "model.safetensors").items())):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, inputs, outputs = tensor.shape  # stored input-major: [E, in, out]
            packed[name] = random_mxfp4(experts, outputs, inputs, seed=100 + i)

    return with_mxfp4_experts(model_dir, out, packed)


@pytest.fixture(scope="module")
def gpt_oss_dirs(family_dir, tmp_path_factory) -> tuple[Path, Path]:  # noqa: F811
    return gpt_oss_mxfp4(family_dir("gpt_oss"), tmp_path_factory.mktemp("gpt-oss-mxfp4"))


def test_mxfp4_experts_load_as_q8_0_ops_holding_the_dequantized_weights(native, gpt_oss_dirs):
    """Loaded with `mxfp4_as_q8_0`: no dense expert stack, each expert's ops hold exactly the weights
    the dense load makes (gate/up de-interleaved, [out, in]), in about half bf16's bytes; an expert's
    output is the dense expert's to the activations' quantization."""
    from baton.model.loader import load_model
    from baton.model.moe_quant import moe_layers
    from baton.model.plan_report import expert_plans, held_bytes

    mxfp4, dequantized = gpt_oss_dirs
    quantized, config = load_model(mxfp4, dtype="bfloat16", device="cpu", prepare=False, mxfp4_as_q8_0=True,
                              kernels=native)
    dense, _ = load_model(dequantized, dtype="bfloat16", device="cpu", prepare=False)
    assert not [n for n, _ in quantized.named_parameters() if n.endswith(("experts_gate_up", "experts_down"))]
    x = torch.randn(5, config.hidden_size).bfloat16()
    for q_moe, d_moe in zip(moe_layers(quantized), moe_layers(dense), strict=True):
        assert q_moe.expert_ops is not None and d_moe.expert_ops is None
        for e, (gate_up, down) in enumerate(q_moe.expert_ops):
            assert gate_up.native and down.native
            for op, weight in ((gate_up, d_moe.experts_gate_up[e]), (down, d_moe.experts_down[e])):
                assert torch.equal(op.rows(torch.arange(op.out_features), torch.float32), weight.float())
            with torch.no_grad():
                got, ref = q_moe._expert(x, e).float(), d_moe._expert(x, e).float()
            assert (got - ref).abs().max().item() <= 0.03 * ref.abs().max().item(), e
    q_bytes, d_bytes = (sum(p.nbytes for p in expert_plans(m)) for m in (quantized, dense))
    print(f"\nexperts held: bf16 {d_bytes} B, Q8_0 {q_bytes} B ({q_bytes / d_bytes:.3f}); "
          f"whole model: {held_bytes(dense)} B -> {held_bytes(quantized)} B")
    # the native pack: per block of 32 weights, 32 int8 + an fp32 d + an fp32 sum (10 bits a weight,
    # against bf16's 16); the biases stay as loaded
    weights = sum(m.experts_gate_up.numel() + m.experts_down.numel() for m in moe_layers(dense))
    biases = sum(2 * (m.experts_gate_up_bias.numel() + m.experts_down_bias.numel()) for m in moe_layers(dense))
    assert (d_bytes, q_bytes) == (2 * weights + biases, weights * 40 // 32 + biases)
    assert held_bytes(dense) - held_bytes(quantized) == d_bytes - q_bytes


def test_gpt_oss_served_with_q8_0_experts_gives_transformers_tokens_but_at_near_ties(native, gpt_oss_dirs,
                                                                                    prompts):  # noqa: F811
    """--quantization auto on an MXFP4 checkpoint serves its experts as Q8_0 (the plan says so);
    its greedy bf16 tokens are transformers' float32 tokens on the dequantized checkpoint (the same
    weights) but at near-ties, the bf16 test's bound. --quantization none keeps them dense."""
    mxfp4, dequantized = gpt_oss_dirs
    llm = LLM(model=str(mxfp4), dtype="bfloat16", num_kv_blocks=128)
    runtime = llm.engine.runtime
    assert all(moe_ops_native(runtime.model))
    plan = runtime.plan_report()
    assert "experts  x3   Q8_0 blocks per expert, native" in plan, plan
    assert "MoE experts: Q8_0 blocks per expert" in runtime.description
    assert_bf16_near_ties_only(llm, hf_model(dequantized), prompts, "gpt_oss")
    dense = LLM(model=str(mxfp4), dtype="bfloat16", num_kv_blocks=128, quantization="none")
    assert "experts  x3   dense bfloat16 stacks" in dense.engine.runtime.plan_report()


def moe_ops_native(model) -> list[bool]:
    from baton.model.moe_quant import moe_layers

    return [moe.expert_ops is not None and all(op.native for pair in moe.expert_ops for op in pair)
            for moe in moe_layers(model)]
