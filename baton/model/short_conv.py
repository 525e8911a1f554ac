"""LFM2's gated short convolution: a state layer whose memory per request is its causal conv's last
`L_cache - 1` inputs, as transformers' modeling_lfm2.py (`Lfm2ShortConv`, its torch
`causal_conv1d_*` fallbacks) computes it: in_proj to B, C, x; B * x through a depthwise causal conv
(no activation); C times that; out_proj.

The state lives in the runner's `StatePool` like the Gated DeltaNet's conv state (no recurrent
state: `ShortConvDims.recurrent_shape` is ()); rows continue from their slots the same way
(`StateMeta`: decode rows together, each prefill span from its slot), so a prompt split over steps
computes what one call over the whole prompt does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from baton.model.gated_deltanet import DeltaNetDims, StateMeta, StatePool, after_step, decode_conv
from baton.model.mamba2 import Mamba2Dims
from baton.model.model import set_op


@dataclass(frozen=True)
class ShortConvDims:
    """A short-conv layer's sizes (config.json's `hidden_size`, `conv_L_cache`, `conv_bias`)."""

    hidden_size: int
    conv_kernel: int
    bias: bool
    layout: str = "short_conv"

    @property
    def conv_dim(self) -> int:
        return self.hidden_size

    @property
    def recurrent_shape(self) -> tuple[int, ...]:
        return ()


def state_dims(spec: dict[str, Any]) -> DeltaNetDims | ShortConvDims | Mamba2Dims:
    """The state layers' sizes from `ModelConfig.deltanet` (its `layout` says which kind)."""
    layout = spec.get("layout")
    if layout == "mamba2":
        return Mamba2Dims(**spec)
    return ShortConvDims(**spec) if layout == "short_conv" else DeltaNetDims(**spec)


class ShortConv(nn.Module):
    def __init__(self, dims: ShortConvDims, state_index: int) -> None:
        super().__init__()
        self.dims = dims
        self.state_index = state_index  # this layer's index in the state pool
        h = dims.hidden_size
        self.in_proj = nn.Linear(h, 3 * h, bias=dims.bias)
        # depthwise: weight [H, 1, L_cache] (the checkpoint's nn.Conv1d, its forward unused)
        self.conv = nn.Conv1d(h, h, dims.conv_kernel, groups=h, bias=dims.bias)
        self.out_proj = nn.Linear(h, h, bias=dims.bias)
        set_op(self, "in_op", self.in_proj)  # through ops: packed or quantized (`projection_slots`)
        set_op(self, "out_op", self.out_proj)

    def projection_slots(self) -> list[tuple[nn.Module, str, nn.Linear]]:
        return [(self, "in_op", self.in_proj), (self, "out_op", self.out_proj)]

    def forward(self, x: torch.Tensor, pool: StatePool, meta: StateMeta) -> torch.Tensor:
        # x: [T, H] -> [T, H]; the rows' conv states in `pool` are read and advanced
        h, keep = self.dims.hidden_size, self.dims.conv_kernel - 1
        b, c, v = self.in_op(x).chunk(3, dim=-1)
        bx = b * v  # [T, H]: the conv's input
        states = pool.conv[self.state_index]  # [slots, H, keep]
        weight, bias = self.conv.weight, self.conv.bias
        out = torch.empty_like(bx)
        for step in meta.steps():
            out[step.rows] = decode_conv(states, step.slots, bx[step.rows], weight, bias)
            after_step(pool, self.state_index, step)
        for start, length, slot in meta.spans:
            end = start + length
            window = torch.cat([states[slot], bx[start:end].T], dim=-1).to(weight.dtype)  # [H, keep + L]
            states[slot] = window[:, window.shape[1] - keep:].to(states.dtype)
            out[start:end] = F.conv1d(window[None], weight, bias, groups=h)[0].T.to(bx.dtype)
        return self.out_op(c * out)
