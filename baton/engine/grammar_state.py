"""A constrained request's grammar matcher (its `Sequence.grammar`): how far it has consumed the output.

Built and applied by baton.engine.structured; it is a function of the request's output tokens, so a
handed-off, preempted or resumed request gets exactly the state its tokens imply.
"""

from __future__ import annotations


class GrammarState:
    """One request's matcher and how many of its output tokens it has consumed."""

    def __init__(self, matcher, eos_token_ids: frozenset[int]) -> None:  # llguidance.LLMatcher
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids
        self.num_consumed = 0

    def sync(self, output_token_ids: list[int]) -> None:
        """Bring the matcher to the end of `output_token_ids`."""
        matcher = self.matcher
        if self.num_consumed > len(output_token_ids):  # the output was cut short: start over
            matcher.reset()
            self.num_consumed = 0
        if self.num_consumed < len(output_token_ids):
            # EOS ends the request, not the grammar: a matcher whose grammar is complete refuses
            # tokens (EOS too, sometimes), and with ignore_eos the output goes on with more EOS
            new = [t for t in output_token_ids[self.num_consumed:] if t not in self.eos_token_ids]
            if new:
                matcher.consume_tokens(new)
            self.num_consumed = len(output_token_ids)

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""
