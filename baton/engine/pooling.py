"""Embeddings: pooling a prompt's final-norm hidden states into one vector.

A pooling request is a prefill that never samples: the scheduler batches and chunks it like any
prompt, the model runner asks the model for the final norm's output of only the rows its pooling
needs (`PoolState.positions`), and the state folds each chunk in as it comes, so a prompt split
across steps needs no more memory than one vector:
- `last`: the last prompt token's state (decoder embedding models: Qwen3-Embedding, e5-mistral);
- `mean`: the mean over every prompt token (a running sum);
- `cls`: the first token's state (BERT-style checkpoints' [CLS]).
`mean` and `cls` need rows a prefix-cache hit would skip, so those requests never read the prefix
cache (`needs_every_token`); `last` always computes its last token (the cache leaves one).
The vector leaves raw (float32); normalizing is the caller's (`normalize`): the gateway
renormalizes after OpenAI's `dimensions` truncation anyway, and TEI lets each request choose.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence as Seq

import torch


class Pooling(str, enum.Enum):
    LAST = "last"
    MEAN = "mean"
    CLS = "cls"

    __str__ = str.__str__

    @property
    def needs_every_token(self) -> bool:
        """Whether rows a prefix-cache hit would skip are pooled (then the cache is not read)."""
        return self is not Pooling.LAST


class PoolState:
    """One request's pooling so far, over a prompt of `num_tokens` tokens."""

    def __init__(self, pooling: Pooling, num_tokens: int) -> None:
        self.pooling = pooling
        self.num_tokens = num_tokens
        self._sum: torch.Tensor | None = None
        self._count = 0

    def positions(self, start: int, end: int) -> range:
        """The prompt positions in [start, end) (a chunk being computed) whose rows are pooled."""
        if self.pooling is Pooling.MEAN:
            return range(start, end)
        wanted = 0 if self.pooling is Pooling.CLS else self.num_tokens - 1
        return range(wanted, wanted + 1) if start <= wanted < end else range(0)

    def add(self, rows: torch.Tensor) -> None:
        """Fold in the hidden states [n, hidden] of `positions(...)` of one chunk (fp32)."""
        if rows.shape[0] == 0:
            return
        total = rows.sum(dim=0, dtype=torch.float32)
        self._sum = total if self._sum is None else self._sum + total
        self._count += rows.shape[0]

    def reset(self) -> None:
        """Forget what was pooled (the request was preempted: its chunks are computed again)."""
        self._sum, self._count = None, 0

    def result(self) -> list[float]:
        assert self._sum is not None and self._count > 0, "every pooled row must be computed first"
        return (self._sum / self._count).tolist()


def normalize(vector: Seq[float]) -> list[float]:
    """L2-normalized (a zero vector stays zero), as sentence-transformers' Normalize module."""
    norm = math.sqrt(sum(v * v for v in vector))
    return [v / norm for v in vector] if norm > 0 else list(vector)
