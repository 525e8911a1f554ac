"""Quantized projections: int8 weights in GGUF's Q8_0 form (blocks of 32 along the input, one scale
each: w = d * q), multiplied by the native kernel (`kernels/qgemv.cpp`, AVX512-VNNI integer dot
products against activations quantized per block, as llama.cpp multiplies Q8_0).

`quantize_model(model, "int8")` replaces each dense projection's op (q|k|v, o, gate|up, down; MoE
experts stay in the model's dtype) and the LM head's by a `Q8Linear` and frees the bf16/fp32 weight it replaced, so that each weight lives
once in memory, quantized. The token embedding stays in the model's dtype (a lookup reads one row
per token; it is the LM head's weight too when the two are tied, and the head's quantized copy is
then the only other one).

Where the kernel cannot run (no AVX512-VNNI, or native kernels off), `Q8Linear` dequantizes its
weight for each call and multiplies in the activations' dtype: correct, and slow; `quantize_model`
says so in the log once. The quantized weight is the same either way.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from baton.engine.layers_plan import LayersPlan
from baton.engine.linear import Q8_BLOCK, Q8Linear
from baton.engine.model import set_op

logger = logging.getLogger("baton.engine.quant")

QUANTIZATIONS = ("none", "int8")


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (K % 32 == 0) -> (q [N, K] int8 in [-127, 127], d [N, K/32] fp32), w ~ d * q per
    block of 32 (round to nearest: llama.cpp's Q8_0 reference quantization)."""
    n, k = weight.shape
    if k % Q8_BLOCK:
        raise ValueError(f"int8 needs the input size to be a multiple of {Q8_BLOCK}, not {k}")
    blocks = weight.detach().float().reshape(n, k // Q8_BLOCK, Q8_BLOCK)
    d = blocks.abs().amax(-1) / 127.0
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = (blocks * inverse.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k), d


def quantize_model(model: nn.Module, quantization: str, kernels: Any = None) -> int:
    """Quantize `model`'s projections in place (after `prepare()`); returns the bytes of the
    quantized weights. `kernels`: the native module (None: `baton.engine.kernels.load()`)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {quantization!r}")
    if quantization == "none":
        return 0
    if kernels is None:
        from baton.engine import kernels as native

        kernels = native.load()
    if kernels is None or not kernels.q8_available():
        logger.warning("int8 weights without the native int8 kernel (it needs AVX512-VNNI and a compiler): "
                       "each projection dequantizes its weight per call, which is slow")
    tied = model.lm_head.weight is model.embed_tokens.weight
    total = 0
    # dense projections only: MoE experts keep the model's dtype (no batched-by-expert int8 yet)
    for owner, name, linear in model.projection_slots():
        q, d = quantize_q8_0(linear.weight)
        op = Q8Linear(q, d, linear.bias, kernels)
        set_op(owner, name, op)
        total += op.nbytes
        if not (tied and linear is model.lm_head):
            # the only copy now is the quantized one (the tied embedding keeps its weight: lookups)
            linear.weight = nn.Parameter(torch.empty(0, dtype=linear.weight.dtype), requires_grad=False)
    # the all-layers native decode call, rebuilt over the int8 packs (None where it cannot run them)
    model.layers_plan = LayersPlan.build(model, kernels) if model.layers_plan is not None else None
    return total
