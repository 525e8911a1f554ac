"""The block codec: one KV block as bytes (its tokens, dtype, shape and raw data).

Every value carries its tokens, so a reader re-checks them on a hit, and its dtype and shape, so a
worker in another dtype converts. Values come from anyone who can write to Redis: `decode_block`
checks what it reads and raises ValueError for anything that is not a well-formed block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgpack
import torch


def encode_block(token_ids: Sequence[int], kv: torch.Tensor) -> bytes:
    """kv: [layers, 2, block_size, kv_heads, head_dim (+ 4 in a quantized format)] -> bytes (tokens,
    dtype, shape, raw data)."""
    kv = kv.contiguous()
    return msgpack.packb({
        "v": 1,
        "tokens": list(token_ids),
        "dtype": str(kv.dtype).removeprefix("torch."),
        "shape": list(kv.shape),
        "data": kv.view(torch.uint8).numpy().tobytes(),
    }, use_bin_type=True)


# The dtypes a block may hold (what a worker computes in, or a quantized cache's format: see
# baton.model.kv_quant); anything else is no KV of ours.
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}
# A quantized cache's row: head_dim one-byte codes, then an fp32 scale in this many bytes.
QUANTIZED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)
KV_SCALE_BYTES = 4


def logical_shape(kv: torch.Tensor) -> list[int]:
    """A block's [layers, 2, block_size, kv_heads, head_dim], whatever format holds it (a quantized
    row is head_dim codes plus its scale's bytes)."""
    shape = list(kv.shape)
    if kv.dtype in QUANTIZED_KV_DTYPES and shape:
        shape[-1] -= KV_SCALE_BYTES
    return shape


def decode_block(value: bytes) -> tuple[list[int], torch.Tensor]:
    """bytes -> (token ids, kv [layers, 2, block_size, kv_heads, head_dim]). Raises ValueError for
    a value that is no well-formed block: anyone who can write to Redis can write this key, so the
    dtype, the shape and the byte length are checked, not trusted (the caller checks the shape
    against its own model's)."""
    payload = msgpack.unpackb(value, raw=False)
    if not isinstance(payload, dict) or payload.get("v") != 1:
        raise ValueError("not a Baton KV block")
    tokens, name, shape, data = (payload.get(k) for k in ("tokens", "dtype", "shape", "data"))
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise ValueError("its tokens are not a list of ints")
    if name not in KV_DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(KV_DTYPES)}")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise ValueError(f"shape {shape!r} is not a list of sizes")
    dtype = KV_DTYPES[name]
    if dtype in QUANTIZED_KV_DTYPES and (not shape or shape[-1] <= KV_SCALE_BYTES):
        raise ValueError(f"shape {shape!r} has no room for a quantized row's scale")
    if not isinstance(data, bytes) or len(data) != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"{len(data) if isinstance(data, bytes) else type(data).__name__} bytes of data "
                         f"for {name} {shape}")
    if not data:
        return list(tokens), torch.empty(shape, dtype=dtype)
    return list(tokens), torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
