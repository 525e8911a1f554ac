"""N-gram prompt lookup (vLLM's "ngram" method): propose the tokens that followed the most recent
earlier occurrence of the sequence's last n tokens, n from `prompt_lookup_max` down to `min`.

`propose` is the rule as a pure function (the reference the tests hold `NgramIndex` to).
`NgramIndex` is what runs every step for every row: a per-request map from each n-gram to the end
of its most recent occurrence, extended incrementally with the tokens appended since the last call,
so a lookup costs O(new tokens * lookup sizes) and never rescans the sequence. A request's tokens
only grow (rejected proposals are never appended), so the index never has to forget anything; a
preempted request keeps its tokens and its index.

An occurrence close to the end (a run, a short cycle) has fewer than k tokens after it: the
proposal continues the cycle it implies (period p = distance from that occurrence's end to the
sequence's end: proposal i is the token p before it), so "a a a a" proposes k more "a"s, not one.
"""

from __future__ import annotations

from collections.abc import Sequence


def propose(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens following the most recent earlier occurrence of the last n tokens of
    `tokens` (the largest n in [min_n, max_n] that occurs earlier wins); [] if none does."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(tokens[length - n:])
        # an earlier occurrence ends at e <= length - 1 (so at least one token follows it)
        for end in range(length - 1, n - 1, -1):
            if list(tokens[end - n:end]) == suffix:
                return _follow(tokens, end, k)
    return []


def _follow(tokens: Sequence[int], end: int, k: int) -> list[int]:
    """k tokens from `end` on, continuing the cycle of period len(tokens) - end past the end."""
    out = list(tokens[end:end + k])
    period = len(tokens) - end
    while len(out) < k:
        out.append(out[len(out) - period])
    return out


class NgramIndex:
    """Incremental `propose` over one growing token list."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        # per n: n-gram -> end (exclusive) of its most recent occurrence among those ending <= indexed
        self.last_end: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 0  # n-grams ending at positions <= this are in the maps

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        length = len(tokens)
        # index every n-gram ending before the last position (the suffix itself is not "earlier")
        for end in range(self.indexed + 1, length):
            for n, table in self.last_end.items():
                if end >= n:
                    table[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, length - 1)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self.last_end[n].get(tuple(tokens[length - n:]))
            if end is not None:
                return _follow(tokens, end, k)
        return []
