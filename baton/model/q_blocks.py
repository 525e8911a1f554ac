"""Weights to GGUF's block forms, llama.cpp's reference quantizations: Q8_0 (w = d * q per block of
32) and Q4_1 (w = d * q + m). Apart from `quant.py` so that the GGUF loader (which requantizes types
no kernel reads) and the load-time quantizer both use them without importing each other."""

from __future__ import annotations

import torch

from baton.model.linear import Q8_BLOCK

__all__ = ["quantize_q4", "quantize_q8_0"]


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


def quantize_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (K % 32 == 0) -> (q [N, K] uint8 in 0..15, d, m [N, K/32] fp32), w ~ d * q + m per
    block of 32 (llama.cpp's Q4_1 reference: m the block's minimum, d its range / 15; d and m are
    rounded to fp16 first, as they are stored, and q against those)."""
    n, k = weight.shape
    if k % Q8_BLOCK:
        raise ValueError(f"int4 needs the input size to be a multiple of {Q8_BLOCK}, not {k}")
    blocks = weight.detach().float().reshape(n, k // Q8_BLOCK, Q8_BLOCK)
    low, high = blocks.amin(-1), blocks.amax(-1)
    d = ((high - low) / 15.0).to(torch.float16).float()
    m = low.to(torch.float16).float()
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = ((blocks - m.unsqueeze(-1)) * inverse.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), d, m
