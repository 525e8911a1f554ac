"""One decoder for every supported family, in plain torch, with attention over a paged KV cache.

The family is data, not code: `ModelConfig` carries what the family spec (`baton.model.families`)
and the checkpoint's config.json resolve to (norm kind and placement, q/k norm, biases, activation,
rotary per layer, window layers, soft-capping, multipliers, position-scaled queries, MoE), and the
modules below read those fields. Nothing here branches on a model_type.

Selective batching (Orca): embeddings, norms, projections and the MLP run over every token of the
step flattened to `[T, H]`, whatever request it belongs to; only attention is split, each request
attending over its own KV blocks (`baton.model.attention`).

Two numeric paths share this code. float32 computes exactly as the reference (transformers) does:
it is the parity path of the tests. bf16 is the CPU fast path, written for the fewest ops per layer
(a decode step at batch 1 is ~30 layers x ~30 ops, and each op costs microseconds of dispatch):
fused RMSNorm, RoPE once over the q|k slice from a precomputed table, matmuls through prepacked
weights (`baton.model.linear`), in-place residual adds. A decode-only step (the decode worker's every
step) runs all layers as one native call (`baton.model.layers_plan`), the same kernels in the same
order.

That native path (fused norms, fused decode, the layer plan) does only the plain Llama layer
(pre-norm RMSNorm, SiLU MLP, full rotary, no window, no caps, no multipliers, dense): `prepare`
installs it only where `ModelConfig.native_unsupported()` is empty, and records the choice in
`path` / `describe()`; every other family takes the torch path in every dtype.
"""

from __future__ import annotations

from dataclasses import replace

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from baton.model.kv_groups import kv_groups
from baton.model.attention import AttentionMetadata, PagedAttention, windowed
from baton.model.triton_attention import to_triton, triton_available
from baton.model.config import ModelConfig
from baton.model.layers_plan import LayersPlan
from baton.model.plan_report import PathChoices
from baton.model.thread_gate import ThreadGate
from baton.model.moe import SparseMoE, activation
from baton.model.rope import apply_rope, length_dependent, rope_inv_freq, rope_table

__all__ = ["CausalLM", "DecoderLayer", "Attention", "MLP", "RMSNorm", "set_op", "apply_rope", "rope_inv_freq",
           "rope_table"]  # the rope functions are re-exported (their home is baton.model.rope)
from baton.model.linear import (BATCH_INVARIANT_MODES, BATCH_INVARIANT_SPELLINGS, LinearOp, QuantizedLinear, RowSplitLinear,
                                 batch_invariant_mode, drop_load_copies, make_linear_op, tune_row_split,
                                 native_for_all_rows)


def set_op(module: nn.Module, name: str, op: LinearOp) -> None:
    # object.__setattr__: an nn.Linear stored here must not become a second registered submodule
    object.__setattr__(module, name, op)


class RMSNorm(nn.Module):
    """kind "rms": w * x_hat (Llama); "gemma": x_hat * (1 + w), in fp32 whatever the dtype (Gemma's
    weights are stored as offsets from 1)."""

    def __init__(self, dim: int, eps: float, kind: str = "rms") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if kind == "rms" else torch.zeros(dim))
        self.eps = eps
        self.kind = kind
        # the native add + norm for the "gemma" kind in bf16 on the CPU (kernels' add_offset_rms_norm:
        # (x, delta or None, weight, eps)), installed by CausalLM.prepare; None: the torch ops
        self.native: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim] -> [..., dim]
        if self.native is not None and x.dtype == torch.bfloat16:
            return self.native(x.reshape(-1, x.shape[-1]), None, self.weight, self.eps).view(x.shape)
        if self.kind == "gemma":
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return (h * (1.0 + self.weight.float())).type_as(x)
        if x.dtype != torch.float32:
            # one fused kernel (it accumulates in fp32) instead of eight ops
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # fp32: the reference's exact sequence of ops (the parity path)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x


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
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.qk_norm = config.qk_norm
        self.rms_norm_eps = config.rms_norm_eps  # "l2": Llama 4's weightless norm
        if config.qk_norm in ("head", "full"):
            # "head": one norm over head_dim shared by the heads (Qwen3, Gemma 3); "full": over the
            # whole q (k) projection (OLMo 2)
            q_dim, k_dim = (self.head_dim, self.head_dim) if config.qk_norm == "head" else (self.q_size, self.kv_size)
            self.q_norm = RMSNorm(q_dim, config.rms_norm_eps, config.norm_kind)
            self.k_norm = RMSNorm(k_dim, config.rms_norm_eps, config.norm_kind)
        self.sliding = config.is_sliding(layer_index)  # attends the last `sliding_window` positions only
        self.use_rope = config.uses_rope(layer_index)
        self.local_rope = self.sliding and config.rope_theta_local is not None  # Gemma 3's local base
        self.scale = config.scale
        self.backend = PagedAttention(config.num_heads, config.num_kv_heads, config.head_dim, config.scale,
                                      config.attn_logit_softcap)
        self.sinks: nn.Parameter | None = None  # gpt-oss: a logit per head in every softmax row
        if config.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(config.num_heads))
        # The ops the forward calls (see `prepare`); plain attributes, not submodules.
        set_op(self, "qkv", self.qkv_proj)
        set_op(self, "o", self.o_proj)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, 1, rotary_dim]
        sin: torch.Tensor,  # [T, 1, rotary_dim], sign-folded (see rope_table)
        kv_cache: torch.Tensor,  # [2, kv_heads, num_slots, head_dim] (this layer's)
        meta: AttentionMetadata,  # windowed (`attention.windowed`) for a sliding layer
        q_scale: torch.Tensor | None = None,  # [T, 1, 1]: queries times it after the rotary (Ministral 3)
    ) -> torch.Tensor:  # [T, H]
        num_tokens = x.shape[0]
        num_q_heads, num_kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        backend = self.backend
        if backend.fuses_decode and not meta.prefills and len(meta.decode_groups) == 1:
            # decode only (the decode worker's every step): RoPE, KV write and attention in one call
            return self.o(backend.rope_write_decode(self.qkv(x), cos, sin, kv_cache, meta))
        qkv = self.qkv(x)  # [T, q_size + 2 kv_size]
        if self.sinks is not None:
            backend.sinks = self.sinks  # read here: loading replaces the parameter (assign=True)
        if self.qk_norm == "none":
            qkv = qkv.view(num_tokens, num_q_heads + 2 * num_kv_heads, d)
            v = qkv[:, num_q_heads + num_kv_heads:]
            # RoPE once over the q|k heads together
            qk = apply_rope(qkv[:, :num_q_heads + num_kv_heads], cos, sin) if self.use_rope else qkv
            q, k = qk[:, :num_q_heads], qk[:, num_q_heads:num_q_heads + num_kv_heads]
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            if self.qk_norm == "full":  # before the split into heads
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = q.view(num_tokens, num_q_heads, d), k.view(num_tokens, num_kv_heads, d)
            v = v.view(num_tokens, num_kv_heads, d)
            if self.qk_norm == "head":
                q, k = self.q_norm(q), self.k_norm(k)
            if self.use_rope:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
                if self.qk_norm == "l2":  # Llama 4: after the rotary, on the rotary layers only
                    q, k = weightless_rms(q, self.rms_norm_eps), weightless_rms(k, self.rms_norm_eps)
        if q_scale is not None:
            # Ministral 3's scale is in the model's dtype already; Llama 4's is fp32, the product rounded
            q = (q * q_scale).to(q.dtype)
        return self.o(self.attend(q, k, v, kv_cache, meta).reshape(num_tokens, self.q_size))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """Write the step's K/V into the cache and attend: q [T, heads, d], k/v [T, kv_heads, d] -> [T, heads, d]."""
        self.backend.write_kv(kv_cache, k, v, meta)
        return attend_cached(self.backend, q, k, v, kv_cache, meta)


def attend_cached(backend: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """`Attention.attend` over K/V already in the cache (Gemma 4's KV-shared layers read another
    layer's): q [T, heads, d], k/v [T, kv_heads, d] -> [T, heads, d]."""
    if not meta.prefills and len(meta.decode_groups) == 1:
        return backend.decode(q, kv_cache, meta.decode_groups[0], meta.block_size)  # the common case
    out = q.new_empty(q.shape)
    for group in meta.decode_groups:
        s, e = group.start, group.start + group.count
        out[s:e] = backend.decode(q[s:e], kv_cache, group, meta.block_size)
    for span in meta.prefills:
        s, e = span.start, span.start + span.length
        out[s:e] = backend.prefill(q[s:e], k[s:e], v[s:e], kv_cache, span)
    return out


def weightless_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' Llama4TextL2Norm (a weightless RMS norm over the last dim), op for op
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        # intermediate_size: the config's, or a MoE's shared experts' (GLM-4.5)
        super().__init__()
        self.intermediate_size = intermediate = intermediate_size or config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * intermediate, bias=config.mlp_bias)
        self.down_proj = nn.Linear(intermediate, config.hidden_size, bias=config.mlp_bias)
        self.act = activation(config.hidden_act)
        set_op(self, "gate_up", self.gate_up_proj)
        set_op(self, "down", self.down_proj)
        self.silu_mul: Any = None  # the native silu(gate) * up, when prepared with native kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        gate_up = self.gate_up(x)  # [T, 2I]
        if self.silu_mul is not None:
            return self.down(self.silu_mul(gate_up))  # native, bf16 on the CPU (see CausalLM.prepare)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down(self.act(gate) * up)


MIN_ROPE_TABLE = 4096  # positions a rope table holds at least (it doubles past them)

# which norms a layer has, by placement (the checkpoint's names; see FamilySpec)
_LAYER_NORMS = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
}


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, attention: type[nn.Module] = Attention) -> None:
        super().__init__()
        self.placement = config.norm_placement
        for name in _LAYER_NORMS[self.placement]:
            setattr(self, name, RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_kind))
        # `attention`: another kind over the same cache (MLA: baton.model.mla.LatentAttentionLM passes it)
        self.self_attn: nn.Module = attention(config, layer_index)
        if config.is_moe(layer_index):
            shared = (MLP(config, config.moe_intermediate_size * config.num_shared_experts)
                      if config.num_shared_experts else None)
            self.mlp: nn.Module = SparseMoE(config, shared)
        else:
            self.mlp = MLP(config)
        self.residual_multiplier = config.residual_multiplier  # Granite scales each branch

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, q_scale: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, H] -> [T, H] (x is the step's own residual stream: updated in place)
        if self.placement == "pre":
            self._add(x, self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, q_scale))
            self._add(x, self.mlp(self.post_attention_layernorm(x)))
        elif self.placement == "sandwich":
            self._add(x, self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv_cache,
                                                                      meta, q_scale)))
            self._add(x, self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))))
        else:  # post
            self._add(x, self.post_attention_layernorm(self.self_attn(x, cos, sin, kv_cache, meta, q_scale)))
            self._add(x, self.post_feedforward_layernorm(self.mlp(x)))
        return x

    def _add(self, x: torch.Tensor, branch: torch.Tensor) -> None:
        if self.residual_multiplier != 1.0:
            branch = branch * self.residual_multiplier
        x += branch


class CausalLM(nn.Module):
    """A causal language model of any family served (the family spec decides its layers, see the
    module docstring). `path` says which forward runs: "native" (the bf16 CPU kernels) or "torch"."""

    def __init__(self, config: ModelConfig, attention: type[nn.Module] = Attention) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, attention) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_kind)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        set_op(self, "head", self.lm_head)
        self.fused_norm: Any = None  # the native add + RMSNorm (bf16 on the CPU; see prepare)
        self.layers_plan: LayersPlan | None = None  # all layers in one native call (see LayersPlan)
        self.layer_kernel: Any = None  # the native layer kernels `prepare` installed (None: the torch path)
        self.thread_gate: ThreadGate | None = None  # lent threads given back between layers (the plan's)
        self.rope_tables: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}  # local? -> cos, sin [P, r]
        self.has_window = any(layer.self_attn.sliding for layer in self.layers)
        self.has_local_rope = any(layer.self_attn.local_rope for layer in self.layers)
        self.path = "torch"  # set by prepare: "native" where the native kernels run the layers
        self.choices: PathChoices | None = None  # what prepare was asked and chose (`baton plan` states it)
        self.embed_rows: Any = None  # ids [T] -> [T, hidden]: lookups read a tied head's op (release_load_copies)
        self.native_unsupported = config.native_unsupported()

    def describe(self) -> str:
        why = f" ({', '.join(self.native_unsupported)})" if self.path == "torch" and self.native_unsupported else ""
        kv = self.layers[0].self_attn.backend.kv_dtype if self.layers else None
        cache = f"; {str(kv).removeprefix('torch.')} KV cache" if kv is not None else ""
        attns = [layer.self_attn for layer in self.layers if getattr(layer, "self_attn", None) is not None]
        native = sum(1 for attn in attns if getattr(getattr(attn, "backend", None), "paged_kernel", None) is not None)
        decode = (f"; decode attention native on {native} of {len(attns)} layers"
                  if self.path == "torch" and native else "")
        return f"{self.config.model_type}: {self.path} path{why}{decode}{cache}"

    def use_kv_dtype(self, dtype: torch.dtype) -> None:
        """Attend over a KV cache of `dtype` (int8, fp8: quantized rows, `baton.model.kv_quant`;
        the native kernels and the torch path both read and write them)."""
        for layer in self.layers:
            layer.self_attn.backend.use_kv_dtype(dtype)

    def projection_slots(self) -> list[tuple[nn.Module, str, nn.Linear]]:
        """(owner, op attribute, the nn.Linear behind it) for every dense projection the forward
        calls through an op (MoE experts and routers are not: they run in `baton.model.moe`; a MoE's
        shared experts are a dense MLP and are)."""
        slots: list[tuple[nn.Module, str, nn.Linear]] = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, self.dense_mlp(layer.mlp)
            if hasattr(attn, "projection_slots"):  # MLA (baton.model.mla): projections of its own
                slots += attn.projection_slots()
            elif attn is not None:  # None: a layer of another kind (a hybrid model's state layers)
                slots += [(attn, "qkv", attn.qkv_proj), (attn, "o", attn.o_proj)]
            if isinstance(mlp, MLP):
                slots += [(mlp, "gate_up", mlp.gate_up_proj), (mlp, "down", mlp.down_proj)]
        slots.append((self, "head", self.lm_head))
        return slots

    def dense_mlp(self, mlp: nn.Module) -> nn.Module:
        """The dense MLP a layer's MLP module runs through projection ops: itself, or a MoE's shared experts."""
        return mlp.shared_experts if isinstance(mlp, SparseMoE) and mlp.shared_experts is not None else mlp

    def prepare(self, fast_linears: bool = True, native_kernels: bool = True,
                batch_invariant: bool | str | None = None, pack_projections: bool = True,
                release_originals: bool = False, gemv_amx: bool = True, triton: bool = False,
                build_plan: bool = True) -> None:
        """After the weights are loaded: pick the fastest matmul per projection (`baton.model.linear`) and,
        for bf16 on the CPU, the native paged-attention kernel (`baton.model.kernels`; built on first
        use). `load_runtime` passes its `RuntimeConfig`'s choices (native_kernels, gemv_amx: the
        native bf16 matmul on AMX where the CPU has it, triton: CUDA attention through the Triton
        kernels, batch_invariant); the defaults are the environment's defaults (baton/model/runtime_env.py).
        batch_invariant (default: `BATON_BATCH_INVARIANT`, "auto"; True = "full", False = "off"):
        one matmul kernel per projection for every row count and, with "full", prefill attention
        through the decode kernel, so that a row's numbers (and greedy tokens) do not depend on the
        batch, the chunking, or whether a token was computed in prefill or decode; "matmul": the
        matmuls only; "off": the fastest kernel per row count, measured here. pack_projections=False
        leaves every projection a plain nn.Linear (the engine quantizes them next: a pack would be
        made only to be dropped). release_originals: free each projection's nn.Linear weight as soon
        as its native pack is made, so that packing peaks at one projection above one copy (the
        workers; `prepare()` cannot run again afterwards); other ops' originals are freed by
        `release_load_copies`. build_plan=False leaves the all-layers plan to `build_layers_plan`
        (`load_runtime` builds it once, after quantization, sharing and releases changed the ops).

        The native layer kernels (fused norms, fused decode attention, the layer plan) are installed
        only for a plain Llama layer (`ModelConfig.native_unsupported()` empty); the matmul choice
        is the same for every family (a projection is a projection)."""
        self.rope_tables = {}
        param = self.norm.weight  # the model's dtype and device (the embedding may be unread yet: gguf_embeddings)
        kernel = None
        if native_kernels and param.dtype == torch.bfloat16 and param.device.type == "cpu":
            from baton.model import kernels

            kernel = kernels.load()
        if kernel is not None:  # process-wide in the kernel: this model's config decides it from here on
            kernel.gemv_kernel("amx" if gemv_amx else "avx512bf16")
        slots = self.projection_slots()
        if isinstance(batch_invariant, bool):
            mode = "full" if batch_invariant else "off"
        elif batch_invariant is None or batch_invariant.strip().lower() in BATCH_INVARIANT_SPELLINGS:
            mode = batch_invariant_mode(kernel, batch_invariant)
        else:
            mode = batch_invariant
        if mode not in BATCH_INVARIANT_MODES:
            raise ValueError(f"batch_invariant must be full, matmul or off, not {batch_invariant!r}")
        linears = [linear for _, _, linear in slots]
        if not fast_linears or not pack_projections:
            ops: list[LinearOp] = list(linears)
        elif mode != "off":  # one pack per weight, no oneDNN pack made
            ops = native_for_all_rows(linears, kernel, self.drop_projection_weight if release_originals else None)
        else:
            ops = tune_row_split([make_linear_op(linear) for linear in linears], kernel)
        for (owner, name, _), op in zip(slots, ops):
            set_op(owner, name, op)
        layer_kernel = kernel if not self.native_unsupported else None
        for layer in self.layers:
            # batch-invariant: prefill queries attend as decode steps do (see PagedAttention); a
            # hybrid's state layer has no attention (None)
            if layer.self_attn is not None and layer_kernel is not None:
                layer.self_attn.backend.use_native_kernel(layer_kernel,
                                                          decode_style_prefill=fast_linears and mode == "full")
            elif layer.self_attn is not None:
                # a family the fused layer kernels do not do (q/k norms, partial rotary, state layers,
                # MoE...): its decode queries still attend in place over the paged cache where the
                # attention itself is plain; the torch path gathered every block of the context into
                # a padded copy per step (its cost grows with the context)
                plain = kernel is not None and self._attends_plainly(layer.self_attn)
                layer.self_attn.backend.use_native_kernel(kernel if plain else None, fused=False)
            if isinstance(layer.mlp, MLP):
                layer.mlp.silu_mul = layer_kernel.silu_mul if layer_kernel is not None else None
        # MLA (one KV head of width kv_lora_rank + rope, 576 in V3, shared by up to 128 query heads) is
        # not validated on the Triton kernels (their tiles are sized for head_dim <= 256): its attention
        # stays on the torch path, and `baton plan` says Triton is off
        use_triton = triton_available(param.device, triton) and not self.config.kv_lora_rank
        if use_triton:  # CUDA: attention over the paged pool in place (RuntimeConfig.triton, BATON_TRITON=1)
            for layer in self.layers:
                attn = getattr(layer, "self_attn", None)
                # chunked window layers (Llama 4) keep the torch masks: the kernels know sliding windows only
                if attn is not None and isinstance(attn.backend, PagedAttention) and not (
                        attn.sliding and self.config.chunked_window):
                    attn.backend = to_triton(attn.backend, self.config.sliding_window if attn.sliding else None)
        self.fused_norm = layer_kernel.add_rms_norm if layer_kernel is not None else None
        # Gemma-kind norms (Gemma 2/3, Qwen3.5, Qwen3-Next) as one native call each in bf16
        offset_norm = kernel.add_offset_rms_norm if kernel is not None and layer_kernel is None else None
        for module in self.modules():
            if isinstance(module, RMSNorm) and module.kind == "gemma":
                module.native = offset_norm
        self.layer_kernel = layer_kernel
        self.path = "native" if layer_kernel is not None else "torch"
        self.choices = PathChoices(mode, native_kernels, gemv_amx, use_triton)
        self.layers_plan = None
        if build_plan:
            self.build_layers_plan()

    def _attends_plainly(self, attn: Attention) -> bool:
        """Whether the paged decode kernel computes this layer's decode attention: softmax(q k^T *
        scale) v over the whole context (no window, chunk, sinks, soft-capping, latent KV, or Gemma
        4's layer kinds, which the torch path does)."""
        config = self.config
        if config.attention_sinks or config.chunked_window or config.kv_lora_rank or config.gemma4:
            return False
        backend = getattr(attn, "backend", None)
        return type(backend) is PagedAttention and backend.softcap is None and not getattr(attn, "sliding", True)

    def drop_projection_weight(self, linear: nn.Linear) -> int:
        """Free a projection's own weight once its op holds the copy it reads (a pack, quantized
        blocks); a tied head's weight is the embedding, which lookups still read, and stays.
        Returns the bytes freed."""
        if linear.weight is self.embed_tokens.weight:
            return 0
        freed = linear.weight.numel() * linear.weight.element_size()
        linear.weight = nn.Parameter(torch.empty(0, dtype=linear.weight.dtype), requires_grad=False)
        return freed

    def release_load_copies(self, build_plan: bool = True) -> int:
        """After `prepare()` (and any quantization): free every copy of a projection's weight that
        its op never reads, so that each weight lives once (bf16 with the native kernel: its pack only;
        with the tuned split: the native and oneDNN packs; a prepacked op alone: its pack). The nn.Linear
        weights are gone afterwards, so `prepare()` cannot run again (the workers call this; `LLM`
        does not). Returns the bytes freed."""
        freed = 0
        for owner, name, linear in self.projection_slots():
            op = getattr(owner, name)
            if op is linear or linear.weight.numel() == 0:
                continue  # a plain nn.Linear (its weight is the op), or already released (quantized)
            drop_load_copies(op)
            freed += self.drop_projection_weight(linear)
        freed += self._embed_from_head()
        if build_plan:
            self.build_layers_plan()
        return freed

    def build_layers_plan(self) -> None:
        """The all-layers native decode call over what the ops hold now (None where it cannot run
        them: the torch path, MoE layers, ops it does not take). It keeps references to the ops'
        packs, so it is built after every change to them (`load_runtime`: once, at the end)."""
        self.layers_plan = LayersPlan.build(self, self.layer_kernel) if self.path == "native" else None

    def _embed_from_head(self) -> int:
        """A tied head whose op reads rows (the native bf16 pack, quantized blocks) serves the
        embedding lookups too, and the embedding table is freed: the tied weight lives once. With a
        GGUF the head's blocks are the file's token_embd, so lookups read what llama.cpp's do."""
        op, weight = self.head, self.embed_tokens.weight
        if self.lm_head.weight is not weight or not isinstance(op, (RowSplitLinear, QuantizedLinear)):
            return 0
        if isinstance(op, RowSplitLinear):
            if weight.dtype != torch.bfloat16:
                return 0
            self.embed_rows = op.rows
        else:
            self.embed_rows = lambda ids, dtype=weight.dtype: op.rows(ids, dtype)
        empty = nn.Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device), requires_grad=False)
        self.embed_tokens.weight = self.lm_head.weight = empty  # dtype and device still read from it
        return weight.numel() * weight.element_size()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        return self.embed_rows(input_ids) if self.embed_rows is not None else self.embed_tokens(input_ids)

    def rope(self, positions: torch.Tensor, max_position: int,
             local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin_signed: [T, 1, rotary_dim] in the model's dtype
        table = self.rope_tables.get(local)
        if table is None or max_position >= table[0].shape[0]:
            # grown by doubling as positions come (a 128k-context model's whole table, built in fp32
            # at the first step, left ~200 MB on each worker's heap); a length-dependent type's is
            # built for the whole context at once, as the reference computes it
            size = max(MIN_ROPE_TABLE, 2 * (max_position + 1))
            if length_dependent(self.config, local):
                size = max(self.config.max_position_embeddings, size)
            param = self.embed_tokens.weight
            table = self.rope_tables[local] = rope_table(self.config, size, param.dtype, param.device, local)
        return table[0][positions].unsqueeze(1), table[1][positions].unsqueeze(1)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [num_layers, 2, kv_heads, num_slots, head_dim]
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [S] tokens whose next-token logits are needed
        max_position: int,  # the largest value in positions (known to the caller without a sync)
        hidden_indices: torch.Tensor | None = None,  # [P] tokens whose final-norm hidden states are needed
        # each window table's metadata (baton.model.kv_groups: then kv_cache is each layer's tensor)
        window_metas: list[AttentionMetadata] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [S, vocab] fp32 (and [P, hidden] fp32)
        # hidden_indices (embeddings, baton.engine.pooling; a multi-token-prediction head's input):
        # the final norm's output of those rows is returned too, as transformers' AutoModel's
        # last_hidden_state; the LM head runs only over logits_indices, so a step of pooling
        # requests alone computes no logits at all.
        x = self.embed(input_ids)
        config = self.config
        if config.embedding_multiplier != 1.0:  # (the native paths run only where it is 1)
            # Gemma multiplies by sqrt(hidden) rounded to the model's dtype; Granite by the float
            scale = config.embedding_multiplier
            x = x * (torch.tensor(scale, dtype=x.dtype) if config.embedding_multiplier_in_dtype else scale)
        return self.forward_embedded(x, positions, kv_cache, meta, logits_indices, max_position, hidden_indices,
                                     window_metas)

    def forward_embedded(
        self,
        x: torch.Tensor,  # [T, hidden]: the step's input rows (the embeddings, or an MTP head's fused input)
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        max_position: int,
        hidden_indices: torch.Tensor | None = None,
        window_metas: list[AttentionMetadata] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`forward` from its input rows on (the layers, the final norm, the head)."""
        cos, sin = self.rope(positions, max_position)
        plan = self.layers_plan
        if plan is not None and not meta.prefills and len(meta.decode_groups) == 1:
            return self._with_hidden(plan.run(x, cos, sin, kv_cache, meta, self.thread_gate), logits_indices,
                                     hidden_indices)
        if self.fused_norm is not None:
            return self._forward_fused(x, cos, sin, kv_cache, meta, logits_indices, hidden_indices)
        config = self.config
        # the window layers' metadata and the local rotary, once per step for all layers
        window_meta = (windowed(meta, config.sliding_window, chunked=config.chunked_window)  # type: ignore[arg-type]
                       if self.has_window and not window_metas else meta)
        # the meta of each layer: its table's (window tables: baton.model.kv_groups)
        metas = ([window_meta if layer.self_attn.sliding else meta for layer in self.layers] if not window_metas
                 else self._table_metas(meta, window_metas))
        local = self.rope(positions, max_position, local=True) if self.has_local_rope else (cos, sin)
        q_scale = self._query_scale(positions, x.dtype) if config.query_scale_beta else None
        temperature = self._attn_temperature(positions) if config.attn_temperature_scale else None
        for layer, layer_cache, layer_meta in zip(self.layers, kv_cache, metas):
            attn = layer.self_attn
            c, s = local if attn.local_rope else (cos, sin)
            layer_q_scale = temperature if temperature is not None and not attn.use_rope else q_scale
            x = layer(x, c, s, layer_cache, layer_meta, layer_q_scale)
        logits = self._head_rows(self.norm(x[logits_indices]))
        if config.logits_scaling != 1.0:
            logits = logits / config.logits_scaling
        if config.final_logit_softcap is not None:
            logits = torch.tanh(logits / config.final_logit_softcap) * config.final_logit_softcap
        if hidden_indices is None:
            return logits.float()
        return logits.float(), self.final_hidden(x[hidden_indices]).float()

    def final_hidden(self, rows: torch.Tensor) -> torch.Tensor:
        """The hidden state returned for `hidden_indices` rows of the last layer's output: the final norm's."""
        return self.norm(rows)

    def _table_metas(self, meta: AttentionMetadata, window_metas: list[AttentionMetadata]) -> list[AttentionMetadata]:
        # each layer's metadata where the window layers have tables of their own: the global
        # table's for global layers, the windowed metadata of its table for a window layer
        groups = kv_groups(self.config)
        first = windowed(window_metas[0], self.config.sliding_window,  # type: ignore[arg-type]
                         chunked=self.config.chunked_window)
        # the masks depend on positions only: built once, shared by every window table's metadata
        window = [first] + [replace(
            m, decode_groups=[replace(g, mask=w.mask, bias=w.bias) for g, w in zip(m.decode_groups, first.decode_groups)],
            prefills=[replace(p, mask=w.mask, block_ids=None if w.block_ids is None else p.block_ids)
                      for p, w in zip(m.prefills, first.prefills)]) for m in window_metas[1:]]
        return [window[t - 1] if t else meta for t in groups.table_of]

    def _attn_temperature(self, positions: torch.Tensor) -> torch.Tensor:
        # positions: [T] -> [T, 1, 1] fp32; transformers' Llama4TextAttention temperature tuning, op for op
        config = self.config
        scale = torch.log1p(torch.floor((positions.float() + 1.0) / config.attn_temperature_floor))
        return (scale * config.attn_temperature_scale + 1.0)[:, None, None]

    def _query_scale(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # positions: [T] -> [T, 1, 1]; transformers' get_llama_4_attn_scale, op for op (fp32, then the
        # model's dtype): 1 below the original context, growing with log(position) past it
        config = self.config
        scale = 1 + config.query_scale_beta * torch.log(1 + torch.floor(positions / config.query_scale_period))
        return scale.to(dtype)[:, None, None]

    def _head_rows(self, normed: torch.Tensor) -> torch.Tensor:
        # no rows (a step of pooling requests only): the native head kernels are not asked for 0 rows
        if normed.shape[0] == 0:
            return normed.new_zeros(0, self.config.vocab_size)
        return self.head(normed)

    def _with_hidden(self, normed: torch.Tensor, logits_indices: torch.Tensor,
                     hidden_indices: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # normed: [T, H], the final norm's output of every row
        logits = self._head_rows(normed[logits_indices]).float()
        return logits if hidden_indices is None else (logits, normed[hidden_indices].float())

    def _forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                       meta: AttentionMetadata, logits_indices: torch.Tensor,
                       hidden_indices: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
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
        return self._with_hidden(h, logits_indices, hidden_indices)
