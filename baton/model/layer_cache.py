"""A paged KV cache whose layers have shapes of their own (Gemma 4's sliding and full layers:
docs/design-decisions.md, decision 29).

The cache is one flat tensor: each cached layer's `[2, kv_heads_i, slots, row_i]` (row_i: its
head_dim, plus the scale bytes of a quantized row) packed after the previous layer's, so a layer
reads and writes a contiguous tensor of its own shape, as every other family's layer does, and no
slot carries padding. A block leaves and enters the cache (`read_block` / `write_block`: the block
store, the handoff codec, prefix caching) in the uniform form every family's blocks have,
`[cached layers, 2, block_size, max kv_heads, max head_dim (+ 4)]`, each layer's rows zero-padded,
a quantized row's scale at the padded row's end (what quantizing the zero-padded row gives), so a
block converts to any cache format (`kv_quant.convert_rows`) and the store and codec are unchanged.
"""

from __future__ import annotations

import torch

from baton.model.config import ModelConfig
from baton.model.kv_quant import KV_SCALE_BYTES, as_bytes, convert_rows, is_quantized, row_width


def layer_shapes(config: ModelConfig, dtype: torch.dtype) -> list[tuple[int, int, int]]:
    """(kv_heads, head_dim, row width) of each cached layer, in cache order."""
    return [(config.layer_kv_heads[i], config.layer_head_dim[i], row_width(config.layer_head_dim[i], dtype))
            for i in config.attention_layers]


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return sum(2 * block_size * heads * width for heads, _, width in layer_shapes(config, dtype)) * dtype.itemsize


def allocate(config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The flat cache of `num_slots` slots per layer (zeros), in `dtype`."""
    numel = num_slots * sum(2 * heads * width for heads, _, width in layer_shapes(config, dtype))
    storage = torch.uint8 if dtype.itemsize == 1 else dtype
    return torch.zeros(numel, dtype=storage, device=device).view(dtype)


def layer_views(cache: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
    """Each cached layer's [2, kv_heads, slots, row] view of the flat cache, in cache order."""
    shapes = layer_shapes(config, cache.dtype)
    slots = cache.numel() // sum(2 * heads * width for heads, _, width in shapes)
    views, offset = [], 0
    for heads, _, width in shapes:
        n = 2 * heads * slots * width
        views.append(cache[offset:offset + n].view(2, heads, slots, width))
        offset += n
    return views


def read_block(cache: torch.Tensor, config: ModelConfig, start: int, block_size: int) -> torch.Tensor:
    """Slots [start, start + block_size) of every cached layer in the uniform form (see the module
    docstring): [layers, 2, block_size, max kv_heads, max row], on the CPU, in the cache's dtype."""
    views = layer_views(cache, config)
    quantized = is_quantized(cache.dtype)
    width = row_width(config.head_dim, cache.dtype)
    out = torch.zeros(len(views), 2, block_size, config.num_kv_heads, width, dtype=torch.uint8 if
                      cache.dtype.itemsize == 1 else cache.dtype).view(cache.dtype)
    raw = as_bytes(out)
    for layer, (view, (heads, d, w)) in enumerate(zip(views, layer_shapes(config, cache.dtype))):
        rows = as_bytes(view)[:, :, start:start + block_size].transpose(1, 2).to("cpu")  # [2, bs, heads, w]
        if quantized:  # codes first, the scale at the padded row's end
            raw[layer, :, :, :heads, :d] = rows[..., :d]
            raw[layer, :, :, :heads, -KV_SCALE_BYTES:] = rows[..., d:]
        else:
            raw[layer, :, :, :heads, :w] = rows
    return out


def write_block(cache: torch.Tensor, config: ModelConfig, start: int, block_size: int, data: torch.Tensor) -> None:
    """`read_block`'s inverse; data in any cache format (converted to the cache's)."""
    rows_all = as_bytes(convert_rows(data.to(cache.device), cache.dtype))
    quantized = is_quantized(cache.dtype)
    for layer, (view, (heads, d, w)) in enumerate(zip(layer_views(cache, config), layer_shapes(config, cache.dtype))):
        rows = rows_all[layer, :, :, :heads]  # [2, bs, heads, max row]
        if quantized:
            rows = torch.cat([rows[..., :d], rows[..., -KV_SCALE_BYTES:]], dim=-1)
        as_bytes(view)[:, :, start:start + block_size] = rows[..., :w].transpose(1, 2)
