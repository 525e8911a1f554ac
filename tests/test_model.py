"""The model's attention paths, matmul ops and tables agree with each other and with the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from baton.model.attention import DecodeGroup, PagedAttention, group_by_context
from baton.model.config import ModelConfig
from baton.model.linear import PackedLinear, make_linear_op, packing_supported
from baton.model.model import apply_rope, rope_inv_freq, rope_table

BLOCK = 4


def make_config() -> ModelConfig:
    return ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=6,
                       num_kv_heads=2, head_dim=16, max_position_embeddings=64)


def paged_case(lengths: list[int], dtype: torch.dtype, seed: int = 0):
    """A paged cache holding one context per request in scattered blocks, the queries, and the
    same contexts as dense tensors for the reference."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, d = 6, 2, 16
    num_blocks = 1 + sum(-(-n // BLOCK) for n in lengths) + 3
    cache = torch.randn(2, kv_heads, num_blocks * BLOCK, d, generator=gen).to(dtype)  # garbage everywhere
    order = torch.randperm(num_blocks - 1, generator=gen).tolist()
    free = [b + 1 for b in order]  # block 0 is reserved
    tables, dense = [], []
    for n in lengths:
        table = [free.pop() for _ in range(-(-n // BLOCK))]
        tables.append(table)
        k = torch.randn(kv_heads, n, d, generator=gen).to(dtype)
        v = torch.randn(kv_heads, n, d, generator=gen).to(dtype)
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        cache[0][:, slots] = k
        cache[1][:, slots] = v
        dense.append((k, v))
    q = torch.randn(len(lengths), heads, d, generator=gen).to(dtype)
    width = max(len(t) for t in tables)
    ids = [b for t in tables for b in t + [0] * (width - len(t))]
    mask = torch.arange(width * BLOCK).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    group = DecodeGroup(0, len(lengths), width, torch.tensor(ids), torch.tensor(lengths),
                        bias.view(1, len(lengths), 1, -1), mask.view(len(lengths), 1, 1, -1))
    return cache, q, group, dense


def reference(q: torch.Tensor, dense) -> torch.Tensor:
    # each request alone, unpadded, in fp32: [B, heads, d]
    out = []
    for row, (k, v) in enumerate(dense):
        o = F.scaled_dot_product_attention(q[row:row + 1].float().unsqueeze(2), k.float().unsqueeze(0),
                                           v.float().unsqueeze(0), scale=16**-0.5, enable_gqa=True)
        out.append(o.squeeze(2))
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_equals_unpadded_reference(dtype):
    lengths = [1, 7, 16, 30, 37]
    cache, q, group, dense = paged_case(lengths, dtype)
    backend = PagedAttention(6, 2, 16)
    got = backend.decode(q, cache, group, BLOCK).float()
    expected = reference(q, dense)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got - expected).abs().max() < tolerance
    # what sits in padding and in other requests' blocks never leaks in
    cache2 = cache.clone()
    cache2[:, :, :BLOCK] = 100.0  # block 0: the padding target
    assert torch.equal(backend.decode(q, cache2, group, BLOCK), backend.decode(q, cache, group, BLOCK))


def test_write_kv_lands_in_head_major_slots():
    backend = PagedAttention(6, 2, 16)
    cache = torch.zeros(2, 2, 8 * BLOCK, 16)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([5, 9, 30])

    class Meta:
        slot_mapping = slots

    backend.write_kv(cache, k, v, Meta)
    assert torch.equal(cache[0][:, slots].transpose(0, 1), k)
    assert torch.equal(cache[1][:, slots].transpose(0, 1), v)
    assert torch.isclose(cache.abs().sum(), k.abs().sum() + v.abs().sum())  # nothing else written


def test_group_by_context_splits_only_when_padding_costs_more():
    # similar lengths: one group
    assert group_by_context([100, 110, 120, 128], 16) == [(0, 4)]
    # 63 short requests and one long one: the long one alone, the short ones not padded to it
    lengths = [20] * 63 + [4000]
    assert group_by_context(lengths, 16) == [(0, 63), (63, 1)]
    # groups are contiguous, cover every request once, in order
    lengths = sorted([16, 17, 40, 300, 310, 900, 2000, 2100, 5000])
    groups = group_by_context(lengths, 16)
    assert [s for s, _ in groups] == [sum(c for _, c in groups[:i]) for i in range(len(groups))]
    assert sum(c for _, c in groups) == len(lengths)
    assert group_by_context([], 16) == [] and group_by_context([5], 16) == [(0, 1)]


def test_rope_table_equals_the_reference_rotation():
    config = make_config()
    cos, sin_signed = rope_table(config, 64, torch.float32, "cpu")
    positions = torch.tensor([0, 3, 17, 63])
    inv_freq, _ = rope_inv_freq(config)
    freqs = positions.float().unsqueeze(-1) * inv_freq.unsqueeze(0)
    emb = torch.cat((freqs, freqs), dim=-1)
    ref_cos, ref_sin = emb.cos(), emb.sin()
    assert torch.equal(cos[positions], ref_cos)
    x = torch.randn(4, 3, 16)
    half = 8
    expected = x * ref_cos.unsqueeze(1) + torch.cat((-x[..., half:], x[..., :half]), -1) * ref_sin.unsqueeze(1)
    got = apply_rope(x, cos[positions].unsqueeze(1), sin_signed[positions].unsqueeze(1))
    assert torch.equal(got, expected)  # fp32: op for op the reference
    fast = apply_rope(x.bfloat16(), cos[positions].bfloat16().unsqueeze(1), sin_signed[positions].bfloat16().unsqueeze(1))
    assert (fast.float() - expected).abs().max() < 0.05  # bf16: the roll form


@pytest.mark.skipif(not packing_supported(torch.zeros(1, dtype=torch.bfloat16)), reason="no oneDNN in this torch")
def test_packed_linear_equals_f_linear():
    torch.manual_seed(0)
    linear = nn.Linear(576, 960, bias=True).to(torch.bfloat16)
    op = make_linear_op(linear)
    assert isinstance(op, PackedLinear)
    for rows in (1, 5, 64):
        x = torch.randn(rows, 576).to(torch.bfloat16)
        with torch.inference_mode():
            assert torch.allclose(op(x).float(), F.linear(x, linear.weight, linear.bias).float(), atol=0.05, rtol=0.01)


def test_fp32_and_cuda_like_cases_keep_the_plain_linear():
    linear = nn.Linear(8, 4)
    assert make_linear_op(linear) is linear  # fp32: the parity path
    bf16 = nn.Linear(8, 4).to(torch.bfloat16)
    assert make_linear_op(bf16, fast=False) is bf16
