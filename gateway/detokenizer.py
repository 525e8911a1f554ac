"""Incremental detokenization and stop sequences: generated token ids -> text safe to stream.

Byte-level BPE splits one character over several tokens (a CJK ideograph or an emoji is 3-4 bytes,
often 2-3 tokens). Decoding each token alone would stream U+FFFD garbage, so we decode a short
window of ids (`prefix_offset`..end) and only release what it adds over the window's already
released part (`prefix_offset`..`read_offset`), holding back any text that still ends in U+FFFD:
the character is incomplete until its last byte arrives. This is the scheme of TGI and vLLM.
"""

from __future__ import annotations

from gateway.tokenizer import PromptTokenizer

REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context so the first output token decodes with its leading space
# (SentencePiece-style decoders drop a leading space at the start of a decode).
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PromptTokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        # False: special tokens are text too (gpt-oss's harmony markers, read by its parsers)
        self._skip = skip_special_tokens
        context = prompt_ids[-_CONTEXT_TOKENS:]
        if REPLACEMENT in tokenizer.decode(context):
            context = []  # the context itself ends mid-character: it would shift our offsets
        self._ids: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (possibly "")."""
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        new_text = self._tok.decode(self._ids[self._prefix_offset:], self._skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            delta = new_text[len(prefix_text):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        return ""  # an incomplete character (or a skipped special token): wait for more

    def flush(self) -> str:
        """At the end of generation: whatever is still held, minus a character cut in half."""
        prefix_text = self._tok.decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        new_text = self._tok.decode(self._ids[self._prefix_offset:], self._skip)
        self._prefix_offset = self._read_offset = len(self._ids)
        if len(new_text) <= len(prefix_text):
            return ""
        return new_text[len(prefix_text):].rstrip(REPLACEMENT)


class StopMatcher:
    """Applies stop strings to streamed text.

    Text that might be the beginning of a stop string is held back until the next pieces decide,
    so a client never receives part of a stop sequence; on a match, the text is cut before it.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._max_len = max((len(s) for s in stops), default=0)
        self.text = ""  # all text so far (truncated at the stop string once matched)
        self._released = 0
        self._floor = 0  # stop strings match only after this point (text pushed unarmed is out)

    def push(self, piece: str, armed: bool = True) -> tuple[str, bool]:
        """Add decoded text; return (text now safe to send, whether a stop string matched). Text
        pushed unarmed (before min_tokens) is released at once and never part of a match."""
        if not self.stops or not armed:
            self.text += piece
            self._released = len(self.text)
            if self.stops:
                self._floor = len(self.text)
            return piece, False
        search_from = max(self._floor, len(self.text) - self._max_len + 1)
        self.text += piece
        hit = -1
        for stop in self.stops:
            at = self.text.find(stop, search_from)
            if at != -1 and (hit == -1 or at < hit):
                hit = at
        if hit != -1:
            self.text = self.text[:hit]
            return self._release(len(self.text)), True
        return self._release(len(self.text) - self._held_back()), False

    def flush(self) -> str:
        """Generation ended without a match: release everything still held back."""
        return self._release(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text) - self._floor), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _release(self, upto: int) -> str:
        if upto <= self._released:
            return ""
        out = self.text[self._released:upto]
        self._released = upto
        return out
