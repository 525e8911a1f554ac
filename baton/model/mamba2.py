"""Granite 4.0-H's Mamba-2 mixer: a state layer whose memory per request is its causal conv's last
`conv_kernel - 1` inputs and an SSM state [heads, head_dim, state_size], as transformers'
modeling_granitemoehybrid.py computes it on its torch path (`GraniteMoeHybridMambaLayer`,
`causal_conv1d_*`, `mamba2_chunk_scan`, `mamba2_selective_state_update`,
`GraniteMoeHybridRMSNormGated`), which is the parity oracle of the tests:

in_proj -> gate | xBC | dt; xBC through a depthwise causal conv (bias) and silu; x | B | C; the SSD
scan with A = -exp(A_log), dt = softplus(dt + dt_bias) (clamped to `time_step_limit` on the chunked
path, as the reference), B and C shared by the heads of each of `n_groups` groups, plus D * x;
the gated RMSNorm (y * silu(gate), normed per group); out_proj.

The state lives in the runner's `StatePool` like the Gated DeltaNet's (conv state in the model's
dtype, SSM state fp32: the recurrence accumulates in it); decode rows run together through the
recurrent update, each prefill span through the chunked scan from its slot's state, so a prompt
split over steps computes what one call over the whole prompt does.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch
import torch.nn.functional as F
from torch import nn

from baton.model.gated_deltanet import StateMeta, StatePool, after_step, decode_conv, slot_rows
from baton.model.model import set_op


@dataclass(frozen=True)
class Mamba2Dims:
    """A Mamba-2 layer's sizes (config.json's `mamba_*` keys)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    eps: float
    dt_min: float = 0.0
    dt_max: float = float("inf")
    layout: str = "mamba2"

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def recurrent_shape(self) -> tuple[int, ...]:
        return (self.num_heads, self.head_dim, self.state_size)


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    # [..., L] -> [..., L, L]: out[i, j] = sum(x[j+1 .. i]) for j <= i, -inf above the diagonal
    # (the reference's masked-cumsum form, stabler than differences of one cumsum)
    length = x.shape[-1]
    x = x[..., None].expand(*x.shape, length)
    below = torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=-1)
    out = torch.cumsum(x.masked_fill(~below, 0), dim=-2)
    on_or_below = torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=0)
    return out.masked_fill(~on_or_below, -torch.inf)


def chunk_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
               d: torch.Tensor, state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' mamba2_chunk_scan (the SSD chunked algorithm) for one sequence, fp32, from
    `state` [H, P, N]. x: [L, H, P]; dt: [L, H] (after softplus and the limits); a: [H];
    b, c: [L, G, N]; d: [H]. Returns y [L, H, P] (with the D skip) and the final state."""
    length, heads = x.shape[:2]
    x = x.float()
    rep = heads // b.shape[1]
    b = b.float().repeat_interleave(rep, dim=1)
    c = c.float().repeat_interleave(rep, dim=1)
    pad = (chunk_size - length % chunk_size) % chunk_size
    skip = d[:, None] * x
    x = x * dt[..., None]
    a = a * dt  # [L, H]

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [L, ...] -> [chunks, chunk_size, ...]
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.reshape(-1, chunk_size, *t.shape[1:])

    x, a, b, c = chunks(x), chunks(a), chunks(b), chunks(c)  # [c, l, h, p], [c, l, h], [c, l, h, n] x2
    a = a.permute(2, 0, 1)  # [h, c, l]
    a_cumsum = torch.cumsum(a, dim=-1)
    # 1. within each chunk (the diagonal blocks)
    decay = torch.exp(_segment_sum(a))  # [h, c, l, s]
    scores = torch.einsum("clhn,cshn->clsh", c, b) * decay.permute(1, 2, 3, 0)
    y_diag = torch.einsum("clsh,cshp->clhp", scores, x)
    # 2. each chunk's own contribution to the state at its end
    decay_states = torch.exp(a_cumsum[:, :, -1:] - a_cumsum)  # [h, c, l]
    states = torch.einsum("clhn,clhp->chpn", b * decay_states.permute(1, 2, 0)[..., None], x)
    # 3. the state at each chunk's start: the recurrence across chunks, from `state`
    states = torch.cat([state[None].to(states), states], dim=0)  # [c + 1, h, p, n]
    decay_chunk = torch.exp(_segment_sum(F.pad(a_cumsum[:, :, -1], (1, 0))))  # [h, c + 1, c + 1]
    new_states = torch.einsum("hzc,chpn->zhpn", decay_chunk, states)
    states, final = new_states[:-1], new_states[-1]
    # 4. the start states' contribution to each position's output
    y_off = torch.einsum("clhn,chpn->clhp", c, states) * torch.exp(a_cumsum).permute(1, 2, 0)[..., None]
    y = (y_diag + y_off).reshape(-1, heads, x.shape[-1])[:length]
    return y + skip, final


def recurrent_step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   d: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """transformers' mamba2_selective_state_update for one token of each row, fp32, advancing `state`
    [R, H, P, N] in place. x: [R, H, P]; dt: [R, H] (after softplus); b, c: [R, G, N]. Returns
    y [R, H, P]. The outer product x (dt B) and the contraction with C run as batched matmuls over
    R * H."""
    rows, heads, p, n = state.shape
    rep = heads // b.shape[1]
    x, b, c = x.float(), b.float().repeat_interleave(rep, dim=1), c.float().repeat_interleave(rep, dim=1)
    s = state.view(rows * heads, p, n)
    s.mul_(torch.exp(dt * a).view(-1, 1, 1))
    s.baddbmm_(x.reshape(rows * heads, p, 1), (dt[..., None] * b).view(rows * heads, 1, n))
    y = torch.bmm(s, c.reshape(rows * heads, n, 1)).view(rows, heads, p)
    return y.add_(x * d[:, None])


class GroupedGatedRMSNorm(nn.Module):
    """The reference's RMSNormGated: (y * silu(gate)) normed over each of `groups` equal slices, fp32
    inside, times the weight."""

    def __init__(self, dim: int, groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups, self.eps = groups, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() * F.silu(gate.float())
        grouped = h.view(*h.shape[:-1], self.groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.view(h.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, dims: Mamba2Dims, state_index: int) -> None:
        super().__init__()
        self.dims = dims
        self.state_index = state_index  # this layer's index in the state pool
        d = dims
        self.in_proj = nn.Linear(d.hidden_size, d.intermediate_size + d.conv_dim + d.num_heads, bias=d.proj_bias)
        # depthwise: weight [conv_dim, 1, kernel] (the checkpoint's nn.Conv1d; its forward unused)
        self.conv1d = nn.Conv1d(d.conv_dim, d.conv_dim, d.conv_kernel, groups=d.conv_dim, bias=d.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(d.num_heads))
        self.A_log = nn.Parameter(torch.zeros(d.num_heads))
        self.D = nn.Parameter(torch.ones(d.num_heads))
        self.norm = GroupedGatedRMSNorm(d.intermediate_size, d.n_groups, d.eps)
        self.out_proj = nn.Linear(d.intermediate_size, d.hidden_size, bias=d.proj_bias)
        set_op(self, "in_op", self.in_proj)  # through ops: packed or quantized (`projection_slots`)
        set_op(self, "out_op", self.out_proj)

    def projection_slots(self) -> list[tuple[nn.Module, str, nn.Linear]]:
        return [(self, "in_op", self.in_proj), (self, "out_op", self.out_proj)]

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # [R, conv_dim] -> x [R, H, P], B, C [R, G, N]
        d, rows = self.dims, xbc.shape[0]
        x, b, c = torch.split(xbc, [d.intermediate_size, d.n_groups * d.state_size, d.n_groups * d.state_size], -1)
        return (x.reshape(rows, d.num_heads, d.head_dim), b.reshape(rows, d.n_groups, d.state_size),
                c.reshape(rows, d.n_groups, d.state_size))

    def forward(self, hidden: torch.Tensor, pool: StatePool, meta: StateMeta) -> torch.Tensor:
        # hidden: [T, hidden] -> [T, hidden]; the rows' conv and SSM states in `pool` are read and advanced
        d, dtype = self.dims, hidden.dtype
        gate, xbc, dt = torch.split(self.in_op(hidden), [d.intermediate_size, d.conv_dim, d.num_heads], dim=-1)
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype)).float()  # [T, H]
        a = -torch.exp(self.A_log.float())
        skip = self.D.float()
        assert pool.recurrent is not None
        conv_states, ssm_states = pool.conv[self.state_index], pool.recurrent[self.state_index]
        weight, bias, keep = self.conv1d.weight, self.conv1d.bias, d.conv_kernel - 1
        y = torch.empty(hidden.shape[0], d.num_heads, d.head_dim, dtype=torch.float32, device=hidden.device)
        for step in meta.steps():
            rows = step.rows
            mixed = F.silu(decode_conv(conv_states, step.slots, xbc[rows], weight, bias)).to(dtype)  # [n, C]
            x, b, c = self._split(mixed)
            state, in_pool = slot_rows(ssm_states, step)  # [n, H, P, N], advanced in place
            # the reference's recurrent form applies no time-step limits
            y[rows] = recurrent_step(x, dt[rows], a, b, c, skip, state)
            if not in_pool:
                ssm_states.index_copy_(0, step.slots, state)
            after_step(pool, self.state_index, step)
        for start, length, slot in meta.spans:
            end = start + length
            window = torch.cat([conv_states[slot], xbc[start:end].T], dim=-1).to(weight.dtype)  # [C, keep + L]
            conv_states[slot] = window[:, window.shape[1] - keep:].to(conv_states.dtype)
            mixed = F.silu(F.conv1d(window[None], weight, bias, groups=d.conv_dim))[0].T.to(dtype)  # [L, C]
            x, b, c = self._split(mixed)
            out, state = chunk_scan(x, dt[start:end].clamp(d.dt_min, d.dt_max), a, b, c, skip, ssm_states[slot],
                                    d.chunk_size)
            ssm_states[slot] = state
            y[start:end] = out
        normed = self.norm(y.reshape(-1, d.intermediate_size), gate)
        return self.out_op(normed.to(dtype))
