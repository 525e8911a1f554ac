"""The greedy pick of a step's logits: the native kernel's one pass per row where it is loaded."""

from __future__ import annotations

import torch

from baton.model import kernels as native_kernels


def greedy_pick(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """argmax per row (first index on ties) and its log-probability. logits: [S, V] fp32."""
    kernels = native_kernels.loaded()
    if kernels is not None and logits.device.type == "cpu":
        tokens, logprobs = kernels.greedy_pick(logits)
    else:
        tokens = logits.argmax(dim=-1)
        # log p(token) = logit - logsumexp(logits): one reduction per row instead of a full
        # [S, V] log_softmax followed by a gather
        logprobs = logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=-1)
    return tokens.tolist(), logprobs.tolist()
