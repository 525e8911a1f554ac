"""A quantized KV cache (`--kv-cache-dtype int8 | fp8`): half the KV memory, half the bytes a
handoff moves through the block store.

Each (token, kv head) row of K or V is stored as `head_dim` one-byte codes followed by its scale,
an fp32 in 4 bytes (`kvstore.codec.KV_SCALE_BYTES`): the row's absolute maximum maps to the code
range's end (int8: 127, symmetric; fp8 e4m3: 448), so an outlier in one head or token costs
precision only there. This is llama.cpp's `--cache-type-k q8_0` idea at a head's granularity
(one scale per head row, not per 32 values: a head is the unit attention reads), and finer than
vLLM's fp8 cache, whose scale is one per layer (1.0 uncalibrated), where a large K bias
(Qwen2's) saturates e4m3's range. With head_dim 64 a row is 68 bytes instead of bf16's 128.

The cache tensor keeps one dtype per format (`torch.int8` or `torch.float8_e4m3fn`, with
head_dim + 4 in the last dimension), so a block carries its format in its dtype: the codec
records it, and a worker of another format converts a block it reads (`convert_rows`).

The native decode kernels read and write these rows in place (`kernels/paged_attention.cpp`:
`paged_decode`, `rope_write_decode`); the torch path (`PagedAttention`) gathers them as bytes,
multiplies the codes in decode and dequantizes them for prefill chunks.
"""

from __future__ import annotations

import torch

from kvstore.codec import KV_SCALE_BYTES, QUANTIZED_KV_DTYPES

# --kv-cache-dtype -> the cache's dtype (None: the model's own dtype)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}
_CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype `--kv-cache-dtype name` asks for, for a model computing in `model_dtype`."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED_KV_DTYPES


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements in the last dimension of a cache row of this dtype."""
    return head_dim + KV_SCALE_BYTES if is_quantized(dtype) else head_dim


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., d] (any float dtype) -> rows [..., d + 4] of `dtype` (codes, then the fp32 scale's bytes)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)  # [..., 1]
    scale = torch.where(amax > 0, amax / _CODE_MAX[dtype], torch.ones_like(amax))
    scaled = xf / scale
    if dtype == torch.int8:
        codes = scaled.round_().clamp_(-127.0, 127.0).to(torch.int8)
    else:
        codes = scaled.clamp_(-448.0, 448.0).to(dtype).view(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], dim=-1).view(dtype)


def split_rows(rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., d + 4] of a quantized dtype -> (codes [..., d] in `dtype`, scales [..., 1] fp32).
    The codes are exact in bf16 (int8's integers and e4m3's values fit its 8-bit mantissa), so
    attention can multiply them as they are and apply the scales to the much smaller scores."""
    d = rows.shape[-1] - KV_SCALE_BYTES
    raw = rows.view(torch.int8)
    scale = raw[..., d:].contiguous().view(torch.float32)  # [..., 1]
    codes = raw[..., :d] if rows.dtype == torch.int8 else raw[..., :d].view(rows.dtype)
    return codes.to(dtype), scale


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rows [..., d + 4] of a quantized dtype -> [..., d] in `dtype`."""
    codes, scale = split_rows(rows, torch.float32)
    return (codes * scale).to(dtype)


def convert_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of any cache format [..., d or d + 4] -> the same values in the cache format `dtype`."""
    if rows.dtype == dtype:
        return rows
    if is_quantized(rows.dtype):
        rows = dequantize_rows(rows, torch.float32)
    return quantize_rows(rows, dtype) if is_quantized(dtype) else rows.to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A one-byte view (torch has no index_select / index_copy_ for float8 on the CPU)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
