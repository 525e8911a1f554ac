"""Gemma 4's text decoder (model_type gemma4_text, and the text model of the gemma4 vision-language
checkpoint), op for op as transformers' modeling_gemma4.py computes it (Gemma4TextModel,
Gemma4TextDecoderLayer, Gemma4TextAttention, Gemma4TextRouter / Gemma4TextExperts).

What it has beyond Gemma 3 (the fields `baton.model.gemma4_config` resolves):
- norms are `w * x_hat` (weights stored as is, not as offsets from 1), computed in fp32 with
  pow(-0.5); v is RMS-normed per head without a weight; the attention scale is 1;
- per-layer head shapes: the full layers' head_dim (and KV heads) differ from the sliding ones';
  the full layers' rotary is "proportional" (the first `partial_rotary_factor` of each half of the
  head rotated, the rest at frequency 0), the sliding layers' the default one;
- K = V on the full layers (`attention_k_eq_v`): no v_proj, v is k's projection before its norm
  and rotary;
- KV sharing: the last `num_kv_shared_layers` layers project only q and attend the K/V of the
  last earlier layer of their type (`ModelConfig.layer_kv_source`), keeping no cache of their own;
  their MLP is twice as wide where `use_double_wide_mlp`;
- per-layer inputs (`hidden_size_per_layer_input`): a second embedding table gives each layer a
  small vector per token, mixed with a projection of the embeddings, that gates a residual branch
  after the MLP; every layer's output is then scaled by its `layer_scalar`;
- a MoE block beside the dense MLP (`enable_moe_block`): a router over the MLP's input (weightless
  norm, a learned scale, softmax, top-k renormalised, times a per-expert scale), the experts on
  their own pre-norm (a `SparseMoE` the layer routes: its experts are served as every MoE's are,
  a GGUF's blocks or quantized ops), both branches post-normed and summed.

The KV cache (`ModelRunner.kv_cache`, `baton.model.layer_cache`) is one flat tensor holding the
unshared layers only, each packed in its own shape `[2, kv_heads, slots, head_dim]`; blocks leave and
enter it in the uniform padded form of every family (docs/design-decisions.md, decision 29). The
native kernels and the Triton kernels do not run these layers: every dtype takes the torch path.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from baton.model.attention import AttentionMetadata, PagedAttention, windowed
from baton.model.config import ModelConfig
from baton.model.layer_cache import layer_views
from baton.model.model import MIN_ROPE_TABLE, MLP, CausalLM, apply_rope, attend_cached, set_op
from baton.model.moe import SparseMoE, activation

SharedKV = dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> its step's (k, v), [T, kv_heads, d] each


class Gemma4Norm(nn.Module):
    """transformers' Gemma4RMSNorm: x * (mean(x^2) + eps)^-0.5 in fp32, times w (when it has one)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim] -> [..., dim]
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)


class Gemma4Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.head_dim = d = config.layer_head_dim[layer_index]
        self.num_kv_heads = config.layer_kv_heads[layer_index]
        self.sliding = config.is_sliding(layer_index)
        self.source = config.layer_kv_source[layer_index]  # the layer whose K/V it attends
        self.shared = self.source != layer_index
        self.k_eq_v = config.gemma4["k_eq_v"] and not self.sliding
        self.q_size, self.kv_size = config.num_heads * d, self.num_kv_heads * d
        kv_rows = 0 if self.shared else self.kv_size * (1 if self.k_eq_v else 2)
        # q, k and v fused as one matmul (q alone on a shared layer, q|k where K = V): the checkpoint's parts
        self.qkv_parts = "q" if self.shared else "qk" if self.k_eq_v else "qkv"
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + kv_rows, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = Gemma4Norm(d, config.rms_norm_eps)
        if not self.shared:
            self.k_norm = Gemma4Norm(d, config.rms_norm_eps)
            self.v_norm = Gemma4Norm(d, config.rms_norm_eps, with_scale=False)
        self.backend = PagedAttention(config.num_heads, self.num_kv_heads, d, config.scale, None)
        self.sinks = None
        set_op(self, "qkv", self.qkv_proj)
        set_op(self, "o", self.o_proj)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, shared_kv: SharedKV) -> torch.Tensor:
        # x: [T, H] -> [T, H]; kv_cache: [2, kv_heads, slots, head_dim], this layer's (its source's on a
        # shared layer)
        t, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)
        q = apply_rope(self.q_norm(qkv[:, :self.q_size].view(t, heads, d)), cos, sin)
        if self.shared:
            k, v = shared_kv[self.source]  # written to the cache by the source layer this step
        else:
            k_raw = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, kv_heads, d)
            v_raw = k_raw if self.k_eq_v else qkv[:, self.q_size + self.kv_size:].view(t, kv_heads, d)
            k, v = apply_rope(self.k_norm(k_raw), cos, sin), self.v_norm(v_raw)
            self.backend.write_kv(kv_cache, k, v, meta)
            shared_kv[self.layer_index] = (k, v)
        return self.o(attend_cached(self.backend, q, k, v, kv_cache, meta).reshape(t, self.q_size))


class Gemma4Router(nn.Module):
    """transformers' Gemma4TextRouter: (top-k weights [T, k] fp32, expert ids [T, k])."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, e = config.hidden_size, config.gemma4["num_experts"]
        self.top_k = config.gemma4["top_k"]
        self.norm = Gemma4Norm(h, config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(h, e, bias=False)
        self.scale = nn.Parameter(torch.ones(h))
        self.per_expert_scale = nn.Parameter(torch.ones(e))
        self.scalar_root_size = h**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(x) * self.scale * self.scalar_root_size
        probs = torch.softmax(self.proj(h), dim=-1, dtype=torch.float32)  # [T, E]
        weights, index = torch.topk(probs, k=self.top_k, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[index], index


def gemma4_experts(config: ModelConfig) -> SparseMoE:
    """transformers' Gemma4TextExperts (gate_up [E, 2I, H], down [E, H, I]) as a SparseMoE the layer
    routes (`mix`): its experts then run as every MoE's do, from a GGUF's blocks or quantized ops."""
    g = config.gemma4
    return SparseMoE(dataclasses.replace(config, num_experts=g["num_experts"], num_experts_per_tok=g["top_k"],
                                         moe_intermediate_size=g["moe_intermediate_size"], router="external",
                                         expert_form="plain"))


_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


class Gemma4Layer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        g, h, eps = config.gemma4, config.hidden_size, config.rms_norm_eps
        for name in _NORMS:
            setattr(self, name, Gemma4Norm(h, eps))
        self.self_attn = Gemma4Attention(config, layer_index)
        wide = g["double_wide_mlp"] and self.self_attn.shared
        self.mlp = MLP(config, config.intermediate_size * (2 if wide else 1))
        self.router: Gemma4Router | None = None
        if g["moe"]:
            self.router, self.experts = Gemma4Router(config), gemma4_experts(config)
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                setattr(self, name, Gemma4Norm(h, eps))
        self.per_layer_input = g["per_layer_input"]
        if self.per_layer_input:
            self.act = activation(config.hidden_act)
            self.per_layer_input_gate = nn.Linear(h, self.per_layer_input, bias=False)
            self.per_layer_projection = nn.Linear(self.per_layer_input, h, bias=False)
            self.post_per_layer_input_norm = Gemma4Norm(h, eps)
        # a buffer in transformers, a (frozen) parameter here: the loader reads parameters
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, shared_kv: SharedKV, per_layer: torch.Tensor | None) -> torch.Tensor:
        # x: [T, H] -> [T, H]; per_layer: [T, per_layer_input] or None
        residual = x
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, shared_kv)
        x = residual + self.post_attention_layernorm(h)
        residual = x
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.router is not None:  # the MoE block beside the MLP, both on the same residual
            weights, index = self.router(residual)
            # transformers' Gemma4TextExperts: each expert's rows weighed in fp32, then rounded
            moe = self.experts.mix(self.pre_feedforward_layernorm_2(residual), weights, index)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(moe)
        x = residual + self.post_feedforward_layernorm(h)
        if per_layer is not None:
            residual = x
            h = self.act(self.per_layer_input_gate(x)) * per_layer
            x = residual + self.post_per_layer_input_norm(self.per_layer_projection(h))
        return x * self.layer_scalar


def gemma4_inv_freq(config: ModelConfig, sliding: bool, head_dim: int) -> torch.Tensor:
    """[head_dim/2] inverse frequencies: transformers' default rope (sliding layers) or
    `_compute_proportional_rope_parameters` (full layers: zeros past the rotated angles)."""
    rope = config.gemma4["rope"]["sliding_attention" if sliding else "full_attention"]
    base = rope["theta"]
    if rope["rope_type"] == "default":
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    angles = int(rope["partial_rotary_factor"] * head_dim // 2)
    rotated = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
    inv_freq = torch.cat((rotated, torch.zeros(head_dim // 2 - angles, dtype=torch.float32)))
    return inv_freq / rope["factor"]


class Gemma4LM(CausalLM):
    """The Gemma 4 text decoder (see the module docstring)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)  # embeddings, head and the bookkeeping every model has
        g, h, eps = config.gemma4, config.hidden_size, config.rms_norm_eps
        self.layers = nn.ModuleList(Gemma4Layer(config, i) for i in range(config.num_layers))
        self.norm = Gemma4Norm(h, eps)
        self.per_layer_input = p = g["per_layer_input"]
        if p:
            self.embed_tokens_per_layer = nn.Embedding(g["per_layer_vocab"], config.num_layers * p)
            self.per_layer_model_projection = nn.Linear(h, config.num_layers * p, bias=False)
            self.per_layer_projection_norm = Gemma4Norm(p, eps)
        # layer -> its slice of the cache (a shared layer reads its source's)
        cached = config.attention_layers
        self.cache_index = [cached.index(src) for src in config.layer_kv_source]
        self.has_window = any(layer.self_attn.sliding for layer in self.layers)
        self.has_local_rope = False
        self.head_dims = {layer.self_attn.sliding: layer.self_attn.head_dim for layer in self.layers}

    def prepare(self, fast_linears: bool = True, native_kernels: bool = True,
                batch_invariant: bool | str | None = None, pack_projections: bool = True,
                release_originals: bool = False, gemv_amx: bool = True, triton: bool = False,
                build_plan: bool = True) -> None:
        # the Triton kernels are not validated on Gemma 4's per-layer shapes (no GPU run yet): attention
        # stays on the torch path (`baton plan` says Triton is off)
        super().prepare(fast_linears, native_kernels, batch_invariant, pack_projections, release_originals,
                        gemv_amx, False, build_plan)

    def _tables(self, positions: torch.Tensor, max_position: int) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        # sliding? -> cos, sin_signed [T, 1, head_dim] for that layer kind, in the model's dtype
        out = {}
        for sliding, d in self.head_dims.items():
            table = self.rope_tables.get(sliding)
            if table is None or max_position >= table[0].shape[0]:
                size = max(MIN_ROPE_TABLE, 2 * (max_position + 1))
                freqs = torch.arange(size, dtype=torch.int64).float().unsqueeze(-1) * \
                    gemma4_inv_freq(self.config, sliding, d).unsqueeze(0)
                emb = torch.cat((freqs, freqs), dim=-1)
                cos, sin = emb.cos(), emb.sin()
                sin[:, :d // 2] = -sin[:, :d // 2]  # rotate_half's sign folded in (see rope.rope_table)
                param = self.embed_tokens.weight
                table = self.rope_tables[sliding] = (cos.to(param.device, param.dtype), sin.to(param.device, param.dtype))
            out[sliding] = (table[0][positions].unsqueeze(1), table[1][positions].unsqueeze(1))
        return out

    def _per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # transformers' get_per_layer_inputs + project_per_layer_inputs: [T] ids, [T, H] scaled
        # embeddings -> [T, layers, per_layer_input]
        t, p, layers = x.shape[0], self.per_layer_input, self.config.num_layers
        weight = self.embed_tokens_per_layer.weight
        tokens = self.embed_tokens_per_layer(input_ids) * torch.tensor(p**0.5).to(weight.dtype)
        proj = self.per_layer_model_projection(x) * self.config.hidden_size**-0.5
        proj = self.per_layer_projection_norm(proj.reshape(t, layers, p))
        return (proj + tokens.reshape(t, layers, p)) * 2.0**-0.5

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # flat: each cached layer's [2, kv_heads, num_slots, head_dim] (layer_cache)
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [S]
        max_position: int,
        hidden_indices: torch.Tensor | None = None,  # [P]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [S, vocab] fp32 (and [P, hidden] fp32)
        config = self.config
        x = self.embed(input_ids)
        # sqrt(hidden) as transformers' buffer holds it (fp32), then rounded to the model's dtype
        x = x * torch.tensor(config.embedding_multiplier).to(x.dtype)
        per_layer = self._per_layer_inputs(input_ids, x) if self.per_layer_input else None
        tables = self._tables(positions, max_position)
        window_meta = windowed(meta, config.sliding_window) if self.has_window else meta  # type: ignore[arg-type]
        shared_kv: SharedKV = {}
        views = layer_views(kv_cache, config)
        for i, layer in enumerate(self.layers):
            sliding = layer.self_attn.sliding
            cos, sin = tables[sliding]
            x = layer(x, cos, sin, views[self.cache_index[i]], window_meta if sliding else meta, shared_kv,
                      per_layer[:, i] if per_layer is not None else None)
        normed = self.norm(x)
        logits = self._head_rows(normed[logits_indices])
        if config.final_logit_softcap is not None:
            logits = torch.tanh(logits / config.final_logit_softcap) * config.final_logit_softcap
        if hidden_indices is None:
            return logits.float()
        return logits.float(), normed[hidden_indices].float()


def gemma4_recipes(model: Gemma4LM, config: ModelConfig) -> dict[str, list[list[list[str]]]]:
    """The loader's recipes (`baton.model.loader._Recipe` alternatives) for Gemma 4: every parameter
    by its own name but q|k|v (q alone on a shared layer, q|k where K = V) and gate|up, fused."""
    out = {name: [[[name]]] for name, _ in model.named_parameters(remove_duplicate=False)}
    for i, layer in enumerate(model.layers):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        out[f"{attn}qkv_proj.weight"] = [[[f"{attn}{n}_proj.weight" for n in layer.self_attn.qkv_parts]]]
        out[f"{mlp}gate_up_proj.weight"] = [[[f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"]]]
        if layer.router is not None:  # the experts as a SparseMoE: the checkpoint's names
            out[f"layers.{i}.experts.experts_gate_up"] = [[[f"layers.{i}.experts.gate_up_proj"]]]
            out[f"layers.{i}.experts.experts_down"] = [[[f"layers.{i}.experts.down_proj"]]]
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)  # it is embed_tokens.weight
    return out


def shared_layers_kv_weights(config: ModelConfig) -> tuple[str, ...]:
    """Name prefixes of the K/V projections and norms a checkpoint may hold for Gemma 4's KV-shared
    layers, which never run them (transformers' Gemma4TextModel ignores them on load): skipped by
    name (`loader._checkpoint_view`)."""
    return tuple(f"layers.{i}.self_attn.{name}." for i, src in enumerate(config.layer_kv_source) if src != i
                 for name in ("k_proj", "v_proj", "k_norm", "v_norm"))
