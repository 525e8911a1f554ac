"""A Llama-architecture decoder in plain torch, with attention over a paged KV cache.

Selective batching (Orca): embeddings, norms, projections and the MLP run over every token of the
step flattened to `[T, H]`, whatever request it belongs to; only attention is split, each request
attending over its own KV blocks (`baton.engine.attention`).

Two numeric paths share this code. float32 computes exactly as the reference (transformers) does:
it is the parity path of the tests. bf16 is the CPU fast path, written for the fewest ops per layer
(a decode step at batch 1 is ~30 layers x ~30 ops, and each op costs microseconds of dispatch):
fused RMSNorm, RoPE once over the q|k slice from a precomputed table, matmuls through prepacked
weights (`baton.engine.linear`), in-place residual adds. A decode-only step (the decode worker's every
step) runs all layers as one native call (`baton.engine.layers_plan`), the same kernels in the same
order.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.attention import AttentionMetadata, TorchAttention
from baton.engine.config import ModelConfig
from baton.engine.layers_plan import LayersPlan
from baton.engine.linear import (BATCH_INVARIANT_MODES, LinearOp, batch_invariant_mode, make_linear_op, tune_row_split,
                                 use_native_for_all_rows)


def set_op(module: nn.Module, name: str, op: LinearOp) -> None:
    # object.__setattr__: an nn.Linear stored here must not become a second registered submodule
    object.__setattr__(module, name, op)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        if x.dtype != torch.float32:
            # one fused kernel (it accumulates in fp32) instead of eight ops
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # fp32: the reference's exact sequence of ops (the parity path)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x


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


def rope_table(config: ModelConfig, num_positions: int, dtype: torch.dtype,
               device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin for positions [0, num_positions): [P, head_dim] each, in `dtype`.

    Computed in fp32 as the reference does (position * inv_freq, then cos/sin), so a lookup equals
    the on-the-fly value. The sin table carries rotate_half's sign (-sin on the first half), so that
    rope(x) = x * cos + roll(x, half) * sin_signed: three ops.
    """
    inv_freq, scaling = rope_inv_freq(config)
    positions = torch.arange(num_positions, dtype=torch.int64).float()
    freqs = positions.unsqueeze(-1) * inv_freq.float().unsqueeze(0)  # [P, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    half = config.head_dim // 2
    sin[:, :half] = -sin[:, :half]
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, d]; cos, sin_signed: [T, 1, d] -> [T, heads, d]
    if x.dtype == torch.float32:
        # the reference's rotate_half, op for op (the parity path)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        sin = torch.cat((-sin_signed[..., :half], sin_signed[..., half:]), dim=-1)
        return x * cos + rotated * sin
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


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
        self.backend = TorchAttention(config.num_heads, config.num_kv_heads, config.head_dim)
        # The ops the forward calls (see `prepare`); plain attributes, not submodules.
        set_op(self, "qkv", self.qkv_proj)
        set_op(self, "o", self.o_proj)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,  # [T, 1, head_dim], sign-folded (see rope_table)
        kv_cache: torch.Tensor,  # [2, kv_heads, num_slots, head_dim] (this layer's)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        num_tokens = x.shape[0]
        num_q_heads, num_kv_heads = self.num_heads, self.num_kv_heads
        backend = self.backend
        if backend.fuses_decode and not meta.prefills and len(meta.decode_groups) == 1:
            # decode only (the decode worker's every step): RoPE, KV write and attention in one call
            return self.o(backend.rope_write_decode(self.qkv(x), cos, sin, kv_cache, meta))
        qkv = self.qkv(x).view(num_tokens, num_q_heads + 2 * num_kv_heads, self.head_dim)
        # RoPE once over the q|k heads together
        qk = apply_rope(qkv[:, :num_q_heads + num_kv_heads], cos, sin)
        q, k = qk[:, :num_q_heads], qk[:, num_q_heads:]
        v = qkv[:, num_q_heads + num_kv_heads:]
        backend.write_kv(kv_cache, k, v, meta)
        if not meta.prefills and len(meta.decode_groups) == 1:
            out = backend.decode(q, kv_cache, meta.decode_groups[0], meta.block_size)  # the common case
        else:
            out = torch.empty_like(q)  # [T, heads, head_dim]
            for group in meta.decode_groups:
                s, e = group.start, group.start + group.count
                out[s:e] = backend.decode(q[s:e], kv_cache, group, meta.block_size)
            for span in meta.prefills:
                s, e = span.start, span.start + span.length
                out[s:e] = backend.prefill(q[s:e], k[s:e], v[s:e], kv_cache, span)
        return self.o(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        set_op(self, "gate_up", self.gate_up_proj)
        set_op(self, "down", self.down_proj)
        self.silu_mul: Any = None  # the native silu(gate) * up, when prepared with native kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        gate_up = self.gate_up(x)  # [T, 2I]
        if self.silu_mul is not None:
            return self.down(self.silu_mul(gate_up))  # native, bf16 on the CPU (see LlamaModel.prepare)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H] -> [T, H] (x is the step's own residual stream: updated in place)
        x += self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        x += self.mlp(self.post_attention_layernorm(x))
        return x


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
        set_op(self, "head", self.lm_head)
        self.fused_norm: Any = None  # the native add + RMSNorm (bf16 on the CPU; see prepare)
        self.layers_plan: LayersPlan | None = None  # all layers in one native call (see LayersPlan)
        self.rope_cos: torch.Tensor | None = None  # [P, head_dim], built on first use (see rope)
        self.rope_sin: torch.Tensor | None = None

    def prepare(self, fast_linears: bool = True, native_kernels: bool = True,
                batch_invariant: bool | str | None = None) -> None:
        """After the weights are loaded: pick the fastest matmul per projection (`baton.engine.linear`) and,
        for bf16 on the CPU, the native paged-attention kernel (`baton.engine.kernels`; built on first
        use). batch_invariant (default: `BATON_BATCH_INVARIANT`, "auto"; True = "full", False = "off"):
        one matmul kernel per projection for every row count and, with "full", prefill attention
        through the decode kernel, so that a row's numbers (and greedy tokens) do not depend on the
        batch, the chunking, or whether a token was computed in prefill or decode; "matmul": the
        matmuls only; "off": the fastest kernel per row count, measured here."""
        self.rope_cos = self.rope_sin = None
        param = self.embed_tokens.weight
        kernel = None
        if native_kernels and param.dtype == torch.bfloat16 and param.device.type == "cpu":
            from baton.engine import kernels

            kernel = kernels.load()
        slots = [(owner, name, linear) for layer in self.layers
                 for owner, name, linear in ((layer.self_attn, "qkv", layer.self_attn.qkv_proj),
                                             (layer.self_attn, "o", layer.self_attn.o_proj),
                                             (layer.mlp, "gate_up", layer.mlp.gate_up_proj),
                                             (layer.mlp, "down", layer.mlp.down_proj))]
        slots.append((self, "head", self.lm_head))
        ops = [make_linear_op(linear, fast_linears) for _, _, linear in slots]
        mode = batch_invariant_mode(kernel) if batch_invariant is None else \
            {True: "full", False: "off"}.get(batch_invariant, batch_invariant)  # type: ignore[call-overload]
        if mode not in BATCH_INVARIANT_MODES:
            raise ValueError(f"batch_invariant must be full, matmul or off, not {batch_invariant!r}")
        if fast_linears:
            ops = use_native_for_all_rows(ops, kernel) if mode != "off" else tune_row_split(ops, kernel)
        for (owner, name, _), op in zip(slots, ops):
            set_op(owner, name, op)
        for layer in self.layers:
            # batch-invariant: prefill queries attend as decode steps do (see TorchAttention)
            layer.self_attn.backend.use_native_kernel(kernel, decode_style_prefill=fast_linears and mode == "full")
            layer.mlp.silu_mul = kernel.silu_mul if kernel is not None else None
        self.fused_norm = kernel.add_rms_norm if kernel is not None else None
        self.layers_plan = LayersPlan.build(self, kernel)

    def rope(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin_signed: [T, 1, head_dim] in the model's dtype
        if self.rope_cos is None or max_position >= self.rope_cos.shape[0]:
            size = max(self.config.max_position_embeddings, 2 * (max_position + 1))
            param = self.embed_tokens.weight
            self.rope_cos, self.rope_sin = rope_table(self.config, size, param.dtype, param.device)
        return self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [num_layers, 2, kv_heads, num_slots, head_dim]
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [S] tokens whose next-token logits are needed
        max_position: int,  # the largest value in positions (known to the caller without a sync)
    ) -> torch.Tensor:  # [S, vocab] fp32
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope(positions, max_position)
        plan = self.layers_plan
        if plan is not None and not meta.prefills and len(meta.decode_groups) == 1:
            return self.head(plan.run(x, cos, sin, kv_cache, meta)[logits_indices]).float()
        if self.fused_norm is not None:
            return self._forward_fused(x, cos, sin, kv_cache, meta, logits_indices)
        for layer, layer_cache in zip(self.layers, kv_cache):
            x = layer(x, cos, sin, layer_cache, meta)
        x = self.norm(x[logits_indices])
        return self.head(x).float()

    def _forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                       meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        # x: [T, H] bf16 -> [S, vocab] fp32. Each residual add is fused with the norm that follows
        # it (the next layer's input norm, or the final norm): one native call instead of ~10 ops.
        add_rms_norm = self.fused_norm
        norms = [(layer.input_layernorm, layer.post_attention_layernorm) for layer in self.layers]
        first = norms[0][0] if norms else self.norm
        h = add_rms_norm(x, None, first.weight, first.eps)
        for i, (layer, layer_cache) in enumerate(zip(self.layers, kv_cache)):
            post = norms[i][1]
            h = add_rms_norm(x, layer.self_attn(h, cos, sin, layer_cache, meta), post.weight, post.eps)
            following = norms[i + 1][0] if i + 1 < len(norms) else self.norm
            h = add_rms_norm(x, layer.mlp(h), following.weight, following.eps)
        return self.head(h[logits_indices]).float()
