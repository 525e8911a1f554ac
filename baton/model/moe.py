"""Sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral, GLM-4.5), batched by expert.

Rules: routing is the reference's, op for op, in fp32. softmax_topk: softmax over all experts, top-k,
renormalised where the family does (Mixtral always, Qwen3-MoE when `norm_topk_prob`).
sigmoid_grouped (GLM-4.5, transformers' Glm4MoeTopkRouter): sigmoid scores; the experts are chosen
by score + `e_score_correction_bias` among the best `topk_group` of `n_group` groups (a group ranked
by its two best), weighted by their plain scores, renormalised if `norm_topk_prob`, times
`routed_scaling_factor`; its router weight and bias stay fp32 whatever the model's dtype, as the
reference keeps them. sigmoid_input (Llama 4, Llama4Router and Llama4TextMoe): the sigmoid of the
top-k logits scales each chosen expert's input, not its output, beside one shared expert.
topk_softmax (gpt-oss, transformers' GptOssTopKRouter): the router has a
bias; the top-k of its logits, softmax over those k alone. gpt-oss's experts (`expert_form`
"gpt_oss", GptOssExperts) have biases and the clamped SwiGLU: gate clamped above at `swiglu_limit`,
up clamped both sides, (up + 1) * gate * sigmoid(alpha * gate). Shared experts (GLM-4.5) are one
dense MLP every token runs, added after the routed ones. The routed experts run batched by expert:
the step's (token, choice) pairs are sorted by expert, and each selected expert runs once
over all the tokens routed to it (one gate_up and one down matmul), so a decode step reads each
selected expert's weights once, whatever the batch. Results are scatter-added in ascending expert
order, the order transformers adds them in, so fp32 sums agree with it bit for bit.

Weights are stacked per layer: `experts_gate_up` [E, 2I, H] (gate rows, then up rows) and
`experts_down` [E, H, I], transformers 5's own layout (the loader stacks per-expert checkpoints;
gpt-oss's [E, H, 2I] interleaved and [E, I, H] are transposed and de-interleaved into it, with
their biases `experts_gate_up_bias` [E, 2I] and `experts_down_bias` [E, H]).

Quantized experts (`use_quantized_experts`): each expert's gate_up and down are then a
`QuantizedLinear` (Q8_0 blocks on the native integer kernel: gpt-oss's MXFP4 experts repacked
without loss at load, `baton.model.mxfp4.repack_q8_0`, or any MoE's experts under --quantization
int8, `baton.model.quant`), and the dense stacks are gone (None): the quantized copy is the only one.
Biases and the clamped SwiGLU are unchanged; a bias is added after the op.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from baton.model.config import ModelConfig
from baton.model.linear import QuantizedLinear

# (token, expert) rows up to which a step's chosen experts run as one native call per projection (each
# row reads its expert's weight: past a few tokens, experts shared by several rows are cheaper read once)
ROWS_AT_ONCE = 32


def activation(name: str):  # -> Callable[[Tensor], Tensor]
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return F.silu


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, shared_experts: nn.Module | None = None) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.top_k, self.intermediate = e, config.num_experts_per_tok, i
        self.renormalize = config.norm_topk_prob
        self.router = config.router
        self.hidden = h
        # the router; "external": the model routes (Gemma 4's router reads another input) and calls `mix`
        self.gate = nn.Linear(h, e, bias=self.router == "topk_softmax") if self.router != "external" else None
        if self.router == "sigmoid_grouped":
            self.score_correction_bias = nn.Parameter(torch.zeros(e))  # shifts the choice, not the weights
            self.n_group, self.topk_group = config.n_group, config.topk_group
            self.routed_scaling_factor = config.routed_scaling_factor
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.experts_down = nn.Parameter(torch.empty(e, h, i))
        # per expert (gate_up [2I, H], down [H, I]) once quantized (`use_quantized_experts`), else None
        self.expert_ops: list[tuple[QuantizedLinear, QuantizedLinear]] | None = None
        # the native kernels when every expert op is a plain native one (`use_quantized_experts`): a
        # decode step's chosen experts then run as two calls a layer (`_chosen_experts_at_once`)
        self.rows_kernel: Any = None
        self.clamped_swiglu = config.expert_form == "gpt_oss"
        self.experts_gate_up_bias: nn.Parameter | None = None  # [E, 2I] (gpt-oss)
        self.experts_down_bias: nn.Parameter | None = None  # [E, H] (gpt-oss)
        if self.clamped_swiglu:
            self.experts_gate_up_bias = nn.Parameter(torch.empty(e, 2 * i))
            self.experts_down_bias = nn.Parameter(torch.empty(e, h))
            self.swiglu_limit, self.swiglu_alpha = config.swiglu_limit, config.swiglu_alpha
        self.act = activation(config.hidden_act)
        self.shared_experts = shared_experts  # a dense MLP (baton.model.model.MLP) every token runs, or None

    def use_quantized_experts(self, gate_up: list[QuantizedLinear], down: list[QuantizedLinear]) -> None:
        """Serve the experts from these ops (one per expert, [2I, H] and [H, I]) and drop the dense stacks."""
        if len(gate_up) != self.num_experts or len(down) != self.num_experts:
            raise ValueError(f"{len(gate_up)} gate_up and {len(down)} down ops for {self.num_experts} experts")
        self.expert_ops = list(zip(gate_up, down))
        self.experts_gate_up = None  # type: ignore[assignment]
        self.experts_down = None  # type: ignore[assignment]
        kernels = gate_up[0]._kernels
        self.rows_kernel = None
        if (kernels is not None and hasattr(kernels, "qgemv_rows") and not self.clamped_swiglu
                and self.router != "sigmoid_input" and self.experts_gate_up_bias is None
                and self.experts_down_bias is None
                and all(op._kernels is kernels and op.bias is None and op.input_order is None
                        and op.packed is not None and op.packed.shape == ops[0].packed.shape
                        for ops in (gate_up, down) for op in ops)):
            self.rows_kernel = kernels

    def fp32_parameters(self) -> tuple[str, ...]:
        """Parameters the loader keeps in fp32 whatever the model's dtype (the reference's
        `_keep_in_fp32_modules_strict`)."""
        return ("gate.weight", "score_correction_bias") if self.router == "sigmoid_grouped" else ()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> weights [T, k] (fp32), chosen experts [T, k]
        if self.router == "sigmoid_grouped":
            return self._route_sigmoid_grouped(x)
        if self.router == "topk_softmax":  # GptOssTopKRouter.forward, op for op
            top, chosen = torch.topk(self.gate(x), self.top_k, dim=-1)  # [T, k] each
            return torch.softmax(top, dim=1, dtype=top.dtype), chosen
        if self.router == "sigmoid_input":  # Llama4Router.forward: the sigmoid of the top-k logits
            top, chosen = torch.topk(self.gate(x), self.top_k, dim=-1)  # [T, k] each
            return torch.sigmoid(top.float()).to(top.dtype), chosen
        logits = self.gate(x)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def _route_sigmoid_grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # transformers' Glm4MoeTopkRouter.forward, op for op
        e, groups = self.num_experts, self.n_group
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()  # [T, E]
        for_choice = scores + self.score_correction_bias
        group_scores = for_choice.view(-1, groups, e // groups).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, groups, e // groups).reshape(-1, e)
        for_choice = for_choice.masked_fill(~score_mask.bool(), float("-inf"))
        chosen = torch.topk(for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return weights * self.routed_scaling_factor, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        weights, chosen = self.route(x)
        if self.router != "sigmoid_grouped":
            weights = weights.to(x.dtype)  # GLM's reference weighs in fp32, then rounds (below)
        return self.mix(x, weights, chosen)

    def mix(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The chosen experts' outputs weighed and summed, plus the shared experts': x [T, H], weights
        and chosen [T, k] -> [T, H]; each expert's rows weighed in the weights' dtype, then rounded."""
        flat = chosen.flatten()  # [T * k]: choice c of token t at t * k + c
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one sync per layer (CPU: free)
        token_of = order // self.top_k  # [T * k] tokens, grouped by expert
        weight_of = weights.flatten()[order]
        if self.rows_kernel is not None and len(flat) <= ROWS_AT_ONCE:
            out = self._chosen_experts_at_once(x, counts, token_of, weight_of)
            return out if self.shared_experts is None else out + self.shared_experts(x)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[start:start + count]
            if self.router == "sigmoid_input":  # Llama4TextMoe: the score weighs the expert's input
                out.index_add_(0, tokens, self._expert(x[tokens] * weight_of[start:start + count, None], expert))
            else:
                h = self._expert(x[tokens], expert)  # [count, H]
                out.index_add_(0, tokens, (h * weight_of[start:start + count, None]).to(x.dtype))
            start += count
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _chosen_experts_at_once(self, x: torch.Tensor, counts: list[int], token_of: torch.Tensor,
                                weight_of: torch.Tensor) -> torch.Tensor:
        """The loop below for a few tokens (decode), its numbers bit for bit: each (token, expert) row
        through its expert's gate_up, then down, in one native call each (`qgemv_rows`: every row
        computed as qgemv computes it alone), instead of two calls and ~8 ops per expert (a Qwen3-MoE
        token at one client: 8 experts in each of 12 layers, ~1000 ops a step)."""
        assert self.expert_ops is not None
        experts = [expert for expert, count in enumerate(counts) for _ in range(count)]  # row -> its expert
        gate_up = self.rows_kernel.qgemv_rows(x[token_of], [self.expert_ops[e][0].packed for e in experts],
                                              self.expert_ops[0][0].out_features)  # [R, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        h = self.rows_kernel.qgemv_rows(self.act(gate) * up, [self.expert_ops[e][1].packed for e in experts],
                                        self.expert_ops[0][1].out_features)  # [R, H]
        contributions = (h * weight_of[:, None]).to(x.dtype)  # [R, H], grouped by expert
        # each token's rows, its experts ascending: added one at a time, each sum rounded to the dtype as
        # the loop's index_add_ of one expert rounds it (one index_add_ of all rows sums a token's
        # contributions before rounding: other bits)
        per_token = torch.argsort(token_of, stable=True).view(x.shape[0], -1)  # [T, k]
        out = torch.zeros_like(x)
        for j in range(per_token.shape[1]):
            out += contributions[per_token[:, j]]
        return out

    def _project(self, x: torch.Tensor, expert: int, which: int) -> torch.Tensor:
        # x: [n, in] -> [n, out] through expert `expert`'s gate_up (which 0) or down (which 1), with its bias
        bias = self.experts_gate_up_bias if which == 0 else self.experts_down_bias
        if self.expert_ops is not None:
            out = self.expert_ops[expert][which](x)
            return out if bias is None else out + bias[expert]
        weight = self.experts_gate_up if which == 0 else self.experts_down
        return F.linear(x, weight[expert], None if bias is None else bias[expert])

    def _expert(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        # x: [n, H] -> [n, H], one expert over the tokens routed to it
        if not self.clamped_swiglu:
            gate, up = self._project(x, expert, 0).chunk(2, dim=-1)
            return self._project(self.act(gate) * up, expert, 1)
        # GptOssExperts: gate and up de-interleaved at load (gate rows, then up rows)
        gate, up = self._project(x, expert, 0).chunk(2, dim=-1)
        gate = gate.clamp(min=None, max=self.swiglu_limit)
        up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        glu = gate * torch.sigmoid(gate * self.swiglu_alpha)
        return self._project((up + 1) * glu, expert, 1)
