"""Incremental scans for the streaming parsers: each character of an answer is read a bounded number
of times, however finely it is cut.

A parser that cannot decide yet (a JSON call not closed, a closing tag not come, blanks after a
marker) used to parse everything it held again on every chunk: a call of n characters in chunks of
4 cost n²/8 character reads (4000 chunks: 1.5 s of Python per stream). Instead, the parser names
what it waits for as a `Wait`; new text goes to that wait alone (and is kept in pieces) until it
says the parse could change, and only then is the whole held text parsed again.
"""

from __future__ import annotations

import re
from typing import Protocol

# What changes a JSON scan's state: outside a string, quotes and brackets; inside, quotes and
# backslashes. Everything between is skipped by the regex engine, not by a Python loop.
_OUTSIDE = re.compile(r'["\[\]{}]')
_INSIDE = re.compile(r'["\\]')


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (may be the tag's start)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class Wait(Protocol):
    def done(self, text: str) -> bool:
        """Whether `text`, coming after what was held, may change the parse (then it is parsed again)."""
        ...


class JsonScan:
    """The end of the JSON object or array that opens the text fed to it (string-aware), found as
    the text arrives: what was read is never read again."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False  # a backslash in a string ended the last piece: the next character is escaped

    def feed(self, text: str) -> int | None:
        """The index in `text` just after the value's closing bracket, or None while it is open."""
        i, n = 0, len(text)
        if self.escaped and n:
            i, self.escaped = 1, False
        while i < n:
            if self.in_string:
                m = _INSIDE.search(text, i)
                if m is None:
                    return None
                if m.group() == "\\":
                    if m.end() == n:
                        self.escaped = True
                        return None
                    i = m.end() + 1
                    continue
                self.in_string, i = False, m.end()
                continue
            m = _OUTSIDE.search(text, i)
            if m is None:
                return None
            c, i = m.group(), m.end()
            if c == '"':
                self.in_string = True
            elif c in "[{":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    return i
        return None

    def done(self, text: str) -> bool:
        return self.feed(text) is not None


class MarkerWait:
    """Waits for `marker` in the text after what was held (`after`: the held text it may start in)."""

    def __init__(self, marker: str, after: str) -> None:
        self.marker = marker
        self.tail = self._tail(after)

    def done(self, text: str) -> bool:
        window = self.tail + text
        if self.marker in window:
            return True
        self.tail = self._tail(window)
        return False

    def _tail(self, text: str) -> str:
        """The end of `text` that a marker cut across pieces may start in."""
        return text[max(0, len(text) - len(self.marker) + 1):]


class _Blanks:
    """Waits for anything but blanks."""

    def done(self, text: str) -> bool:
        return bool(text) and not text.isspace()


class _Never:
    """Waits for the end of the answer (`finish`)."""

    def done(self, text: str) -> bool:
        return False


BLANKS: Wait = _Blanks()
NEVER: Wait = _Never()
