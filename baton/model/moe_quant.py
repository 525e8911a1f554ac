"""MoE experts on the native Q8_0 kernel: each expert's gate_up and down a `QuantizedLinear`.

Two ways in. gpt-oss's MXFP4 experts are repacked at load, without loss and without a dense detour
(`baton.model.mxfp4.repack_q8_0`: the FP4 codes doubled are int8, the power-of-two scale halved is an
exact fp32 d), when `repacks_mxfp4_experts` says so: on the CPU, unless --quantization none, or
--dtype float32 with auto (float32 asks for transformers' numbers: the native kernel quantizes the
activations per block of 32), or auto where no native kernel runs (dequantizing per call would be
slower than the dense weights). Any other MoE's dense experts are quantized to Q8_0 under
--quantization int8 and int4 (`quantize_dense_experts`: the experts stay 8-bit under int4, as the
head does: no batched 4-bit expert path is measured yet). Either way the dense stacks are freed:
the quantized copy is the only one (a Q8_0 block: 32 int8 and one fp32 scale; the native pack adds
one fp32 sum per block: 40 bytes per 32 weights, 10 bits a weight against bf16's 16 and MXFP4's 4.25;
an MXFP4-native kernel would bring gpt-oss-20b's experts from ~24 GB to ~10 GB: not done yet).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from baton.common.model_files import gguf_source
from baton.model.gguf_checkpoint import open_reader
from baton.model.gguf_gpt_oss import has_mxfp4
from baton.model.linear import QuantizedLinear
from baton.model.moe import SparseMoE
from baton.model.q_blocks import quantize_q8_0


def repacks_mxfp4_experts(quantization: str, requested_dtype: str, device: torch.device, kernels: Any) -> bool:
    """Whether the loader serves a checkpoint's MXFP4 experts as Q8_0 blocks (else dequantized)."""
    if device.type != "cpu" or quantization == "none":
        return False
    if quantization == "auto":
        native = kernels is not None and kernels.q8_available()
        return native and requested_dtype not in ("float32", "fp32")
    return True


def moe_layers(model: nn.Module) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def quantize_dense_experts(model: nn.Module, kernels: Any) -> int:
    """Each MoE's dense experts to Q8_0 ops, one expert at a time, the dense stacks freed after each
    layer; MoEs already quantized (MXFP4 repacked at load) are left. Returns the MoEs quantized."""
    done = 0
    for moe in moe_layers(model):
        if moe.expert_ops is not None:
            continue
        gate_up, down = moe.experts_gate_up, moe.experts_down  # [E, 2I, H], [E, H, I]
        ops = [[QuantizedLinear.q8_0(*quantize_q8_0(w[e]), None, kernels) for e in range(w.shape[0])]
               for w in (gate_up, down)]
        moe.use_quantized_experts(*ops)
        done += 1
    return done


def experts_words(moe: SparseMoE) -> str:
    """How a MoE's experts run, in words (`baton plan`)."""
    if moe.expert_ops is None:
        assert moe.experts_gate_up is not None
        return f"dense {str(moe.experts_gate_up.dtype).removeprefix('torch.')} stacks, torch F.linear per expert"
    op = moe.expert_ops[0][0]
    how = f"native {op.isa} integer dot products" if op.native else "dequantized per call"
    return f"Q8_0 blocks per expert, {how}"


def experts_tensors(moe: SparseMoE) -> list[torch.Tensor | None]:
    """Every tensor a MoE's experts hold (weights, packs, biases), for the byte count."""
    tensors: list[torch.Tensor | None] = [moe.experts_gate_up, moe.experts_down,
                                          moe.experts_gate_up_bias, moe.experts_down_bias]
    for pair in moe.expert_ops or ():
        for op in pair:
            tensors += [op.packed, *op.parts, op.bias]
    return tensors


def mxfp4_checkpoint(model_dir: Path) -> bool:
    """Whether the checkpoint says its weights are MXFP4 (gpt-oss's `quantization_config`), or the GGUF
    it was made from holds MXFP4 tensors (llama.cpp's gpt-oss files)."""
    config = json.loads((model_dir / "config.json").read_text())
    if (config.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        return True
    source = gguf_source(model_dir)
    return source is not None and has_mxfp4(open_reader(source))


def mxfp4_experts_plan(model_dir: Path, quantization: str, requested_dtype: str, device: torch.device,
                       native_kernels: bool) -> tuple[bool, Any]:
    """For the loader: (whether MXFP4 experts load as Q8_0 ops, the native module to pack them with)."""
    if device.type != "cpu" or quantization == "none" or not mxfp4_checkpoint(model_dir):
        return False, None
    kernels = None
    if native_kernels:
        from baton.model import kernels as native

        kernels = native.load()
    return repacks_mxfp4_experts(quantization, requested_dtype, device, kernels), kernels


def experts_description(model: nn.Module) -> str | None:
    """The start-up line's words on quantized MoE experts (None: dense, or no MoE)."""
    quantized = [moe for moe in moe_layers(model) if moe.expert_ops is not None]
    return f"MoE experts: {experts_words(quantized[0])}" if quantized else None
