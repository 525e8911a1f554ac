"""The model's attention paths agree with each other and with the reference kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton.config import ModelConfig
from baton.model import Attention


def make_config() -> ModelConfig:
    return ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=6,
                       num_kv_heads=2, head_dim=16)


def test_grouped_decode_attention_equals_sdpa():
    torch.manual_seed(0)
    attention = Attention(make_config(), 0)
    batch, length = 5, 37
    q = torch.randn(batch, 6, 16)
    k = torch.randn(batch, 2, length, 16)
    v = torch.randn(batch, 2, length, 16)
    lengths = torch.tensor([1, 7, 16, 30, 37])
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).view(batch, 1, 1, length)
    expected = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=attention.scale,
                                              enable_gqa=True).squeeze(2)
    got = attention._decode_attention_grouped(q, k, v, mask)
    assert torch.allclose(got, expected, atol=1e-5)
    # padding beyond a request's length never leaks in: changing it changes nothing
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 1:] = 100.0
    v2[0, :, 1:] = -100.0
    assert torch.allclose(attention._decode_attention_grouped(q, k2, v2, mask)[0], got[0], atol=1e-6)


def test_bf16_decode_path_close_to_fp32():
    torch.manual_seed(1)
    attention = Attention(make_config(), 0)
    q, k, v = torch.randn(3, 6, 16), torch.randn(3, 2, 20, 16), torch.randn(3, 2, 20, 16)
    mask = torch.ones(3, 1, 1, 20, dtype=torch.bool)
    fp32 = attention._decode_attention_grouped(q, k, v, mask)
    bf16 = attention._decode_attention_grouped(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert (bf16.float() - fp32).abs().max() < 0.05
