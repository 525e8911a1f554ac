"""Tool-call parsers per model family (`--tool-call-parser`, vLLM's names), for `tool_choice: "auto"`.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the answer
  (Qwen2.5/3, Hermes, SmolLM3); a last block the model did not close is read too.
- `llama3_json`: Llama 3.x's bare JSON `{"name": ..., "parameters"|"arguments": {...}}` at the start
  of the answer, optionally after `<|python_tag|>`, several separated by `;`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` and the newer
  `[TOOL_CALLS]name[ARGS]{...}` (repeated per call). The gateway decodes without special tokens, so
  the same forms without `[TOOL_CALLS]` / `[ARGS]` are read where the answer starts (or right after
  a call): a JSON array of calls, or a name of one of the request's tools followed by its arguments.
- `pythonic`: `[get_weather(city="Paris"), f(x=1)]` as the whole answer (optionally inside
  `<|python_start|>...<|python_end|>`), read with `ast`: keyword arguments with literal values only
  (never evaluated).
- `openai`: gpt-oss's harmony messages to `functions.NAME` (`gateway.parsers.harmony`).

Rules shared by all: `feed(text)` returns what can be told apart so far (a `Parsed`: content text and
complete calls), `finish()` what was held. Content that cannot be part of a call streams as it comes;
text that may open a call (a marker cut across chunks, `<tool_c`) is held until decided; a call is
given out once it is complete and valid. A call that does not parse (bad JSON, no name, arguments not
an object) comes back as the text it was, never an error. Content is trimmed of the blanks at its
start, its end and around calls (held until something follows them), so the parse of the whole
answer equals the concatenation of the parse of its pieces, however it was cut. Parsing is linear
in the answer's length: while a parser waits for one thing (a JSON call to close, a closing tag), new
text is checked against that alone (gateway.parsers.scan), not parsed again with all that was held.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

from gateway.parsers.harmony import Header, Scanner
from gateway.parsers.scan import BLANKS, NEVER, JsonScan, MarkerWait, Wait, partial_suffix

NAMES = ("hermes", "llama3_json", "mistral", "pythonic", "openai")
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


@dataclass
class Call:
    name: str
    arguments: str  # JSON text of an object


@dataclass
class Parsed:
    content: str = ""
    calls: list[Call] = field(default_factory=list)

    def add(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.calls += other.calls
        return self


def _call_of(item: Any, keys: tuple[str, ...] = ("arguments",)) -> Call | None:
    """A {"name", "arguments"} object as a Call, or None when it is not one."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not _NAME.fullmatch(item["name"]):
        return None
    arguments = next((item[k] for k in keys if k in item), {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return Call(item["name"], json.dumps(arguments, ensure_ascii=False))


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class _Content:
    """Content trimmed at its start, its end and around calls: trailing blanks wait for more."""

    def __init__(self) -> None:
        self.started = False
        self.blanks: list[str] = []  # in pieces: a long run of blanks is not copied once per chunk

    def text(self, piece: str) -> str:
        if not self.started:
            piece = piece.lstrip()
            if not piece:
                return ""
            self.started = True
        body = piece.rstrip()
        if not body:
            self.blanks.append(piece)
            return ""
        said = "".join(self.blanks) + body
        self.blanks = [piece[len(body):]]
        return said

    def call(self) -> None:
        """A call came: the blanks before it go, and those after it too."""
        self.started, self.blanks = False, []


class ToolParser:
    """One answer's parse as it streams. Subclasses say where calls start and how they read."""

    def __init__(self, tool_names: frozenset[str] = frozenset()) -> None:
        self.tool_names = tool_names
        self.held = ""
        self.out = _Content()
        # What the held text waits for, when one thing alone can change its parse (set by `_step`
        # as it returns undecided): text that does not bring it is kept in `pending`, unparsed.
        self.wait: Wait | None = None
        self.pending: list[str] = []

    def feed(self, text: str) -> Parsed:
        if self.wait is not None and not self.wait.done(text):
            self.pending.append(text)
            return Parsed()
        self._take(text)
        parsed = Parsed()
        self._step(parsed, final=False)
        return parsed

    def _take(self, text: str = "") -> None:
        """Hold the pending text and `text`, to parse them again."""
        if self.pending:
            text = "".join(self.pending) + text
            self.pending.clear()
        self.held += text
        self.wait = None

    def finish(self) -> Parsed:
        self._take()
        parsed = Parsed()
        self._step(parsed, final=True)
        self.wait = None
        if self.held:  # an unfinished call that does not read: the text as it was
            parsed.content += self.out.text(self.held)
            self.held = ""
        return parsed

    def _emit_text(self, parsed: Parsed, text: str) -> None:
        parsed.content += self.out.text(text)

    def _emit_call(self, parsed: Parsed, call: Call) -> None:
        self.out.call()
        parsed.calls.append(call)

    def _step(self, parsed: Parsed, final: bool) -> None:
        raise NotImplementedError


class _Tagged(ToolParser):
    """Calls between an opening and a closing tag, anywhere in the answer (hermes)."""

    OPEN = CLOSE = ""

    def _step(self, parsed: Parsed, final: bool) -> None:
        while self.held:
            at = self.held.find(self.OPEN)
            if at < 0:
                keep = 0 if final else partial_suffix(self.held, self.OPEN)
                self._emit_text(parsed, self.held[:len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                return
            self._emit_text(parsed, self.held[:at])
            self.held = self.held[at:]
            end = self.held.find(self.CLOSE, len(self.OPEN))
            if end < 0 and not final:
                self.wait = MarkerWait(self.CLOSE, self.held[len(self.OPEN):])
                return
            body = self.held[len(self.OPEN):end if end >= 0 else len(self.held)]
            whole = self.held[:end + len(self.CLOSE)] if end >= 0 else self.held
            call = _call_of(_json(body.strip()), ("arguments", "parameters"))
            if call is None:
                self._emit_text(parsed, whole)
            else:
                self._emit_call(parsed, call)
            self.held = self.held[len(whole):]


class Hermes(_Tagged):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"


class _Leading(ToolParser):
    """Calls only where the answer starts (or right after a call): once text that is not a call
    comes, the rest is content."""

    def __init__(self, tool_names: frozenset[str] = frozenset()) -> None:
        super().__init__(tool_names)
        self.text_only = False
        self.rejected = -1  # where the held text did not read as a call (not to be tried again)

    def _step(self, parsed: Parsed, final: bool) -> None:
        while self.held:
            if self.text_only:
                if not self._text(parsed, final):
                    return
                continue
            # Blanks here go whatever comes: nothing was said since the answer's start or the last
            # call (so content would trim them), or they come before a call. Dropped now, a long
            # run of them is not held and stripped again on every chunk.
            self.held = self.held.lstrip()
            if not self.held:
                return
            outcome = self._at_call(self.held, final)
            if outcome is None:  # not decided yet
                if final:  # an unfinished call: text
                    self.text_only, self.rejected = True, 0
                    continue
                return
            if outcome is False:
                self.text_only, self.rejected = True, 0
                continue
            used, calls = outcome
            for call in calls:
                self._emit_call(parsed, call)
            self.held = self.held[used:]

    def _text(self, parsed: Parsed, final: bool) -> bool:
        """Content: all of it (True: a call may start again at what is held now)."""
        self._emit_text(parsed, self.held)
        self.held = ""
        return False

    def _at_call(self, text: str, final: bool) -> tuple[int, list[Call]] | bool | None:
        """At the start of `text`: (characters used, the calls read), False (no call here: the rest
        is content), or None (cannot tell yet; then `self.wait` may say what alone can decide it)."""
        raise NotImplementedError

    def _json_end(self, text: str) -> int | None:
        """The end of the JSON value opening `text`; while it is open, only its end can decide the
        call (every caller checked the rest already), so that is what the parser waits for."""
        scan = JsonScan()
        end = scan.feed(text)
        if end is None:
            self.wait = scan
        return end

    def _json_calls_at(self, text: str, keys: tuple[str, ...]) -> tuple[int, list[Call]] | bool | None:
        """A JSON object (one call) or array (of calls) opening `text`."""
        end = self._json_end(text)
        if end is None:
            return None
        value = _json(text[:end])
        items = value if isinstance(value, list) else [value]
        calls = [_call_of(item, keys) for item in items]
        if not items or any(c is None for c in calls):
            return False
        return end, [c for c in calls if c is not None]


class Llama3Json(_Leading):
    TAG = "<|python_tag|>"

    def _at_call(self, text: str, final: bool) -> tuple[int, list[Call]] | bool | None:
        pos = 0
        if text.startswith(";"):  # between two calls
            pos = 1 + _blanks(text, 1)
        if text.startswith(self.TAG, pos):
            pos += len(self.TAG)
            pos += _blanks(text, pos)
        rest = text[pos:]
        if not rest:
            self.wait = BLANKS  # after `;` or the tag: only a non-blank decides
            return (pos, []) if final and pos else None
        if not final and self.TAG.startswith(rest):
            return None
        if not rest.startswith("{"):
            return False
        outcome = self._json_calls_at(rest, ("parameters", "arguments"))
        return (pos + outcome[0], outcome[1]) if isinstance(outcome, tuple) else outcome


def _blanks(text: str, at: int) -> int:
    """How many blanks start at `text[at]`."""
    return len(text) - at - len(text[at:].lstrip())


class Mistral(_Leading):
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def _at_call(self, text: str, final: bool) -> tuple[int, list[Call]] | bool | None:
        used = 0
        if text.startswith(self.TAG):
            used = len(self.TAG)
        elif self.TAG.startswith(text) and not final:
            return None
        rest = text[used:]
        body = rest.lstrip()
        used += len(rest) - len(body)
        if not body:
            self.wait = BLANKS
            return None if not final else False
        if body[0] == "[":
            if body == "[":
                return None if not final else False
            if not body[1:].lstrip():
                self.wait = BLANKS
                return None
            if not body[1:].lstrip().startswith("{"):
                return False
            outcome = self._json_calls_at(body, ("arguments",))
            return (used + outcome[0], outcome[1]) if isinstance(outcome, tuple) else outcome
        name = _NAME.match(body)
        if name is None:
            return False
        after = body[name.end():]
        if not after:  # the name may go on
            return None if not final and (used or self._may_name(name.group(0))) else False
        if after.startswith(self.ARGS):
            args_at = name.end() + len(self.ARGS)
        elif self.ARGS.startswith(after) and not final:
            return None
        elif used or name.group(0) in self.tool_names:  # a bare name only for one of the tools
            args_at = name.end()
        else:
            return False
        args = body[args_at:].lstrip()
        args_at = len(body) - len(args)
        if not args:
            self.wait = BLANKS
            return None
        if args[0] != "{":
            return False
        end = self._json_end(args)
        if end is None:
            return None
        call = _call_of({"name": name.group(0), "arguments": _json(args[:end])})
        return (used + args_at + end, [call]) if call is not None else False

    def _text(self, parsed: Parsed, final: bool) -> bool:
        """Content up to the next [TOOL_CALLS] (the marker's start held until decided)."""
        at = self.held.find(self.TAG, self.rejected + 1)
        self.rejected = -1
        if at < 0:
            keep = 0 if final else partial_suffix(self.held, self.TAG)
            self._emit_text(parsed, self.held[:len(self.held) - keep])
            self.held = self.held[len(self.held) - keep:]
            return False
        self._emit_text(parsed, self.held[:at])
        self.held, self.text_only = self.held[at:], False
        return True

    def _may_name(self, text: str) -> bool:
        return any(name.startswith(text) for name in self.tool_names)


class Pythonic(ToolParser):
    """The whole answer is a Python list of calls: it is held when it opens with `[` and read at the end."""

    WRAP = ("<|python_start|>", "<|python_end|>")

    def __init__(self, tool_names: frozenset[str] = frozenset()) -> None:
        super().__init__(tool_names)
        self.text_only = False

    def _step(self, parsed: Parsed, final: bool) -> None:
        if not self.text_only:
            body = self.held.lstrip()
            if not final:
                if not body:
                    self.wait = BLANKS
                    return
                if body.startswith(("[", self.WRAP[0])):
                    self.wait = NEVER  # read at the end: until then, pieces are only kept
                    return
                if self.WRAP[0].startswith(body):
                    return
                self.text_only = True
            else:
                calls = parse_pythonic(body)
                if calls is not None:
                    for call in calls:
                        self._emit_call(parsed, call)
                    self.held = ""
                    return
        self._emit_text(parsed, self.held)
        self.held = ""


def parse_pythonic(text: str) -> list[Call] | None:
    """`[f(a=1), g(b="x")]` -> its calls; None when it is anything else (never evaluated)."""
    text = text.strip()
    if text.startswith(Pythonic.WRAP[0]):
        text = text[len(Pythonic.WRAP[0]):].removesuffix(Pythonic.WRAP[1]).strip()
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        if not _NAME.fullmatch(name):
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        if len(arguments) != len(node.keywords):  # **kwargs
            return None
        try:
            calls.append(Call(name, json.dumps(arguments, ensure_ascii=False)))
        except (TypeError, ValueError):  # a set or bytes literal: not JSON
            return None
    return calls


class Harmony(ToolParser):
    """`openai`: gpt-oss's harmony messages to `functions.NAME` (the rules: gateway.parsers.harmony)."""

    def __init__(self, tool_names: frozenset[str] = frozenset()) -> None:
        super().__init__(tool_names)
        self.scanner = Scanner()
        self.header: Header | None = None
        self.call_body: list[str] = []

    def feed(self, text: str) -> Parsed:
        return self._read(self.scanner.feed(text))

    def finish(self) -> Parsed:
        return self._read(self.scanner.feed("", final=True))

    def _read(self, events: list[tuple[str, object]]) -> Parsed:
        parsed = Parsed()
        for kind, value in events:
            header = self.header
            if kind == "header":
                assert isinstance(value, Header)
                self.header, self.call_body = value, []
            elif kind == "body":
                assert isinstance(value, str) and header is not None
                if header.recipient is not None:
                    self.call_body.append(value)  # held until the message closes
                elif header.channel != "analysis":  # the reasoning parser's
                    self._emit_text(parsed, value)
            elif kind == "end":
                if header is not None and header.recipient is not None:
                    self._end_call(parsed, header, str(value))
                self.header = None
            else:
                self._emit_text(parsed, str(value))
        return parsed

    def _end_call(self, parsed: Parsed, header: Header, end: str) -> None:
        body = "".join(self.call_body)
        self.call_body = []
        name = header.function
        call = _call_of({"name": name, "arguments": _json(body)}) if name is not None else None
        if call is None:  # not a function, or a body that is not a JSON object: the text it was
            self._emit_text(parsed, header.raw + body + end)
        else:
            self._emit_call(parsed, call)


PARSERS: dict[str, type[ToolParser]] = {"hermes": Hermes, "llama3_json": Llama3Json, "mistral": Mistral,
                                        "pythonic": Pythonic, "openai": Harmony}


def make(name: str, tool_names: frozenset[str] = frozenset()) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(NAMES)}")
    return PARSERS[name](tool_names)


def parse(name: str, text: str, tool_names: frozenset[str] = frozenset()) -> Parsed:
    """The parse of a whole answer."""
    parser = make(name, tool_names)
    return parser.feed(text).add(parser.finish())


# What a template asks the model to write, as its text shows it (a template naming several: none).
_TEMPLATE_MARKERS = (
    ("hermes", ("<tool_call>",)),
    ("llama3_json", ("<|python_tag|>", '"parameters": dictionary of argument name and its value')),
    ("mistral", ("[TOOL_CALLS]",)),
    ("openai", ("<|channel|>",)),
)


def detect(template: Any) -> str | None:
    """The parser a chat template's text calls for, when exactly one family's marker is in it."""
    if not isinstance(template, str):
        return None
    found = [name for name, markers in _TEMPLATE_MARKERS if any(m in template for m in markers)]
    return found[0] if len(found) == 1 else None
