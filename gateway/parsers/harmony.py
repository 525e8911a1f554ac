"""gpt-oss's harmony format: its analysis channel as reasoning (`--reasoning-parser openai_gptoss`) and
its function calls as tool calls (`--tool-call-parser openai`), vLLM's names.

An answer is a run of messages, each
`[<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY`, closed
by `<|end|>`, `<|call|>` or `<|return|>` (or by the end of the output: the closing token is often
the stop token, not in the text), e.g.
`<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>answer`,
or a call
`<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>`
(the recipient may also stand in the header before `<|channel|>`). The markers are special tokens:
the output must be decoded with them kept for these parsers to see them (`keeps_markers`).

Rules:
- reasoning (`HarmonyReasoning`): the bodies of `analysis` messages are the reasoning; the bodies of
  `final` messages and of `commentary` messages to no one (preambles the user may see) are the answer,
  as is any text outside a message; a message to a recipient (a call) goes to the answer whole, markers
  and all, for the tool parser to read.
- tool calls (`gateway.parsers.tool_calls.Harmony`, on this module's `Scanner`): a message to
  `functions.NAME` with a JSON object body is a call of NAME (a body that is not a JSON object comes
  back as the text it was); `final` and preamble bodies and
  text outside messages are content (trimmed, as every tool parser's); `analysis` bodies are not
  content (they are the reasoning parser's).
- Streaming: a marker cut across chunks is held until decided, bodies stream as they come (a call's
  body is held until its message closes); feeding the whole answer at once gives what feeding it in
  pieces gives. Each character is scanned a bounded number of times.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.parsers.scan import partial_suffix

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
OPENS = (START, CHANNEL)
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class Header:
    raw: str  # as it was written, from its opening marker to `<|message|>` included
    channel: str
    recipient: str | None

    @classmethod
    def read(cls, raw: str) -> Header:
        channel = _CHANNEL_NAME.search(raw)
        recipient = _RECIPIENT.search(raw)
        return cls(raw, channel.group(1) if channel else "", recipient.group(1) if recipient else None)

    @property
    def function(self) -> str | None:
        """The function a call message is to (as written), or None."""
        if self.recipient is None or not self.recipient.startswith("functions."):
            return None
        return self.recipient.removeprefix("functions.")


def keeps_markers(reasoning_parser: str | None, tool_parser: str | None) -> bool:
    """Whether an answer read by these parsers must be decoded with its special tokens kept."""
    return reasoning_parser == "openai_gptoss" or tool_parser == "openai"


def _earliest(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    found = [(at, m) for m in markers if (at := text.find(m)) >= 0]
    return min(found) if found else None


def _undecided(text: str, markers: tuple[str, ...]) -> int:
    """How much of the end of `text` may be the start of one of `markers`."""
    return max(partial_suffix(text, m) for m in markers)


class Scanner:
    """The answer's messages as they stream: `feed` returns events, in order: ("text", s) outside any
    message, ("header", Header) when a message's header is complete, ("body", s) pieces of its body,
    ("end", marker) when it closes ("" at the end of the output)."""

    def __init__(self) -> None:
        self.state = "outside"  # outside -> header -> body -> outside
        self.held = ""

    def feed(self, text: str, final: bool = False) -> list[tuple[str, object]]:
        events: list[tuple[str, object]] = []
        self.held += text
        while True:
            if self.state == "outside":
                found = _earliest(self.held, OPENS)
                if found is None:
                    keep = 0 if final else _undecided(self.held, OPENS)
                    self._say(events, "text", self.held[:len(self.held) - keep])
                    self.held = self.held[len(self.held) - keep:]
                    break
                self._say(events, "text", self.held[:found[0]])
                self.held, self.state = self.held[found[0]:], "header"
            elif self.state == "header":
                at = self.held.find(MESSAGE)
                if at < 0:
                    if final:  # a header never finished: the text it was
                        self._say(events, "text", self.held)
                        self.held, self.state = "", "outside"
                    break
                events.append(("header", Header.read(self.held[:at + len(MESSAGE)])))
                self.held, self.state = self.held[at + len(MESSAGE):], "body"
            else:
                found = _earliest(self.held, ENDS)
                if found is None:
                    keep = 0 if final else _undecided(self.held, ENDS)
                    self._say(events, "body", self.held[:len(self.held) - keep])
                    self.held = self.held[len(self.held) - keep:]
                    if final:
                        events.append(("end", ""))
                        self.state = "outside"
                    break
                self._say(events, "body", self.held[:found[0]])
                events.append(("end", found[1]))
                self.held, self.state = self.held[found[0] + len(found[1]):], "outside"
        return events

    @staticmethod
    def _say(events: list[tuple[str, object]], kind: str, text: str) -> None:
        if text:
            events.append((kind, text))


class HarmonyReasoning:
    """`--reasoning-parser openai_gptoss`: feed/finish return (reasoning, content), as ThinkParser's."""

    def __init__(self) -> None:
        self.scanner = Scanner()
        self.header: Header | None = None
        self.found = False  # an analysis message was seen

    def feed(self, text: str) -> tuple[str, str]:
        return self._read(self.scanner.feed(text))

    def finish(self) -> tuple[str, str]:
        return self._read(self.scanner.feed("", final=True))

    def _read(self, events: list[tuple[str, object]]) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        for kind, value in events:
            if kind == "header":
                assert isinstance(value, Header)
                self.header = value
                if value.recipient is not None:
                    content.append(value.raw)  # a call: whole, for the tool parser
                elif value.channel == "analysis":
                    self.found = True
            elif kind == "body":
                assert isinstance(value, str) and self.header is not None
                if self.header.recipient is not None:
                    content.append(value)
                elif self.header.channel == "analysis":
                    reasoning.append(value)
                else:
                    content.append(value)
            elif kind == "end":
                if self.header is not None and self.header.recipient is not None:
                    content.append(str(value))
                self.header = None
            else:
                content.append(str(value))
        return "".join(reasoning), "".join(content)
