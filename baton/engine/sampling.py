"""The batched sampler: one token per row, each row with its own `SamplingParams`."""

from __future__ import annotations

import hashlib

import torch

from baton.model.runtime import greedy_pick
from baton.common.sampling_params import SamplingParams


def _token_generator(seed: int, index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for draw number `index` of a request: stateless, so any process reproduces it."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return generator


def apply_repetition_penalty(logits: torch.Tensor, token_ids: list[int], penalty: float) -> None:
    # logits: [V], modified in place (the reference's rule: divide positive logits, multiply negative)
    if penalty == 1.0 or not token_ids:
        return
    ids = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=logits.device)
    scores = logits[ids]
    logits[ids] = torch.where(scores > 0, scores / penalty, scores * penalty)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k and top-p for every sampled row at once (one sort for the batch, not one
    per row); each row keeps its own parameters. logits: [R, V] fp32 -> probabilities [R, V]."""
    num_rows, vocab = logits.shape
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    logits = logits / temperature.unsqueeze(1)
    if any(p.min_p > 0 for p in params):
        # min-p: p(token) < min_p * p(top) <=> logit < top logit + log(min_p) (no softmax needed)
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=device)
        floor = logits.max(dim=-1).values + torch.log(min_p)  # -inf where min_p is 0: nothing dropped
        logits = logits.masked_fill(logits < floor.unsqueeze(1), float("-inf"))
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if all(k == vocab for k in top_k) and all(q >= 1.0 for q in top_p):
        return torch.softmax(logits, dim=-1)
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
    # top-k: drop what is below the k-th largest value (ties with it stay, as in transformers)
    kth = sorted_logits.gather(1, torch.tensor(top_k, device=device).unsqueeze(1) - 1)
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # top-p on what top-k left: drop tokens once the mass before them already reaches top_p (the top
    # one always stays)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= torch.tensor(top_p, dtype=logits.dtype, device=device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
    return torch.softmax(filtered, dim=-1)


def apply_output_penalties(logits: torch.Tensor, output_ids: list[int], presence: float, frequency: float) -> None:
    # logits: [V], modified in place (OpenAI's rule, on the output so far: presence once per
    # distinct token, frequency once per occurrence)
    if not output_ids or (presence == 0.0 and frequency == 0.0):
        return
    ids, counts = torch.tensor(output_ids, dtype=torch.long, device=logits.device).unique(return_counts=True)
    logits[ids] -= presence + frequency * counts.to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, bias: list[list[float]]) -> None:
    # logits: [V], modified in place; ids outside the vocabulary (the gateway refuses them) are skipped
    pairs = [(int(b[0]), float(b[1])) for b in bias if 0 <= int(b[0]) < logits.shape[0]]
    if pairs:
        ids = torch.tensor([i for i, _ in pairs], dtype=torch.long, device=logits.device)
        logits[ids] += torch.tensor([v for _, v in pairs], dtype=logits.dtype, device=logits.device)


def suppress_early_stops(logits: torch.Tensor, params: list[SamplingParams], num_outputs: list[int],
                         eos_token_ids: list[int]) -> torch.Tensor:
    """min_tokens: the stop tokens (EOS unless ignore_eos, and stop_token_ids) get no probability in
    rows that have fewer outputs than their min_tokens. Returns `logits` itself when no row needs it.
    logits: [S, V]."""
    # (a constrained row is left to its grammar, which may allow nothing but EOS)
    rows = [i for i, p in enumerate(params) if num_outputs[i] < p.min_tokens and p.structured is None]
    if not rows:
        return logits
    logits = logits.clone()  # inference-mode tensors refuse in-place edits outside it
    for i in rows:
        p = params[i]
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
        if banned:
            logits[i, torch.tensor(banned, dtype=torch.long, device=logits.device)] = float("-inf")
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
           draw_indices: list[int], prompt_lens: list[int] | None = None) -> tuple[list[int], list[float]]:
    """Pick one token per row.

    logits: [S, V] fp32; params/histories/draw_indices: one per row (history = prompt + output so
    far, for the penalties; draw index = output position, for reproducible seeds; prompt_lens: where
    the output starts in the history, for presence/frequency penalties).
    Returns the token ids and their log-probabilities under the distribution sampled from.
    """
    logits = logits.float()
    if any(p.edits_logits for p in params):
        # The edits are in place: work on a copy, never on the caller's tensor (the model's logits
        # are inference-mode tensors, which refuse in-place updates outside it).
        logits = logits.clone()
    for row, p in enumerate(params):
        if not p.edits_logits:
            continue
        apply_repetition_penalty(logits[row], histories[row], p.repetition_penalty)
        start = prompt_lens[row] if prompt_lens is not None else 0
        apply_output_penalties(logits[row], histories[row][start:], p.presence_penalty, p.frequency_penalty)
        apply_logit_bias(logits[row], p.logit_bias)
    token_list, logprob_list = greedy_pick(logits)
    rows = [row for row, p in enumerate(params) if not p.greedy]
    if not rows:
        return token_list, logprob_list
    probs = _filtered_probs(logits[rows], [params[row] for row in rows])  # [R, V]
    for i, row in enumerate(rows):
        p = params[row]
        # Exponential race (Gumbel-max in another form): argmax(p / E) with E ~ Exp(1) is a draw
        # from p, and the draw depends only on (seed, index): not on the batch, nor the worker.
        noise = torch.empty_like(probs[i]).exponential_(
            generator=_token_generator(p.seed, draw_indices[row], probs.device))
        token = int((probs[i] / noise).argmax())
        token_list[row] = token
        logprob_list[row] = float(torch.log(probs[i, token]))
    return token_list, logprob_list
