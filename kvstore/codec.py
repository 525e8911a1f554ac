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


# ---------------------------------------------------------------- a request's state layers' state
# The state of every state layer of a hybrid model (Gated DeltaNet, short conv) for one request, as
# the named tensors of its slot (baton.model.gated_deltanet.StatePool: "conv", "recurrent"), at the
# end of `tokens`. The kind names the state layers that made it: a state of another kind, shape or
# dtype is foreign (a miss for the reader), never resumed from.

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def encode_state(kind: str, token_ids: Sequence[int], tensors: dict[str, torch.Tensor]) -> bytes:
    """One request's state (its tensors, each [layers, ...] for one slot) -> bytes."""
    return msgpack.packb({
        "v": 1,
        "kind": kind,
        "tokens": list(token_ids),
        "tensors": {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                           "data": t.contiguous().view(torch.uint8).numpy().tobytes()}
                    for name, t in tensors.items()},
    }, use_bin_type=True)


def decode_state(value: bytes) -> tuple[str, list[int], dict[str, torch.Tensor]]:
    """bytes -> (kind, token ids, tensors). Raises ValueError for a value that is no well-formed state
    (untrusted like a block: the caller checks kind, tokens, shapes and dtypes against its own)."""
    payload = msgpack.unpackb(value, raw=False)
    if not isinstance(payload, dict) or payload.get("v") != 1 or not isinstance(payload.get("kind"), str):
        raise ValueError("not a Baton state")
    tokens, entries = payload.get("tokens"), payload.get("tensors")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise ValueError("its tokens are not a list of ints")
    if not isinstance(entries, dict):
        raise ValueError("its tensors are not a map")
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in entries.items():
        if not isinstance(entry, dict):
            raise ValueError(f"tensor {name!r} is not a map")
        dtype_name, shape, data = entry.get("dtype"), entry.get("shape"), entry.get("data")
        if dtype_name not in STATE_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {dtype_name!r} is not one of {', '.join(STATE_DTYPES)}")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
        dtype = STATE_DTYPES[dtype_name]
        if not isinstance(data, bytes) or len(data) != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {name!r}: wrong number of bytes for {dtype_name} {shape}")
        tensors[name] = (torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
                         if data else torch.empty(shape, dtype=dtype))
    return payload["kind"], list(tokens), tensors


def state_mismatch(kind: str, tensors: dict[str, torch.Tensor], expected_kind: str,
                   expected: dict[str, tuple[list[int], torch.dtype]]) -> str | None:
    """Why a decoded state cannot resume this model's state layers (None: it can)."""
    if kind != expected_kind:
        return f"kind {kind!r}, expected {expected_kind!r}"
    if set(tensors) != set(expected):
        return f"tensors {sorted(tensors)}, expected {sorted(expected)}"
    for name, (shape, dtype) in expected.items():
        t = tensors[name]
        if list(t.shape) != list(shape) or t.dtype != dtype:
            return f"{name} {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)}"
    return None
