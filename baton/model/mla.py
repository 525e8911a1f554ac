"""Multi-head latent attention (DeepSeek V2/V3's MLA), over the same paged KV cache as every family.

What transformers' DeepseekV3Attention computes, per head h:
  q_h = [q_nope_h, rope(q_pe_h)]              (q through q_a_proj -> q_a_layernorm -> q_b_proj, or q_proj)
  c   = kv_a_layernorm(c_kv), k_pe = rope(k_pe) (both from kv_a_proj_with_mqa: one latent per token)
  k_h = [W_UK_h c, k_pe],  v_h = W_UV_h c      (W_UK / W_UV: kv_b_proj's rows for head h)
  out = o_proj(concat_h softmax(q_h . k_h * scale) v_h)

Absorbed form (what the fast implementations run, and Baton here): q_nope_h . W_UK_h c =
(W_UK_h^T q_nope_h) . c, and sum_t p_t W_UV_h c_t = W_UV_h sum_t p_t c_t. So each head's query is moved
into latent space once per token, `q_lat_h = [W_UK_h^T q_nope_h, rope(q_pe_h)]` (width kv_lora_rank +
qk_rope_head_dim), every head attends over the same cached rows `[c, k_pe]`, and the first
kv_lora_rank dims of the attended vector go through W_UV_h. That is multi-query attention with one KV
head of width d = kv_lora_rank + qk_rope_head_dim: the cache keeps `[c, k_pe]` as that head's K and
the same vector as its V (`ModelConfig.head_dim` = d, `num_kv_heads` = 1), so the block manager, the
block store, the handoff codec and prefix caching take it unchanged, and a block is
(kv_lora_rank + qk_rope_head_dim) * 2 values per token and layer (DeepSeek V3: 1152, against 128
heads * (192 + 128) = 40960 for expanded K/V). V duplicating K costs half of that; it keeps the cache
one layout for every family.

The rotary: DeepSeek's checkpoints pair dimensions (2i, 2i + 1) (`rope_interleave`); the loader
reorders the q_pe and k_pe rows to the half-split pairs (i, i + r/2) Baton rotates in, which is
exactly the layout transformers' apply_rotary_pos_emb_interleave outputs, so the cached k_pe and the
scores are the reference's.

Paths: the portable torch attention (`PagedAttention`, fp32 SDPA for parity, bf16 batched matmuls)
in every dtype; the native CPU layer kernels take only the plain Llama layer
(`ModelConfig.native_unsupported` names MLA, so `baton plan` says "torch path (... multi-head latent
attention ...)"), and the Triton kernels are not used for MLA (not validated at width 576 with a
128-head group; `baton plan` says Triton off). A native / Triton MLA decode kernel is future work.
"""

from __future__ import annotations

import torch
from torch import nn

from baton.model.attention import AttentionMetadata, PagedAttention
from baton.model.config import ModelConfig
from baton.model.model import Attention, CausalLM, RMSNorm, set_op
from baton.model.rope import apply_rope

# DeepseekV3Attention's q_a_layernorm and kv_a_layernorm are built without the config's eps
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """MLA in the absorbed form (see the module docstring); the parameters carry the checkpoint's names."""

    # the window / rotary attributes CausalLM.forward reads of every attention layer
    sliding = False
    use_rope = True
    local_rope = False

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = heads = config.num_heads
        self.latent, self.rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
        self.nope, self.v_dim = config.qk_nope_head_dim, config.v_head_dim
        hidden, qk_head = config.hidden_size, self.nope + self.rope_dim
        self.q_lora = config.q_lora_rank
        if self.q_lora:
            self.q_a_proj = nn.Linear(hidden, self.q_lora, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(self.q_lora, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora, heads * qk_head, bias=False)
            set_op(self, "q_a", self.q_a_proj)
            set_op(self, "q_b", self.q_b_proj)
        else:
            self.q_proj = nn.Linear(hidden, heads * qk_head, bias=False)
            set_op(self, "q", self.q_proj)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.latent + self.rope_dim, bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.latent, LATENT_NORM_EPS)
        # read as W_UK / W_UV (never run as a projection): [heads * (nope + v), latent]
        self.kv_b_proj = nn.Linear(self.latent, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=config.o_bias)
        set_op(self, "kv_a", self.kv_a_proj_with_mqa)
        set_op(self, "o", self.o_proj)
        self.scale = config.scale
        # one KV head of width latent + rope_dim, every query head in its group
        self.backend = PagedAttention(heads, 1, config.head_dim, config.scale)

    def projection_slots(self) -> list[tuple[nn.Module, str, nn.Linear]]:
        """(owner, op attribute, nn.Linear) of the projections run through ops (kv_b_proj is read as
        the absorbed W_UK / W_UV instead)."""
        q = [(self, "q_a", self.q_a_proj), (self, "q_b", self.q_b_proj)] if self.q_lora else [(self, "q", self.q_proj)]
        return q + [(self, "kv_a", self.kv_a_proj_with_mqa), (self, "o", self.o_proj)]

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, 1, rope_dim]
        sin: torch.Tensor,  # [T, 1, rope_dim], sign-folded (see rope_table)
        kv_cache: torch.Tensor,  # [2, 1, num_slots, latent + rope_dim] (this layer's)
        meta: AttentionMetadata,
        q_scale: torch.Tensor | None = None,  # unused: no position-scaled queries in MLA families
    ) -> torch.Tensor:  # [T, H]
        num_tokens, heads = x.shape[0], self.num_heads
        q = self.q_b(self.q_a_layernorm(self.q_a(x))) if self.q_lora else self.q(x)  # [T, heads * qk_head]
        q_nope, q_pe = q.view(num_tokens, heads, -1).split([self.nope, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a(x).split([self.latent, self.rope_dim], dim=-1)  # [T, latent], [T, rope_dim]
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe, k_pe = apply_rope(q_pe, cos, sin), apply_rope(k_pe.unsqueeze(1), cos, sin)  # [T, heads|1, r]
        w_kv = self.kv_b_proj.weight.view(heads, self.nope + self.v_dim, self.latent)
        w_uk, w_uv = w_kv[:, :self.nope], w_kv[:, self.nope:]  # [heads, nope, latent], [heads, v, latent]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, heads, latent]
        query = torch.cat([q_lat, q_pe], dim=-1)  # [T, heads, latent + r]
        kv = torch.cat([c_kv.unsqueeze(1), k_pe], dim=-1)  # [T, 1, latent + r]: the cached row, K and V
        attended = self.attend(query, kv, kv, kv_cache, meta)[..., :self.latent]  # [T, heads, latent]
        out = torch.bmm(attended.transpose(0, 1), w_uv.transpose(1, 2))  # [heads, T, v]
        return self.o(out.transpose(0, 1).reshape(num_tokens, heads * self.v_dim))

    # the paged write and attend of every family's attention (it reads self.backend only)
    attend = Attention.attend


def half_split_rows(rows: torch.Tensor, head_width: int, rope_dim: int) -> torch.Tensor:
    """A projection's output rows (weight or bias) whose every `head_width` rows end in `rope_dim`
    rotary rows paired (2i, 2i + 1), with those rows reordered to the half-split pairs (i, i + r/2)
    Baton rotates (row 2i to i, 2i + 1 to i + r/2): q_b_proj / q_proj (head_width qk_head_dim) and
    kv_a_proj_with_mqa (one "head" of kv_lora_rank + rope_dim). The same permutation of q_pe and k_pe
    leaves every score unchanged, and the rotated result is the reference's interleaved rotary's."""
    heads = rows.shape[0] // head_width
    grouped = rows.reshape(heads, head_width, *rows.shape[1:])
    rope = grouped[:, head_width - rope_dim:]
    rope = torch.cat([rope[:, 0::2], rope[:, 1::2]], dim=1)
    return torch.cat([grouped[:, :head_width - rope_dim], rope], dim=1).reshape(rows.shape)


class LatentAttentionLM(CausalLM):
    """A decoder whose attention layers are MLA (DeepSeek V3): CausalLM with `LatentAttention`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, attention=LatentAttention)
