"""The Gated DeltaNet layer (Qwen3-Next, Qwen3.5): a linear-attention layer whose memory is a
fixed-size state per request, not a KV entry per token.

Rules: every op follows transformers' torch fallbacks (modeling_qwen3_next.py / modeling_qwen3_5.py:
`causal_conv1d_*`, `torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`,
`*RMSNormGated`), which are the parity oracle of the tests. A request's state is two tensors in a
slot of the runner's state pool (`StatePool`): the causal conv's last `kernel - 1` inputs (the
model's dtype) and the delta rule's [v_heads, k_dim, v_dim] matrix (fp32: the recurrence
accumulates in it). Each scheduled row continues from its own slot: decode rows (one token each)
run together through the recurrent rule, each prefill span (a chunk of one request's prompt)
through the chunked rule starting from its slot's state, so a prompt split over steps (chunked
prefill) computes what one call over the whole prompt does. On the CPU the decode rows take one
native call per layer (kernels/gated_delta.cpp: the conv, silu and the rule in two passes over each
state, where the torch ops below make four), the same operations in the same order. A slot is zeroed when a request starts
(`StatePool.reset`), so recompute after preemption starts from scratch.

Two checkpoint layouts, one computation: Qwen3-Next fuses the projections per key-head group
(`in_proj_qkvz`, `in_proj_ba`), Qwen3.5 keeps them apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`,
`in_proj_a`); the parameters carry the checkpoint's names, and `_project` brings both to q|k|v, z,
b, a.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from baton.model.model import set_op


@dataclass(frozen=True)
class DeltaNetDims:
    """A Gated DeltaNet layer's sizes (config.json's `linear_*` keys)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    layout: str  # "grouped" (Qwen3-Next's in_proj_qkvz / in_proj_ba) or "split" (Qwen3.5's four projections)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def recurrent_shape(self) -> tuple[int, ...]:
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)


class StateDims(Protocol):
    """What a state layer keeps per request (`StatePool`): a causal conv's last `conv_kernel - 1`
    inputs of `conv_dim` channels, and a recurrent state of `recurrent_shape` in fp32 (() for none:
    LFM2's short convolution keeps the conv inputs only)."""

    @property
    def conv_dim(self) -> int: ...
    @property
    def conv_kernel(self) -> int: ...
    @property
    def recurrent_shape(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class DecodeStep:
    """One recurrent step over some one-token rows of a forward: which rows of the flattened batch
    (a slice, or their indices), each one's state slot, and the slots' states to copy out after it."""

    rows: slice | torch.Tensor
    slots: torch.Tensor  # [R] long
    first_slot: int | None = None  # slots[0] when the slots are consecutive (advanced in place as a slice)
    # (slots, scratch slots): after this step each of those slots' states is copied into its scratch slot
    copies: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class StateMeta:
    """Which state slot each row of a step continues from: the first `len(decode_slots)` rows are
    one-token rows (decode), then `spans`: (first row, rows, slot) of each prefill chunk.

    A verify row of speculative decoding (its last token and k proposals, all one-token rows of the
    decode part) continues from one slot through 1 + k recurrent steps, in order: `decode_steps`
    then lists them (step j: every decode row's j-th token), and after step j < k its state is
    copied into a scratch slot, so that the engine keeps the state after the tokens it accepts
    (`StatePool.keep`). None: every decode row in one step."""

    decode_slots: torch.Tensor  # [D] long
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    # decode_slots[0] when the decode slots are consecutive (first, first + 1, ...), else None
    decode_first_slot: int | None = None
    decode_steps: list[DecodeStep] | None = None

    def steps(self) -> list[DecodeStep]:
        if self.decode_steps is not None:
            return self.decode_steps
        rows = self.decode_slots.shape[0]
        return [DecodeStep(slice(0, rows), self.decode_slots, self.decode_first_slot)] if rows else []


def after_step(pool: StatePool, layer: int, step: DecodeStep) -> None:
    """A state layer ran `step`: copy the states a verify row may fall back to (its scratch slots)."""
    if step.copies is None:
        return
    slots, scratch = step.copies
    pool.conv[layer].index_copy_(0, scratch, pool.conv[layer].index_select(0, slots))
    if pool.recurrent is not None:
        pool.recurrent[layer].index_copy_(0, scratch, pool.recurrent[layer].index_select(0, slots))


class StatePool:
    """Every state layer's slots: conv [layers, slots, conv_dim, kernel - 1] in the model's dtype,
    recurrent [layers, slots, v_heads, k_dim, v_dim] in fp32 (None where the layers keep no
    recurrent state: `StateDims`). Allocated once for `num_slots` requests (the engine's
    max_num_seqs); a request holds one slot index across all layers."""

    def __init__(self, dims: StateDims, num_layers: int, num_slots: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.conv = torch.zeros(num_layers, num_slots, dims.conv_dim, dims.conv_kernel - 1, dtype=dtype, device=device)
        self.recurrent: torch.Tensor | None = None
        if dims.recurrent_shape:
            self.recurrent = torch.zeros(num_layers, num_slots, *dims.recurrent_shape, dtype=torch.float32,
                                         device=device)
        self.free = list(range(num_slots - 1, -1, -1))
        self.owner: dict[str, int] = {}  # request id -> slot

    @staticmethod
    def bytes_per_slot(dims: StateDims, num_layers: int, dtype: torch.dtype) -> int:
        conv = dims.conv_dim * (dims.conv_kernel - 1) * dtype.itemsize
        recurrent = math.prod(dims.recurrent_shape) * 4 if dims.recurrent_shape else 0
        return num_layers * (conv + recurrent)

    def slot(self, request_id: str, starting: bool) -> int:
        """The request's slot, assigned when it starts; zeroed when the request starts (its first
        token is computed now: a new request, or one recomputed after preemption)."""
        slot = self.owner.get(request_id)
        if slot is None:
            # a request continuing past its first token has a slot (its state was computed or written)
            assert starting, f"request {request_id} continues without its state"
            if not self.free:
                raise RuntimeError("no free state slot: more running requests than max_num_seqs")
            slot = self.owner[request_id] = self.free.pop()
        if starting:
            self.conv[:, slot].zero_()
            if self.recurrent is not None:
                self.recurrent[:, slot].zero_()
        return slot

    def release(self, request_id: str, scratch: Sequence[int] = ()) -> None:
        """The request's slot (and any scratch slots a verify step lent it) are free again."""
        self.free.extend(scratch)
        slot = self.owner.pop(request_id, None)
        if slot is not None:
            self.free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take_scratch(self, count: int) -> list[int]:
        """`count` free slots lent to a verify step (the states after its first tokens); given back
        by `keep`. The speculation policy proposes no more than there are free slots."""
        if count > len(self.free):
            raise RuntimeError(f"{count} scratch state slots asked for, {len(self.free)} free")
        return [self.free.pop() for _ in range(count)]

    def keep(self, request_id: str, scratch: list[int], accepted: int) -> None:
        """After a verify step whose row's states after its tokens 0..k-1 went to `scratch` (its own
        slot holding the state after token k): the state after token `accepted` becomes the row's
        (its slot is swapped, nothing copied) and the other slots are free again."""
        if accepted < len(scratch):
            own = self.owner[request_id]
            self.owner[request_id], scratch = scratch[accepted], [*scratch[:accepted], own, *scratch[accepted + 1:]]
        self.free.extend(scratch)

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {"conv": self.conv} | ({"recurrent": self.recurrent} if self.recurrent is not None else {})

    def slot_layout(self) -> dict[str, tuple[list[int], torch.dtype]]:
        """One slot's tensors as `read` returns them: name -> ([layers, ...], dtype)."""
        return {name: ([t.shape[0], *t.shape[2:]], t.dtype) for name, t in self._tensors().items()}

    def read(self, request_id: str) -> dict[str, torch.Tensor]:
        """A copy (on the CPU) of the request's slot: what a handoff carries to the decode worker."""
        slot = self.owner[request_id]
        return {name: t[:, slot].to("cpu", copy=True) for name, t in self._tensors().items()}

    def write(self, request_id: str, tensors: dict[str, torch.Tensor]) -> None:
        """Resume the request from a handed-off state (of `slot_layout`, checked by the caller)."""
        slot = self.slot(request_id, starting=True)
        for name, t in self._tensors().items():
            t[:, slot].copy_(tensors[name])


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * (x * x).sum(dim=-1, keepdim=True).add_(eps).rsqrt_()  # in place on the small [..., 1] temporaries


def _heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
                 ) -> tuple[torch.Tensor, ...]:
    # [B, L, heads, d] -> [B, v_heads, L, d] fp32, q/k l2-normed and q scaled (both reference rules do this)
    rep = v.shape[2] // q.shape[2]
    if rep != 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k, v, beta, g = [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, beta, g)]
    q, k = l2norm(q), l2norm(k)
    return q, k, v, beta, g


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' torch_chunk_gated_delta_rule (l2-normed q/k), from `state` [B, Hv, Dk, Dv] fp32.
    q, k: [B, L, Hk, Dk]; v: [B, L, Hv, Dv]; g, beta: [B, L, Hv]. Returns out [B, L, Hv, Dv] (v's
    dtype) and the final state."""
    dtype, length = v.dtype, q.shape[1]
    q, k, v, beta, g = _heads_first(q, k, v, g, beta)
    q = q * q.shape[-1] ** -0.5
    pad = (chunk_size - length % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    b, h = q.shape[:2]
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = [x.reshape(b, h, -1, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta)]
    g = g.reshape(b, h, -1, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)
    pairwise = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, decayed_k_beta, upper=False, unitriangular=True)
    s = state.to(new_values)
    out = torch.zeros_like(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(q.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ s
        out[:, :, i] = q[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(b, h, -1, out.shape[-1])[:, :, :length]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), s


def slot_rows(pool: torch.Tensor, step: DecodeStep) -> tuple[torch.Tensor, bool]:
    """A decode step's rows' entries of a pool tensor [slots, ...] and whether they are a view of it: a
    view when the slots are consecutive (`step.first_slot`: the common case; then what is
    advanced in place needs no write back and nothing is copied), else a copy (index_select) for the
    caller to write back with index_copy_."""
    if step.first_slot is not None:
        return pool.narrow(0, step.first_slot, step.slots.shape[0]), True
    return pool.index_select(0, step.slots), False


def decode_conv(states: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """The depthwise causal conv's one output position for each decode row, advancing the rows'
    conv states in place. states: [slots, C, K - 1]; slots: [D]; x: [D, C] (the new inputs);
    weight: [C, 1, K]. Returns [D, C] in weight's dtype. One output position is a weighted sum over
    the K-step window: far cheaper than a conv1d call at decode's sizes (K = 4). The sum runs in
    fp32 and rounds once, as conv1d does for half types (no-op casts in fp32)."""
    window = torch.cat([states.index_select(0, slots), x[:, :, None]], dim=-1)  # [D, C, K]
    states.index_copy_(0, slots, window[:, :, 1:].to(states.dtype))
    out = (window.to(torch.float32) * weight[:, 0].to(torch.float32)).sum(-1)
    if bias is not None:
        out = out.add_(bias.to(torch.float32))
    return out.to(weight.dtype)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """transformers' torch_recurrent_gated_delta_rule (l2-normed q/k) for one token of each decode
    row, advancing `state` [D, Hv, Dk, Dv] (fp32) in place. q, k: [D, Hk, Dk]; v: [D, Hv, Dv];
    g, beta: [D, Hv]. Returns out [D, Hv, Dv] fp32. The per-head products run as batched matmuls
    over D * Hv (the reference's broadcast-multiply-and-sum, another summation order)."""
    rows, heads, dk, dv = state.shape
    qk = l2norm(torch.cat([q, k], dim=1).to(torch.float32))  # [D, 2 Hk, Dk]
    q, k = qk.split(q.shape[1], dim=1)
    if heads != q.shape[1]:
        q, k = q.repeat_interleave(heads // q.shape[1], dim=1), k.repeat_interleave(heads // k.shape[1], dim=1)
    q = q / dk ** 0.5  # the reference's division, not a reciprocal's product
    s = state.view(rows * heads, dk, dv)
    k = k.reshape(rows * heads, 1, dk)
    s.mul_(g.to(torch.float32).exp().view(-1, 1, 1))
    kv_mem = torch.bmm(k, s)  # [D Hv, 1, Dv]
    delta = (v.to(torch.float32).reshape(rows * heads, 1, dv) - kv_mem).mul_(beta.to(torch.float32).view(-1, 1, 1))
    s.baddbmm_(k.transpose(1, 2), delta)
    return torch.bmm(q.reshape(rows * heads, 1, dk), s).view(rows, heads, dv)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the delta rule's output, then times silu(z) (the reference's RMSNormGated: a plain
    `w * x_hat` weight, fp32 inside)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * h.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.to(torch.float32))).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, dims: DeltaNetDims, hidden_size: int, eps: float, state_index: int) -> None:
        super().__init__()
        self.dims = dims
        self.state_index = state_index  # this layer's index in the state pool
        d = dims
        if d.layout == "grouped":
            self.in_proj_qkvz = nn.Linear(hidden_size, 2 * d.key_dim + 2 * d.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * d.num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, d.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, d.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, d.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, d.num_v_heads, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(d.conv_dim, 1, d.conv_kernel))  # depthwise, no bias
        self.dt_bias = nn.Parameter(torch.ones(d.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(d.num_v_heads))
        self.norm = GatedRMSNorm(d.head_v_dim, eps)
        self.out_proj = nn.Linear(d.value_dim, hidden_size, bias=False)
        # the large projections run through ops (`projection_slots`: packed or quantized by prepare and
        # quantize_model); b and a (one row per value head) stay plain
        big = {"grouped": ("in_proj_qkvz",), "split": ("in_proj_qkv", "in_proj_z")}[d.layout] + ("out_proj",)
        self.op_names = tuple(name.removeprefix("in_proj_").replace("out_proj", "out") for name in big)
        for name, op_name in zip(big, self.op_names):
            set_op(self, op_name, getattr(self, name))
        self._linear_names = big
        # the native decode step (kernels' gated_delta_decode), installed by HybridModel.prepare on
        # the CPU; None: the torch ops below
        self.kernel: Any = None
        # b and a (one row per value head) as one fp32 weight [2 Hv, H] on a bf16 CPU model
        # (`join_gates`); None: their own nn.Linear
        self.gates: torch.Tensor | None = None

    def join_gates(self) -> None:
        """On the CPU in bf16 (or fp16): b and a as one fp32 matmul, the result rounded once to the
        model's dtype, as the bf16 matmul rounds its fp32 sums (so the same values but for the order
        of the sums). oneDNN's bf16 matmul has a fixed cost of ~20-70 us a call at these 16-32 rows,
        two calls a state layer: a tenth of a Qwen3.5-0.8B decode step at batch 1; sgemm's is ~3 us.
        (Not quantized with the other projections: the decays integrate a's errors over the whole
        sequence; a Q8_0 a and b moved a tiny MoE's first token by 16 logits.)"""
        first = self.in_proj_ba if self.dims.layout == "grouped" else self.in_proj_b
        if first.weight.device.type != "cpu" or first.weight.dtype not in (torch.bfloat16, torch.float16):
            return
        weights = [first.weight] if self.dims.layout == "grouped" else [self.in_proj_b.weight, self.in_proj_a.weight]
        self.gates = torch.cat([w.detach().float() for w in weights])

    def projection_slots(self) -> list[tuple[nn.Module, str, nn.Linear]]:
        return [(self, op, getattr(self, name)) for name, op in zip(self._linear_names, self.op_names)]

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        # x: [T, H] -> q|k|v [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv]
        d, t = self.dims, x.shape[0]
        joined = F.linear(x.float(), self.gates).to(x.dtype) if self.gates is not None else None  # [T, 2 Hv]
        if d.layout == "split":
            b, a = joined.split(d.num_v_heads, dim=-1) if joined is not None else (self.in_proj_b(x), self.in_proj_a(x))
            return self.qkv(x), self.z(x).view(t, d.num_v_heads, d.head_v_dim), b, a
        # Qwen3-Next: per key head [q, k, v (rep heads), z (rep heads)] and [b (rep), a (rep)]
        rep = d.num_v_heads // d.num_k_heads
        qkvz = self.qkvz(x).view(t, d.num_k_heads, -1)
        q, k, v, z = torch.split(qkvz, [d.head_k_dim, d.head_k_dim, rep * d.head_v_dim, rep * d.head_v_dim], dim=2)
        ba = joined if joined is not None else self.in_proj_ba(x)
        b, a = torch.split(ba.view(t, d.num_k_heads, 2 * rep), [rep, rep], dim=2)
        qkv = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        return qkv, z.reshape(t, d.num_v_heads, d.head_v_dim), b.reshape(t, -1), a.reshape(t, -1)

    def _split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # [B, L, conv_dim] -> q, k [B, L, Hk, Dk], v [B, L, Hv, Dv]
        d = self.dims
        q, k, v = torch.split(mixed, [d.key_dim, d.key_dim, d.value_dim], dim=-1)
        b, length = mixed.shape[:2]
        return (q.reshape(b, length, -1, d.head_k_dim), k.reshape(b, length, -1, d.head_k_dim),
                v.reshape(b, length, -1, d.head_v_dim))

    def forward(self, x: torch.Tensor, pool: StatePool, meta: StateMeta) -> torch.Tensor:
        # x: [T, H] -> [T, H]; the rows' states in `pool` are read and advanced
        d = self.dims
        qkv, z, b, a = self._project(x)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        assert pool.recurrent is not None
        conv_states, rec_states = pool.conv[self.state_index], pool.recurrent[self.state_index]
        weight = self.conv1d.weight
        normed = x.new_empty(x.shape[0], d.value_dim)  # the gated norm of the rule's output, per row
        for step in meta.steps():
            rows = step.rows
            n = step.slots.shape[0]
            if self.kernel is not None:  # the native step: conv, silu, the rule and the norm
                normed[rows] = self.kernel.gated_delta_decode(
                    qkv[rows], z[rows].reshape(n, -1), g[rows], beta[rows].float(), conv_states, weight, rec_states,
                    step.slots, self.norm.weight, self.norm.eps, d.num_k_heads, d.head_k_dim)
            else:
                mixed = F.silu(decode_conv(conv_states, step.slots, qkv[rows], weight)).to(qkv.dtype)  # [n, C]
                q, k, v = torch.split(mixed, [d.key_dim, d.key_dim, d.value_dim], dim=-1)
                state, in_pool = slot_rows(rec_states, step)  # [n, Hv, Dk, Dv], advanced in place
                o = recurrent_gated_delta_rule(q.view(n, -1, d.head_k_dim), k.view(n, -1, d.head_k_dim),
                                               v.view(n, -1, d.head_v_dim), g[rows], beta[rows], state)
                if not in_pool:
                    rec_states.index_copy_(0, step.slots, state)
                normed[rows] = self._gated_norm(o.to(x.dtype), z[rows])
            after_step(pool, self.state_index, step)
        keep = d.conv_kernel - 1
        for start, length, slot in meta.spans:
            end = start + length
            if self.kernel is not None:  # the same conv and silu in the rows' layout, the state in place
                mixed = self.kernel.causal_conv_silu(qkv[start:end], conv_states[slot], weight)[None]  # [1, L, C]
            else:
                window = torch.cat([conv_states[slot], qkv[start:end].T], dim=-1).to(weight.dtype)  # [C, keep + L]
                conv_states[slot] = window[:, window.shape[1] - keep:]
                mixed = F.silu(F.conv1d(window[None], weight, groups=d.conv_dim)).to(qkv.dtype).transpose(1, 2)
            q, k, v = self._split_heads(mixed)
            o, s = chunk_gated_delta_rule(q, k, v, g[None, start:end], beta[None, start:end],
                                          rec_states[slot:slot + 1])
            rec_states[slot] = s[0]
            normed[start:end] = self._gated_norm(o[0], z[start:end])
        return self.out(normed)

    def _gated_norm(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        # the rule's output [R, Hv, Dv] and the gate [R, Hv, Dv], both the model's dtype -> [R, value_dim]
        d = self.dims
        return self.norm(out.reshape(-1, d.head_v_dim), z.reshape(-1, d.head_v_dim)).view(-1, d.value_dim)
