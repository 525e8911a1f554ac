"""MXFP4 expert weights (gpt-oss checkpoints, `quantization_config.quant_method == "mxfp4"`), dequantized.

A weight `W` is stored as `W_blocks` (uint8 [..., rows, G, 16]: 32 FP4 (e2m1) codes per group, two
per byte, the low nibble first) and `W_scales` (uint8 [..., rows, G]: one power-of-two exponent per
group of 32, biased by 127). `dequantize` follows transformers' `convert_moe_packed_tensors`
(transformers/integrations/mxfp4.py) exactly, including its final transpose of the last two
dimensions: the result is the layout gpt-oss's unquantized checkpoints store ([E, H, 2I] for
gate_up_proj, [E, I, H] for down_proj).

Baton serves the dequantized weights (in the model's dtype); running the 4-bit blocks natively is
not done here.
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
