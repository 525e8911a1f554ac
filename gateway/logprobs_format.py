"""Log-probabilities in the shapes the APIs answer with.

The workers send, per generated token, its logprob and its top k as [[token id, logprob], ...],
and per prompt token (the first excepted) [logprob, top k] (see baton.common.protocol.TokenEvent). Here
they become: OpenAI completions' `{tokens, token_logprobs, top_logprobs, text_offset}` (with echo,
the prompt's tokens first), OpenAI chat's `{content: [{token, logprob, bytes, top_logprobs}]}`,
and TGI's `top_tokens` / `prefill`. Token strings are each token decoded alone (as vLLM shows them).
"""

from __future__ import annotations

from typing import Any

from gateway.generation import TokenOut
from gateway.tokenizer import PromptTokenizer


class CompletionLogprobs:
    """OpenAI completions' logprobs object, built in pieces (a stream sends one per chunk) with
    `text_offset` counting from the start of the choice's text."""

    def __init__(self, tokenizer: PromptTokenizer) -> None:
        self.tokenizer = tokenizer
        self.offset = 0

    def prompt(self, prompt_ids: list[int], prompt_logprobs: list[Any] | None) -> dict[str, Any]:
        """The echoed prompt's part: its first token has no logprob (nothing precedes it)."""
        entries = prompt_logprobs or [None] * len(prompt_ids)
        rows = [(tid, e[0] if e else None, self._top(tid, e[0], e[1]) if e else None)
                for tid, e in zip(prompt_ids, entries)]
        return self._part(rows)

    def tokens(self, tokens: list[TokenOut]) -> dict[str, Any]:
        return self._part([(t.id, t.logprob, self._top(t.id, t.logprob, t.top or [])) for t in tokens])

    def _top(self, token_id: int, logprob: float | None, top: list[list[float]]) -> dict[str, float]:
        # vLLM's dict holds the top k and the chosen token (k + 1 entries when it is not among them)
        out = {self.tokenizer.token_text(int(i)): lp for i, lp in top}
        if logprob is not None:
            out.setdefault(self.tokenizer.token_text(token_id), logprob)
        return out

    def _part(self, rows: list[tuple[int, float | None, dict[str, float] | None]]) -> dict[str, Any]:
        texts = [self.tokenizer.token_text(tid) for tid, _, _ in rows]
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": texts, "token_logprobs": [lp for _, lp, _ in rows],
                "top_logprobs": [top for _, _, top in rows], "text_offset": offsets}


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate completions logprobs parts (prompt, then output) into one object."""
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in merged:
            merged[key] += part[key]
    return merged


def chat_logprobs(tokenizer: PromptTokenizer, tokens: list[TokenOut]) -> dict[str, Any]:
    """OpenAI chat's `logprobs` object for these tokens."""

    def entry(token_id: int, logprob: float | None) -> dict[str, Any]:
        text = tokenizer.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t.id, t.logprob), "top_logprobs": [entry(int(i), lp) for i, lp in t.top or []]}
                        for t in tokens]}


def tgi_top_tokens(tokenizer: PromptTokenizer, token: TokenOut) -> list[dict[str, Any]]:
    """TGI's top_tokens entry for one generated token: [{id, text, logprob, special}]."""
    special = tokenizer.special_ids
    return [{"id": int(i), "text": tokenizer.token_text(int(i)), "logprob": lp, "special": int(i) in special}
            for i, lp in token.top or []]


def tgi_prefill(tokenizer: PromptTokenizer, prompt_ids: list[int], prompt_logprobs: list[Any] | None) -> list[dict[str, Any]]:
    """TGI's details.prefill: every prompt token with its logprob (null for the first)."""
    entries = prompt_logprobs or [None] * len(prompt_ids)
    return [{"id": tid, "text": tokenizer.token_text(tid), "logprob": e[0] if e else None}
            for tid, e in zip(prompt_ids, entries)]


def vllm_prompt_logprobs(tokenizer: PromptTokenizer, prompt_ids: list[int],
                         prompt_logprobs: list[Any] | None) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} for the token itself and the top k (rank: 1 = most likely; known within the
    top k only)."""
    entries = prompt_logprobs or [None] * len(prompt_ids)
    out: list[dict[str, Any] | None] = []
    for tid, entry in zip(prompt_ids, entries):
        if entry is None:
            out.append(None)
            continue
        logprob, top = entry
        ranks = {int(i): r for r, (i, _) in enumerate(top, start=1)}
        item = {str(int(i)): {"logprob": lp, "rank": r, "decoded_token": tokenizer.token_text(int(i))}
                for r, (i, lp) in enumerate(top, start=1)}
        item.setdefault(str(tid), {"logprob": logprob, "rank": ranks.get(tid),
                                   "decoded_token": tokenizer.token_text(tid)})
        out.append(item)
    return out
