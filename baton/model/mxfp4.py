"""MXFP4 expert weights (gpt-oss checkpoints, `quantization_config.quant_method == "mxfp4"`), dequantized.

A weight `W` is stored as `W_blocks` (uint8 [..., rows, G, 16]: 32 FP4 (e2m1) codes per group, two
per byte, the low nibble first) and `W_scales` (uint8 [..., rows, G]: one power-of-two exponent per
group of 32, biased by 127). `dequantize` follows transformers' `convert_moe_packed_tensors`
(transformers/integrations/mxfp4.py) exactly, including its final transpose of the last two
dimensions: the result is the layout gpt-oss's unquantized checkpoints store ([E, H, 2I] for
gate_up_proj, [E, I, H] for down_proj).

`repack_q8_0` rewrites the blocks as Q8_0 (32 int8 + one fp32 scale) without loss: an FP4 value v is
one of 0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6, so q = 2v is an integer in [-12, 12], and d = 2^(e - 127) / 2
is exact in fp32 (2^-128 a subnormal, still exact): d * q is the dequantized weight, bit for bit. The
native Q8_0 kernel (kernels/qgemv.cpp, via baton.model.linear.QuantizedLinear) then multiplies gpt-oss's
experts in 10 bits a weight (the pack's int8, fp32 scale and fp32 sum per 32) instead of bf16's 16
(`baton.model.mxfp4_experts`); where it
does not run (`--quantization none`, `--dtype float32` with auto, no kernel) the dequantized weights
are served, in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

# the 16 FP4 (e2m1) values, by code
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks: uint8 [E, rows, G, B]; scales: uint8 [E, rows, G] -> [E, G * B * 2, rows] in `dtype`."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    *prefix, groups, width = blocks.shape
    blocks = blocks.to(torch.uint8).reshape(-1, width)
    exponents = (scales.to(torch.int32) - 127).reshape(-1, 1)
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    out = torch.empty(blocks.shape[0], width * 2, dtype=dtype)
    out[:, 0::2] = lut[(blocks & 0x0F).to(torch.int)]
    out[:, 1::2] = lut[(blocks >> 4).to(torch.int)]
    torch.ldexp(out, exponents, out=out)
    out = out.reshape(*prefix, groups, width * 2).view(*prefix, groups * width * 2)
    return out.transpose(1, 2).contiguous()


# 2 * FP4_VALUES: the Q8_0 integer of each code (-0.0 is 0)
Q8_CODES = tuple(int(2 * v) for v in FP4_VALUES)


def repack_q8_0(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks: uint8 [E, rows, G, 16]; scales: uint8 [E, rows, G] -> (q int8 [E, rows, G * 32],
    d fp32 [E, rows, G]) with d * q == dequantize(blocks, scales, fp32).transpose(1, 2) exactly.
    `rows` are the weight's outputs and the blocks run along its inputs, so [rows, G * 32] is already
    F.linear's [out, in] (transformers' transpose in `dequantize` makes it input-major; not here)."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    *prefix, groups, width = blocks.shape
    blocks = blocks.to(torch.uint8)
    lut = torch.tensor(Q8_CODES, dtype=torch.int8)
    q = torch.empty(*prefix, groups, width, 2, dtype=torch.int8)  # [..., G, 16, 2]: low nibble first
    q[..., 0] = lut[(blocks & 0x0F).to(torch.int)]
    q[..., 1] = lut[(blocks >> 4).to(torch.int)]
    # d = 2^(e - 127) / 2 = 2^(e - 128): the 0.5 folded into the exponent, exact in fp32
    d = torch.ldexp(torch.ones(scales.shape, dtype=torch.float32), scales.to(torch.int32) - 128)
    return q.reshape(*prefix, groups * width * 2), d


class DequantizedView(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors with every `X_blocks` + `X_scales` pair read as `X`, dequantized on access
    to `dtype` (one weight at a time, so loading holds one dequantized copy beyond the model)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.tensors, self.dtype = tensors, dtype
        self.packed = {name.removesuffix(BLOCKS) for name in tensors
                       if name.endswith(BLOCKS) and name.removesuffix(BLOCKS) + SCALES in tensors}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.packed:
            return dequantize(self.tensors[name + BLOCKS], self.tensors[name + SCALES], self.dtype)
        if name.removesuffix(BLOCKS) in self.packed or name.removesuffix(SCALES) in self.packed:
            raise KeyError(name)  # a half of a packed weight is not a tensor of its own
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        for name in self.tensors:
            if name.endswith(BLOCKS) and name.removesuffix(BLOCKS) in self.packed:
                yield name.removesuffix(BLOCKS)
            elif not (name.endswith(SCALES) and name.removesuffix(SCALES) in self.packed):
                yield name

    def __len__(self) -> int:
        return len(self.tensors) - len(self.packed)

    def __contains__(self, name: object) -> bool:
        if name in self.packed:
            return True
        if isinstance(name, str) and (name.removesuffix(BLOCKS) in self.packed
                                      or name.removesuffix(SCALES) in self.packed):
            return False
        return name in self.tensors


def has_packed(tensors: Mapping[str, torch.Tensor]) -> bool:
    return any(name.endswith(BLOCKS) and name.removesuffix(BLOCKS) + SCALES in tensors for name in tensors)
