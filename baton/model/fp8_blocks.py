"""Block-wise FP8 weights (`quantization_config.quant_method == "fp8"`: DeepSeek V3/R1, Qwen3 "-FP8",
GLM-4.5-FP8, MiniMax ...), dequantized at load.

A quantized weight `X.weight` (float8_e4m3fn, [..., N, K]) has a sibling `X.weight_scale_inv`
(float32, [..., ceil(N / bn), ceil(K / bk)], (bn, bk) the config's `weight_block_size`, (128, 128) when
it is not given, as transformers' FineGrainedFP8Config defaults): the weight is
`weight.float() * scale_inv[i // bn, j // bk]`, the last row and column of blocks partial where N or K
is not a multiple of the block (DeepSeek V3's kv_a_proj_with_mqa: 576 rows, 4.5 blocks). That is
transformers' `_dequantize_fp8_weight` (transformers/integrations/finegrained_fp8.py); its load-time
`Fp8Dequantize` computes the same product in float32 then casts to the model's dtype, as here, but
derives the block from the scale grid and so refuses partial edge blocks. A `weight_block_size` of
null means one scale per tensor. Tensors the checkpoint stores unquantized (norms, embeddings, the
router, `modules_to_not_convert`) have no scale and pass through; the checkpoint's names decide, so a
scale without its weight, or an FP8 weight without its scale, is refused by name.

Served as any dense checkpoint in the model's dtype: `--quantization int8/int4` requantize the
dequantized weights. Activations are not quantized (`activation_scheme` does not apply).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

SCALE = "_scale_inv"  # X.weight -> X.weight_scale_inv
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DEFAULT_BLOCK = (128, 128)  # transformers' FineGrainedFP8Config default


def fp8_quantization(model_dir: Path) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config` when it says block-wise FP8, else None."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    quantization = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config")
    if not quantization or quantization.get("quant_method") != "fp8":
        return None
    if quantization.get("expert_dtype", "fp8") != "fp8":  # DeepSeek V4's FP4-packed experts
        raise ValueError(f"FP8 checkpoint with expert_dtype {quantization['expert_dtype']!r}: only FP8 weights "
                         "are supported")
    return quantization


def block_size(quantization: Mapping[str, Any]) -> tuple[int, int] | None:
    """(rows, columns) of a scale's block; None: one scale per tensor."""
    if "weight_block_size" not in quantization:
        return DEFAULT_BLOCK
    block = quantization["weight_block_size"]
    if block is None:
        return None
    if len(block) != 2 or min(block) <= 0:
        raise ValueError(f"FP8 weight_block_size {block!r} is not two positive integers")
    return int(block[0]), int(block[1])


def scale_grid(shape: torch.Size, block: tuple[int, int] | None) -> tuple[int, ...]:
    """The scale shape a weight of `shape` has: one per (partial) block."""
    if block is None:
        return ()
    *prefix, rows, cols = shape
    return (*prefix, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype) -> torch.Tensor:
    """weight: FP8 [..., N, K]; scale: [..., ceil(N / bn), ceil(K / bk)] -> [..., N, K] in `dtype`,
    each element's product with its block's scale made in float32 (exact for the FP8 value, one
    rounding), then cast once."""
    w = weight.to(torch.float32, copy=True)
    s = scale.to(torch.float32)
    if block is None:
        return w.mul_(s.reshape(())).to(dtype)
    rows, cols = w.shape[-2:]
    # the scales expanded over rows only; over columns they broadcast through a view of the weight
    # (a weight-sized expansion of them would be a second fp32 copy)
    s = s.repeat_interleave(block[0], dim=-2)[..., :rows, :]  # [..., N, ceil(K / bk)]
    full, rem = divmod(cols, block[1])
    w[..., :full * block[1]].unflatten(-1, (full, block[1])).mul_(s[..., :full, None])
    if rem:  # the partial last column of blocks
        w[..., full * block[1]:].mul_(s[..., full:])
    return w.to(dtype)


class FP8BlocksView(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors with every `X.weight` + `X.weight_scale_inv` pair read as `X.weight`,
    dequantized on access to `dtype` (one weight at a time, so loading holds one dequantized copy
    beyond the model). Unpaired scales and unscaled FP8 weights are refused, by name, at once."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 quantization: Mapping[str, Any]) -> None:
        self.tensors, self.dtype = tensors, dtype
        self.block = block_size(quantization)
        self.ue8m0 = quantization.get("scale_fmt") == "ue8m0"
        scaled = {name.removesuffix(SCALE) for name in tensors if name.endswith(SCALE)}
        self.scaled = {name for name in scaled if name in tensors}
        problems = []
        orphans = sorted(name + SCALE for name in scaled - self.scaled)
        if orphans:
            problems.append(f"{len(orphans)} scale(s) without their weight: {', '.join(orphans)}")
        unscaled = sorted(name for name in tensors if name not in scaled and tensors[name].dtype in FP8_DTYPES)
        if unscaled:
            problems.append(f"{len(unscaled)} FP8 weight(s) without their scale (X{SCALE}): {', '.join(unscaled)}")
        not_fp8 = sorted(f"{name} ({str(tensors[name].dtype).removeprefix('torch.')})" for name in self.scaled
                         if tensors[name].dtype not in FP8_DTYPES)
        if not_fp8:
            problems.append(f"{len(not_fp8)} scaled weight(s) not in FP8: {', '.join(not_fp8)}")
        if problems:
            raise ValueError("FP8 checkpoint does not pair its weights and scales; " + "; ".join(problems))

    def _scale(self, name: str) -> torch.Tensor:
        scale = self.tensors[name + SCALE]
        if scale.dtype == torch.uint8 and self.ue8m0:  # ue8m0 scales stored as bytes: 2^(b - 127)
            scale = scale.view(torch.float8_e8m0fnu)
        if not scale.dtype.is_floating_point:
            raise ValueError(f"FP8 scale {name + SCALE} is {scale.dtype}, not a floating-point scale")
        weight_shape = self.tensors[name].shape
        expected = scale_grid(weight_shape, self.block)
        if scale.numel() != 1 if self.block is None else tuple(scale.shape) != expected:
            raise ValueError(f"FP8 scale {name + SCALE} is {tuple(scale.shape)}, but a weight of "
                             f"{tuple(weight_shape)} in blocks of {self.block or 'the whole tensor'} needs "
                             f"{expected or 'one scale'}")
        return scale

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.scaled:
            return dequantize(self.tensors[name], self._scale(name), self.block, self.dtype)
        if name.endswith(SCALE):
            raise KeyError(name)  # a weight's scale is not a tensor of its own
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return (name for name in self.tensors if not name.endswith(SCALE))

    def __len__(self) -> int:
        return len(self.tensors) - len(self.scaled)

    def __contains__(self, name: object) -> bool:
        return not (isinstance(name, str) and name.endswith(SCALE)) and name in self.tensors


def fp8_view(tensors: Mapping[str, torch.Tensor], model_dir: Path,
             dtype: torch.dtype) -> Mapping[str, torch.Tensor]:
    """`tensors` as the model's dtype sees them: an FP8 checkpoint's weights dequantized on access."""
    quantization = fp8_quantization(model_dir)
    return tensors if quantization is None else FP8BlocksView(tensors, dtype, quantization)


def describe_fp8(model_dir: Path) -> str | None:
    """For the start-up line: where the weights came from, if the checkpoint is FP8 blocks."""
    quantization = fp8_quantization(model_dir)
    if quantization is None:
        return None
    block = block_size(quantization)
    blocks = f"{block[0]}x{block[1]} blocks" if block is not None else "one scale a tensor"
    return f"the checkpoint's FP8 weights ({blocks}) dequantized at load"
