"""Reasoning parsers (`--reasoning-parser`, vLLM's names): split a thinking model's output into its
reasoning and its answer.

Rules:
- `deepseek_r1`: the chat template may already have opened `<think>` in the prompt (DeepSeek-R1's
  does), so everything before `</think>` is reasoning, with or without an opening `<think>` in the
  output; an output that never closes its thought is all reasoning (cut short while thinking: vLLM's
  rule).
- `qwen3`: reasoning only when the output opens with `<think>` (after blanks); otherwise all of it is
  the answer (Qwen3 with `enable_thinking: false`: the template wrote an empty think block itself).
- The reasoning and the answer are stripped of the blanks around the think block (the model writes
  `</think>\\n\\n` before its answer): streamed, those blanks are held until something follows them.
- Streaming: `feed(text)` returns the (reasoning, content) that can be told apart so far; a tag cut
  across chunks (`<thi` at a chunk's end) is held back until the next chunk decides it; `finish()`
  returns what was held. Feeding the whole output at once gives exactly what feeding it in pieces
  gives (`split` does that).
- Structured output (and tool_choice's constraints) apply to the answer: `think_first` turns a JSON
  constraint into a Lark grammar (llguidance's) of a free think block, then the JSON. A regex,
  choice or grammar constraint is left as it is (it constrains the whole output, so no think block
  can come: the request's reasoning parser is off).
- `openai_gptoss`: gpt-oss's harmony format, its analysis channel as the reasoning
  (`gateway.parsers.harmony`); a JSON constraint is left as it is (its markers could not be written).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.parsers.harmony import HarmonyReasoning
from gateway.parsers.scan import partial_suffix

OPEN, CLOSE = "<think>", "</think>"
NAMES = ("deepseek_r1", "qwen3", "openai_gptoss")
HARMONY = "openai_gptoss"


class ThinkParser:
    """One output's reasoning/answer split, fed as it streams (see the module's rules)."""

    def __init__(self, open_required: bool) -> None:
        self.open_required = open_required  # qwen3: no opening tag, no reasoning
        self.state = "start"  # start -> reasoning -> answer_start -> answer
        self.held = ""
        self.found = False  # a think block was seen (even an empty one)
        self._said_reasoning = False  # some reasoning was returned: its later blanks are its own
        # Blanks that came while only blanks were held (before the output's start is decided, or
        # where the thought may end): kept in pieces, not held and scanned again on every chunk.
        self._blanks: list[str] = []

    def feed(self, text: str) -> tuple[str, str]:
        if self.held and self.held.isspace() and text.isspace():  # nothing to decide before more comes
            self._blanks.append(text)
            return "", ""
        if self._blanks:
            text = "".join(self._blanks) + text
            self._blanks.clear()
        reasoning: list[str] = []
        content: list[str] = []
        self.held += text
        while self.held:
            before = (self.state, len(self.held))
            if self.state == "start":
                stripped = self.held.lstrip()
                if stripped.startswith(OPEN):
                    self.held, self.state, self.found = stripped[len(OPEN):], "reasoning", True
                elif OPEN.startswith(stripped):  # blanks, or `<thi`: not decided yet
                    break
                else:
                    self.state = "answer" if self.open_required else "reasoning"
                    self.found = not self.open_required
                    if self.state == "reasoning":
                        self.held = stripped
            elif self.state == "reasoning":
                if not reasoning and not self._said_reasoning:
                    self.held = self.held.lstrip()  # the blanks after <think>
                    if not self.held:
                        break
                at = self.held.find(CLOSE)
                if at >= 0:
                    reasoning.append(self.held[:at].rstrip())
                    self.held, self.state = self.held[at + len(CLOSE):], "answer_start"
                    continue
                keep = partial_suffix(self.held, CLOSE)
                body = self.held[:len(self.held) - keep]
                sure = body.rstrip()  # trailing blanks wait: they may come right before </think>
                reasoning.append(sure)
                self.held = self.held[len(sure):]
                break
            elif self.state == "answer_start":
                self.held = self.held.lstrip()
                if self.held:
                    self.state = "answer"
            else:
                content.append(self.held)
                self.held = ""
            if (self.state, len(self.held)) == before:
                break
        said = "".join(reasoning)
        if said:
            self._said_reasoning = True
        return said, "".join(content)

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held + "".join(self._blanks), ""
        self._blanks.clear()
        if self.state == "start":
            if self.open_required:
                return "", held
            self.found = True
            return held.strip(), ""
        if self.state == "reasoning":
            return (held.rstrip() if self._said_reasoning else held.strip()), ""
        if self.state == "answer_start":
            return "", ""
        return "", held


def make(name: str) -> Any:  # ThinkParser, or a HarmonyReasoning: both feed / finish
    """The parser of a `--reasoning-parser` name (one per output: it holds that output's state)."""
    if name not in NAMES:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(NAMES)}")
    if name == HARMONY:
        return HarmonyReasoning()
    return ThinkParser(open_required=(name == "qwen3"))


def split(name: str, text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a whole output; reasoning None when there is none (an empty thought
    counts as none: nothing to show)."""
    parser = make(name)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    reasoning = r1 + r2
    return (reasoning or None), c1 + c2


# The think block as one lexeme: `<think>` (optional for deepseek_r1: the prompt may have opened it),
# any text without `</think>`, `</think>`, blanks. The JSON keeps the separators the gateway's JSON
# constraints always use (baton.common.structured.JSON_OPTIONS: tool streaming reads ", " and ": ").
_THINK = r"/(?s:{open}(.*)<\/think>[ \t\n]*)/ & ~/(?s:.*<\/think>.*<\/think>.*)/"
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def think_first(structured: dict[str, str], name: str) -> dict[str, str] | None:
    """The constraint with a think block allowed before it (qwen3: optional; deepseek_r1: required,
    as its parser reads an output without `</think>` as all reasoning); None when it is not JSON."""
    kind = structured.get("kind")
    if name == HARMONY:
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        schema = json.loads(structured["spec"])
    else:
        return None
    if not isinstance(schema, dict):
        return None
    schema = {**schema, "x-guidance": {**_JSON_OPTIONS, **schema.get("x-guidance", {})}}
    if name == "qwen3":
        start = "start: THINK answer | answer"
        think = _THINK.format(open="<think>")
    else:
        start = "start: THINK answer"
        think = _THINK.format(open="(<think>)?")
    lark = f"{start}\nTHINK: {think}\nanswer: %json {json.dumps(schema)}\n"
    return {"kind": "grammar", "spec": lark}
