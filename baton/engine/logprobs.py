"""Log-probabilities a request asked for: the sampled (or prompt) token's and the top k.

They come from the model's raw logits (vLLM's default, `raw_logprobs`): what the model thinks of
the token, not what penalties, bias or the warpers made of it, so they can be compared with any
other implementation of the model (the tests check them against transformers' log-softmax).
"""

from __future__ import annotations

import torch

# One token's alternatives: [[token id, logprob], ...], most likely first (lists: msgpack-able).
TopLogprobs = list[list[float]]


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top_k: list[int]) -> tuple[list[float], list[TopLogprobs]]:
    """Per row: log p(token_ids[row]) and the top_k[row] most likely tokens with theirs.

    logits: [R, V] (any float dtype; computed in fp32); token_ids, top_k: one per row.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device).unsqueeze(1)
    chosen = logprobs.gather(1, ids).squeeze(1).tolist()
    k_max = max(top_k, default=0)
    if k_max == 0:
        return chosen, [[] for _ in token_ids]
    values, indices = logprobs.topk(k_max, dim=-1)  # [R, k_max], sorted descending
    values_list, indices_list = values.tolist(), indices.tolist()
    tops = [[[indices_list[row][j], values_list[row][j]] for j in range(k)] for row, k in enumerate(top_k)]
    return chosen, tops
