"""Structured output in the engine: a grammar matcher per constrained request, its token mask
applied to the logits of the step that samples.

A request's matcher lives on its `Sequence` (`seq.grammar`) and is a function of the request's
output tokens: `GrammarState.sync` feeds it whatever output tokens it has not seen yet (and rebuilds
it from scratch if the output shrank), so a request that was handed off (the prefill worker sampled
the first token), preempted, or resumed on another worker after a crash gets exactly the matcher
state its tokens imply. Masks are filled for the constrained rows only, all at once (llguidance's
executor, which drops the GIL), and applied in one masked_fill; a step without a constrained row
costs a scan of the batch's sampling params and nothing else.

When the grammar is complete its mask holds only the EOS tokens (llguidance adds them as soon as
the output may end), so the request ends with finish_reason "stop". A matcher that cannot be built
(a spec the gateway let through but the worker cannot compile) is a ValueError at `add_request`,
which the workers turn into an error event; one that breaks while running ends its request with
finish_reason "error".
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from baton.engine.grammar_state import GrammarState
from baton.engine.sequence import Sequence
from baton.common.structured import InvalidStructure, compiled_grammar

logger = logging.getLogger("baton.engine.structured")


_PENALTY = np.array([-np.inf, 0.0], dtype=np.float32)  # by bit: banned, allowed


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of tokens whose bit is 0 to -inf, in place. logits: [S, V] fp32 (not an
    inference tensor); bitmask: int32 [len(rows), W] on the CPU, row i for logits row rows[i] (bit
    k of word w is token 32w + k); tokens at or beyond 32 * W (a model vocabulary padded past the
    tokenizer's) are never allowed."""
    num_rows, width = bitmask.shape
    vocab = logits.shape[1]
    # Little-endian words unpacked bytewise, low bit first, are the tokens in order; a 0/-inf table
    # lookup and an add is several times faster on a CPU than masked_fill (or shifts in torch).
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    penalty = torch.from_numpy(np.take(_PENALTY, bits))
    if penalty.shape[1] < vocab:
        penalty = torch.nn.functional.pad(penalty, (0, vocab - penalty.shape[1]), value=float("-inf"))
    penalty = penalty.to(logits.device)
    if rows == list(range(logits.shape[0])):
        logits.add_(penalty)
    else:
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logits[index] += penalty


class StructuredOutput:
    """An engine's grammar side: the tokenizer llguidance needs (built on first use: ~0.3 s for
    a 49k vocabulary), matchers for new requests, and the masks of a step."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer = None
        self._executor = None
        self._bitmask = torch.empty(0, dtype=torch.int32)

    def _tokenizer_and_executor(self):
        if self._tokenizer is None:
            import llguidance

            text = (self.model_dir / "tokenizer.json").read_text()
            self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size,
                                                     eos_token=self.eos_token_ids or None)
            self._executor = llguidance.LLExecutor()
        return self._tokenizer, self._executor

    def start(self, seq: Sequence) -> None:
        """Give a constrained request its matcher, at the state of its output so far; ValueError
        if the spec does not compile or the output so far does not match it."""
        structured = seq.sampling_params.structured
        if structured is None or seq.grammar is not None:
            return
        import llguidance

        try:
            grammar = compiled_grammar(structured["kind"], structured.get("spec", ""))
        except InvalidStructure as exc:
            raise ValueError(f"invalid structured output spec ({structured['kind']}): {exc}") from None
        try:
            tokenizer, _ = self._tokenizer_and_executor()
        except Exception as exc:  # a tokenizer llguidance cannot read: the request fails, not the worker
            raise ValueError(f"structured output is unavailable for this model: {exc}") from None
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid structured output spec ({structured['kind']}): {matcher.get_error()}")
        state = GrammarState(matcher, frozenset(self.eos_token_ids))
        state.sync(seq.output_token_ids)
        if state.error:
            raise ValueError(f"the output so far does not match the structured output spec: {state.error}")
        seq.grammar = state

    def apply(self, seqs: list[Sequence], logits: torch.Tensor,
              drafts: list[list[int]] | None = None) -> torch.Tensor:
        """`logits` with the grammar masks of the constrained rows applied (a copy; `logits`
        itself when no row is constrained). logits: [S, V], row i sampled for seqs[i]; `drafts[i]`:
        the speculative proposals row i comes after (a verified position: its mask is the matcher's
        after the output and them; the proposals were checked valid when proposed)."""
        rows = [i for i, s in enumerate(seqs) if s.sampling_params.structured is not None]
        if not rows:
            return logits
        states = []
        for i in rows:
            seq = seqs[i]
            if seq.grammar is None:  # a request the engine got without add_request's start
                self.start(seq)
            seq.grammar.sync(seq.output_token_ids)
            states.append(seq.grammar)
        _, executor = self._tokenizer_and_executor()
        width = (self.vocab_size + 31) // 32
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = torch.empty((max(len(rows), 2 * self._bitmask.shape[0]), width), dtype=torch.int32)
        bitmask = self._bitmask[:len(rows)]
        ahead = [drafts[i] if drafts is not None else [] for i in rows]
        live = [(state.matcher, j) for j, state in enumerate(states) if not state.error and not ahead[j]]
        if live:
            executor.unsafe_compute_mask_ptr(live, bitmask.data_ptr(), width * 4, len(rows))
        for j, state in enumerate(states):  # verified positions: one matcher state each, in turn
            if ahead[j] and not state.error:
                state.matcher.consume_tokens(ahead[j])
                executor.unsafe_compute_mask_ptr([(state.matcher, j)], bitmask.data_ptr(), width * 4, len(rows))
                state.matcher.rollback(len(ahead[j]))
        for j, state in enumerate(states):
            if state.error:  # ends with "error" after this step (see `failed`): let it stop now
                bitmask[j].zero_()
                for eos in self.eos_token_ids:
                    bit = 1 << (eos % 32)
                    bitmask[j, eos // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32
        masked = logits.float().clone()  # the model's logits are inference tensors: not in place
        apply_bitmask(masked, bitmask, rows)
        return masked

    @staticmethod
    def valid_prefix(seq: Sequence, proposals: list[int]) -> list[int]:
        """The leading proposals a constrained request's grammar accepts after its output (cut at
        the first EOS: the matcher never consumes one); all of them for an unconstrained request."""
        state = seq.grammar
        if seq.sampling_params.structured is None:
            return proposals
        if state is None:
            return []
        state.sync(seq.output_token_ids)
        if state.error:
            return []
        cut = next((i for i, t in enumerate(proposals) if t in state.eos_token_ids), len(proposals))
        return proposals[:state.matcher.validate_tokens(proposals[:cut])]

    @staticmethod
    def failed(seq: Sequence) -> str:
        """Why a constrained request's matcher broke ("" if it did not, or has none)."""
        state = seq.grammar
        if state is None:
            return ""
        state.sync(seq.output_token_ids)
        return state.error
