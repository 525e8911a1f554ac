"""Sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral), batched by expert.

Rules: routing is the reference's (softmax over all experts in fp32, top-k, renormalised where the
family does: Mixtral always, Qwen3-MoE when `norm_topk_prob`); the experts then run batched by
expert: the step's (token, choice) pairs are sorted by expert, and each selected expert runs once
over all the tokens routed to it (one gate_up and one down matmul), so a decode step reads each
selected expert's weights once, whatever the batch. Results are scatter-added in ascending expert
order, the order transformers adds them in, so fp32 sums agree with it bit for bit.

Weights are stacked per layer: `experts_gate_up` [E, 2I, H] (gate rows, then up rows) and
`experts_down` [E, H, I], transformers 5's own layout (the loader stacks per-expert checkpoints).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.model.config import ModelConfig


def activation(name: str):  # -> Callable[[Tensor], Tensor]
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return F.silu


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.top_k, self.intermediate = e, config.num_experts_per_tok, i
        self.renormalize = config.norm_topk_prob
        self.gate = nn.Linear(h, e, bias=False)  # the router
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.experts_down = nn.Parameter(torch.empty(e, h, i))
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        logits = self.gate(x)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        flat = chosen.flatten()  # [T * k]: choice c of token t at t * k + c
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one sync per layer (CPU: free)
        token_of = order // self.top_k  # [T * k] tokens, grouped by expert
        weight_of = weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[start:start + count]
            gate, up = F.linear(x[tokens], self.experts_gate_up[expert]).chunk(2, dim=-1)
            h = F.linear(self.act(gate) * up, self.experts_down[expert])  # [count, H]
            out.index_add_(0, tokens, h * weight_of[start:start + count, None])
            start += count
        return out
