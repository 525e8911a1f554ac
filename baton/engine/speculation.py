"""A request's speculative decoding state: its `Sequence.speculation` (made by the speculator at
its first decode step; see baton/engine/speculator.py for the rules)."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.engine.draft_cursor import DraftCursor
from baton.engine.ngram_proposer import NgramIndex
from baton.engine.speculation_policy import RowPolicy


@dataclass
class Speculation:
    """A request's speculative decoding (its `Sequence.speculation`, made at its first decode step)."""

    policy: RowPolicy
    proposer: NgramIndex | DraftCursor  # an n-gram index of its tokens, or how far its draft KV reaches
    # this step's proposals: scheduled after the last token, in token_ids only once accepted
    proposals: list[int] = field(default_factory=list)
