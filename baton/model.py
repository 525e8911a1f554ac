"""A Llama-architecture decoder in plain torch, with attention over a paged KV cache.

Selective batching (Orca): embeddings, norms, projections and the MLP run over every token of the
step flattened to `[T, H]`, whatever request it belongs to; only attention is split, each request
attending over its own KV blocks. Decode tokens (one query each) are attended in one padded batch;
each prefill chunk is attended on its own (there are few per step and they are long).

The KV cache is one tensor `[num_layers, 2, num_slots, num_kv_heads, head_dim]` where a slot is
`block_id * block_size + offset`. Block 0 is reserved and never allocated, so padding of gathers
points at slot 0 and is masked out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from baton.config import ModelConfig


@dataclass
class PrefillSpan:
    """One prefill chunk of a request inside the flattened step."""

    start: int  # first token of the chunk in the flattened batch
    length: int  # tokens in the chunk (queries)
    context_len: int  # tokens attended: already-computed prefix + this chunk
    gather_slots: torch.Tensor | None  # [context_len] slots; None when the chunk is the whole context
    mask: torch.Tensor | None  # [1, 1, length, context_len] bool, True = attend; None when causal


@dataclass
class AttentionMetadata:
    """Built once per step; every layer reuses it (Python work per layer is the enemy at batch 1)."""

    slot_mapping: torch.Tensor  # [T] slot each new token's K/V is written to
    num_decode_tokens: int  # the first Bd tokens of the step are decode tokens, one per request
    decode_gather: torch.Tensor | None  # [Bd, L] slots of each decode request's context, padded
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, L] bool, True = attend
    prefills: list[PrefillSpan]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]; computed in fp32 like the reference implementation
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the attention scaling, honouring rope_scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif rope_type not in ("default",):
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
    return inv_freq, 1.0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        # q, k and v fused into one matmul: one kernel launch instead of three per layer.
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,  # [T, head_dim]
        kv_cache: torch.Tensor,  # [2, num_slots, kv_heads, head_dim] (this layer's)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        cos_h, sin_h = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, head_dim]
        q = (q * cos_h + rotate_half(q) * sin_h).to(x.dtype)
        k = (k * cos_h + rotate_half(k) * sin_h).to(x.dtype)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)

        out = torch.empty_like(q)  # [T, heads, head_dim]
        num_decode = meta.num_decode_tokens
        if num_decode:
            # [Bd, heads, 1, d] against the padded context [Bd, kv_heads, L, d] of each request
            kd = k_cache[meta.decode_gather].transpose(1, 2)
            vd = v_cache[meta.decode_gather].transpose(1, 2)
            if x.dtype == torch.float32:
                # fp32 is the parity path: the same kernel the reference uses
                qd = q[:num_decode].unsqueeze(2)
                od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=self.scale,
                                                    enable_gqa=True)
                out[:num_decode] = od.squeeze(2)
            else:
                out[:num_decode] = self._decode_attention_grouped(q[:num_decode], kd, vd, meta.decode_mask)
        for span in meta.prefills:
            s, e = span.start, span.start + span.length
            qp = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
            if span.gather_slots is None:
                kp, vp = k[s:e], v[s:e]  # the chunk is the whole context: no cache read needed
            else:
                kp, vp = k_cache[span.gather_slots], v_cache[span.gather_slots]
            kp = kp.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, ctx, d]
            vp = vp.transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=span.mask, is_causal=span.mask is None, scale=self.scale, enable_gqa=True
            )
            out[s:e] = op.squeeze(0).transpose(0, 1)
        return self.o_proj(out.view(num_tokens, self.q_size))


    def _decode_attention_grouped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  mask: torch.Tensor) -> torch.Tensor:
        # q: [Bd, heads, d]; k, v: [Bd, kv_heads, L, d]; mask: [Bd, 1, 1, L] -> [Bd, heads, d]
        # On CPU, SDPA with a mask in bf16 falls back to a slow path (25x slower at batch 16 than
        # this): the query heads sharing a KV head are batched as rows of one matmul instead.
        batch, kv_heads = k.shape[0], self.num_kv_heads
        group = self.num_heads // kv_heads
        qg = q.view(batch, kv_heads, group, self.head_dim)
        scores = torch.matmul(qg, k.transpose(-1, -2)).float() * self.scale  # [Bd, kv_heads, group, L]
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.matmul(probs, v).view(batch, self.num_heads, self.head_dim)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        inv_freq, self.attention_scaling = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, head_dim] in fp32 (as the reference computes them)
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.float().unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [num_layers, 2, num_slots, kv_heads, head_dim]
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [S] tokens whose next-token logits are needed
    ) -> torch.Tensor:  # [S, vocab] fp32
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_tables(positions)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer, layer_cache in zip(self.layers, kv_cache):
            x = layer(x, cos, sin, layer_cache, meta)
        x = self.norm(x[logits_indices])
        return self.lm_head(x).float()
