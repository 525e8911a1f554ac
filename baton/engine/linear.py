"""The matmul behind each projection, chosen once at load time.

bf16 on the CPU: `F.linear` hands oneDNN a plain row-major weight, which it reorders on every call
for small M; at M = 1 it streams weights at ~5-10 GB/s. Reordering the weight once into oneDNN's
blocked layout (`mkldnn._reorder_linear_weight`, what Inductor's weight freezing does) and calling
`mkldnn._linear_pointwise` is 1.5-2.5x faster at M = 1, 16 and 64 on every SmolLM2 shape (measured
on Sapphire Rapids, 1 thread: lm_head at M = 1 5.8 -> 2.3 ms; see docs/performance.md).

Every fast path has a fallback: the packed op is used only where oneDNN is built in, the weight is
bf16 on the CPU, and a probe multiplication equals `F.linear`'s; otherwise (float32 parity, CUDA,
builds without oneDNN) the plain `nn.Linear` is the op.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("baton.engine.linear")

LinearOp = Callable[[torch.Tensor], torch.Tensor]  # [..., in] -> [..., out]

PACK_BATCH_HINT = 64  # oneDNN picks its blocking for this M; measured flat across M = 1..64


class PackedLinear:
    """A bf16 projection with its weight prepacked for oneDNN (the original weight is not touched)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        # weight: [out, in] bf16 on the CPU; bias: [out] or None
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        self.bias = bias.detach() if bias is not None else None
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packing_supported(weight: torch.Tensor) -> bool:
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def make_linear_op(linear: nn.Linear, fast: bool = True) -> LinearOp:
    """The fastest correct op for this projection: a PackedLinear where it is supported and its
    probe output equals F.linear's, else the module itself."""
    weight, bias = linear.weight, linear.bias
    if not fast or not packing_supported(weight):
        return linear
    try:
        op = PackedLinear(weight, bias)
        with torch.inference_mode():
            probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
            expected = F.linear(probe, weight, bias).float()
            got = op(probe).float()
        if not torch.allclose(got, expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()) + 1e-3):
            logger.warning("prepacked bf16 matmul disagrees with F.linear for %s: using F.linear",
                           tuple(weight.shape))
            return linear
        return op
    except (RuntimeError, AttributeError) as exc:  # a torch build without the op: plain F.linear
        logger.warning("prepacked bf16 matmul unavailable (%s): using F.linear", exc)
        return linear
