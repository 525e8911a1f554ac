"""Chat tools: `tools`, `tool_choice`, `parallel_tool_calls`, tool messages, and `tool_calls` answers.

- `tool_choice` "required" or {"type": "function", "function": {"name": ...}}: the output is
  constrained (structured output, model-independent) to a JSON array of one or more `{"name",
  "arguments"}` objects, one per call, each the schema of one of the tools (vLLM's form; at most one
  item with `parallel_tool_calls: false`), or, for a named function, to its arguments' schema. The
  answer is `message.tool_calls` (content null, finish_reason "tool_calls"); streamed as OpenAI
  streams them: each call first (index, id, type, function name), then its arguments as they are
  generated (for "required", `scan_calls` follows the array as it grows).
- `tool_choice` "auto" (the default with tools): the tools are given to the chat template, and the
  answer is read by a tool-call parser (gateway.parsers.tool_calls): `--tool-call-parser` when given,
  else the one the template's text calls for (`<tool_call>` -> hermes, `<|python_tag|>` or Llama
  3's "parameters" instruction -> llama3_json, `[TOOL_CALLS]` -> mistral), else hermes when the
  template renders tools at all, else none (a template without tools, as SmolLM2's: plain text).
  Streamed, content that cannot be a call streams as it comes and each call is sent, named with its
  arguments, once it is complete; a call that does not parse is content.
- "none": the template gets the tools all the same (OpenAI's models see them too), the answer is text.

Messages' `tool_calls`, `tool_call_id` and `name` are passed to the template (arguments as an
object, as Hugging Face templates expect them); for a template that does not render `tool_calls`,
an assistant's calls are written into its content in the `<tool_call>` form, so they are never lost.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from baton.common.structured import InvalidStructure, compiled_grammar, json_schema
from gateway.parsers import tool_calls
from gateway.validation import Fields

MAX_TOOLS = 128
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolCalling:
    """What a chat request's tools ask of the answer."""

    tools: list[dict[str, Any]]  # as sent (checked), for the chat template
    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the named function
    parallel: bool = True
    parse_tags: bool = False  # auto without a parser named: the hermes <tool_call> blocks
    parser: str | None = None  # auto: the tool-call parser (the flag's, or chosen by choose_parser)
    parameters: dict[str, Any] = field(default_factory=dict)  # function name -> its schema

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")

    def auto_parser(self) -> str | None:
        """The parser that reads an "auto" answer, if any."""
        if self.mode != "auto":
            return None
        return self.parser or ("hermes" if self.parse_tags else None)


def choose_parser(calling: ToolCalling, template: Any) -> None:
    """Once the chat template is known: the flag's parser, else the template's (see the module doc)."""
    if calling.parser is None:
        calling.parser = tool_calls.detect(template) or ("hermes" if template_renders_tools(template) else None)


def parse_tools(f: Fields, has_constraint: bool) -> tuple[ToolCalling | None, dict[str, str] | None]:
    """`tools`, `tool_choice`, `parallel_tool_calls` -> (what to do, the output constraint if any)."""
    tools = f.get("tools")
    choice = f.get("tool_choice")
    parallel = f.boolean("parallel_tool_calls", True)
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise f.fail("tool_choice", "needs `tools`")
        return None, None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise f.fail("tools", f"must be a list of at most {MAX_TOOLS} tools")
    parameters: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(tool.get("function"), dict):
            raise f.fail(where, 'must be {"type": "function", "function": {"name": ..., "parameters": ...}}')
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise f.fail(f"{where}.function.name", "must be 1 to 64 letters, digits, '_', '.' or '-'")
        if name in parameters:
            raise f.fail(f"{where}.function.name", f"repeats the tool name {name!r}")
        schema = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(schema, dict):
            raise f.fail(f"{where}.function.parameters", "must be a JSON schema (an object)")
        try:
            compiled_grammar("json_schema", json_schema(schema)["spec"])
        except InvalidStructure as exc:
            raise f.fail(f"{where}.function.parameters", f"is not a valid JSON schema: {str(exc)[:500]}") from None
        parameters[name] = schema
    calling = ToolCalling(tools, "auto", parallel=parallel, parameters=parameters)
    if choice is None or choice in ("auto", "none"):
        calling.mode = choice or "auto"
        return calling, None
    if choice == "required":
        calling.mode = "required"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or name not in parameters:
            raise f.fail("tool_choice.function.name", f"names no tool in `tools` (got {json.dumps(name)[:80]})")
        calling.mode, calling.name = "named", name
    else:
        raise f.fail("tool_choice", 'must be "none", "auto", "required" or '
                                    '{"type": "function", "function": {"name": ...}}')
    if has_constraint:
        raise f.fail("tool_choice", "cannot be combined with response_format or guided decoding")
    return calling, json_schema(_calls_schema(calling))


def _calls_schema(calling: ToolCalling) -> dict[str, Any]:
    if calling.mode == "named":
        assert calling.name is not None
        return calling.parameters[calling.name]
    options = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                "required": ["name", "arguments"], "additionalProperties": False}
               for name, schema in calling.parameters.items()]
    array: dict[str, Any] = {"type": "array", "items": options[0] if len(options) == 1 else {"anyOf": options},
                             "minItems": 1}
    if not calling.parallel:
        array["maxItems"] = 1
    return array


# ---- messages ----

def message_extras(f: Fields) -> dict[str, Any]:
    """A message's tool fields (`f` reads the message), checked, in the form chat templates read."""
    out: dict[str, Any] = {}
    for key in ("tool_call_id", "name"):
        value = f.string(key)
        if value is not None:
            out[key] = value
    calls = f.get("tool_calls")
    if calls is None:
        return out
    if not isinstance(calls, list):
        raise f.fail("tool_calls", "must be a list")
    converted = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise f.fail(f"tool_calls[{j}]", 'must be {"id", "type": "function", '
                                             '"function": {"name", "arguments"}}')
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:  # OpenAI sends a JSON string; templates expect the object
                arguments = json.loads(arguments)
            except ValueError:
                pass
        converted.append({"id": call.get("id"), "type": "function",
                          "function": {"name": fn["name"], "arguments": arguments}})
    out["tool_calls"] = converted
    return out


def for_template(messages: list[dict[str, Any]], template: str | None) -> list[dict[str, Any]]:
    """The messages as the template gets them: a template that does not render `tool_calls` gets
    an assistant's calls written into its content."""
    if not template or "tool_calls" in template:
        return messages
    out = []
    for message in messages:
        if message.get("tool_calls"):
            written = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                             "arguments": c["function"]["arguments"]})
                                + "\n</tool_call>" for c in message["tool_calls"])
            message = {**message, "content": ((message.get("content") or "") + "\n" + written).strip()}
        out.append(message)
    return out


def template_renders_tools(template: Any) -> bool:
    return isinstance(template, str) and "tools" in template


# ---- answers ----

def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_calls(calling: ToolCalling, text: str) -> tuple[list[dict[str, Any]] | None, str | None]:
    """(tool_calls, content) of a finished answer: (None, text) when it holds no call."""
    if calling.mode == "named":
        assert calling.name is not None
        return [_call(calling.name, text)], None
    if calling.mode == "required":
        try:
            items = json.loads(text)
            return [_call(item["name"], json.dumps(item["arguments"])) for item in items], None
        except (ValueError, TypeError, KeyError):  # cut short by max_tokens
            return None, text
    parser = calling.auto_parser()
    if parser is not None:
        parsed = tool_calls.parse(parser, text, frozenset(calling.parameters))
        if parsed.calls:
            return [_call(c.name, c.arguments) for c in parsed.calls], parsed.content or None
        return None, parsed.content  # as streamed: trimmed, a call that did not parse as its text
    return None, text


def assistant_message(calling: ToolCalling | None, text: str, finish: str) -> tuple[dict[str, Any], str]:
    """The chat answer's message and finish_reason."""
    if calling is None or calling.mode == "none":
        return {"role": "assistant", "content": text}, finish
    calls, content = parse_calls(calling, text)
    if calls is None:
        return {"role": "assistant", "content": content}, finish
    return {"role": "assistant", "content": content, "tool_calls": calls}, _finish(finish)


def _finish(finish: str | None) -> str | None:
    """An answer with tool calls that ended by itself ends with "tool_calls" (OpenAI's reason)."""
    return "tool_calls" if finish == "stop" else finish


_ITEM_HEAD = re.compile(r'\{"name": "([A-Za-z0-9_.\-]{1,64})", "arguments": ')


class CallScanner:
    """Where each call's name and arguments are in a "required" answer as it grows (a JSON array
    of {"name", "arguments"} written with ", " and ": ", name first: the grammar's order). An
    argument value's text is complete once its own closing bracket (or the item's end) is seen.

    Incremental: `feed` reads only the new text and `spans` says where each call's arguments lie
    (the open one's end is None: it runs to the end so far), so a streamed answer costs time
    linear in its length however many chunks it comes in (re-scanning it all per chunk was
    quadratic, on the event loop, for each of up to 16 choices).
    """

    def __init__(self) -> None:
        self.text = ""
        self.spans: list[tuple[str, int, int | None]] = []  # (name, arguments start, end or None)
        self.scanned = 0  # characters read so far: each is read once
        self._depth = 0
        self._in_string = self._escaped = False
        self._item_start: int | None = None

    def feed(self, chunk: str) -> None:
        text = self.text = self.text + chunk
        spans = self.spans
        for i in range(self.scanned, len(text)):
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._item_start = i
            elif c in "]}":
                self._depth -= 1
                if self._open and self._depth in (1, 2):  # the value closed, or the item did
                    name, start, _ = spans[-1]
                    spans[-1] = (name, start, i + 1 if self._depth == 2 else i)
                if self._depth == 1:
                    self._item_start = None
            if (self._depth == 2 and not self._in_string and self._item_start is not None
                    and not self._open and text[i - 1:i + 1] == ": "):
                head = _ITEM_HEAD.fullmatch(text, self._item_start, i + 1)
                if head is not None:
                    spans.append((head.group(1), i + 1, None))
        self.scanned = len(text)

    @property
    def _open(self) -> bool:
        return bool(self.spans) and self.spans[-1][2] is None

    def calls(self) -> list[tuple[str, str]]:
        """(name, arguments so far) of each call."""
        return [(name, self.text[start:end]) for name, start, end in self.spans]


def scan_calls(text: str) -> list[tuple[str, str]]:
    """The (name, arguments so far) of each call in a prefix of a "required" answer."""
    scanner = CallScanner()
    scanner.feed(text)
    return scanner.calls()


class ToolStream:
    """One streamed choice's deltas, rewritten for its tools: a named function's call is named
    first and its arguments stream as they come; so do "required"'s calls (each named as soon as
    its name is complete); an "auto" answer goes through its tool-call parser (content as it
    comes, each call once complete)."""

    def __init__(self, calling: ToolCalling) -> None:
        self.calling = calling
        self.held: list[str] = []
        self.call_id = "call_" + uuid.uuid4().hex[:24]
        self.sent: list[int] = []  # "required": per call, the length of the arguments sent
        self.scanner = CallScanner()  # "required": the calls so far, read incrementally
        self.parser: tool_calls.ToolParser | None = None  # "auto": made once the template chose it
        self.calls = 0  # "auto": calls sent

    def rewrite(self, delta: dict[str, Any], finish: str | None) -> tuple[dict[str, Any], str | None]:
        calling = self.calling
        if calling.mode == "named":
            if "role" in delta:  # the first chunk names the call
                return {"role": "assistant", "content": None, "tool_calls": [
                    {"index": 0, "id": self.call_id, "type": "function",
                     "function": {"name": calling.name, "arguments": ""}}]}, finish
            if delta.get("content"):
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": delta["content"]}}]}
            return delta, _finish(finish)
        if calling.mode == "required":
            return self._required(delta, finish)
        name = calling.auto_parser()
        if name is None or "role" in delta:
            return delta, finish
        return self._auto(name, delta, finish)

    def _auto(self, name: str, delta: dict[str, Any], finish: str | None) -> tuple[dict[str, Any], str | None]:
        if self.parser is None:
            self.parser = tool_calls.make(name, frozenset(self.calling.parameters))
        text = delta.pop("content", "")
        parsed = self.parser.feed(text) if text else tool_calls.Parsed()
        if finish is not None:
            parsed.add(self.parser.finish())
        if parsed.content:
            delta["content"] = parsed.content
        entries = []
        for call in parsed.calls:
            entries.append({"index": self.calls, **_call(call.name, call.arguments)})
            self.calls += 1
        if entries:
            delta["tool_calls"] = entries
        return delta, (_finish(finish) if self.calls else finish)

    def _required(self, delta: dict[str, Any], finish: str | None) -> tuple[dict[str, Any], str | None]:
        if "role" in delta:
            return {"role": "assistant", "content": None}, finish
        if delta.get("content"):
            self.held.append(delta.pop("content"))
            self.scanner.feed(self.held[-1])
        entries: list[dict[str, Any]] = []
        text = self.scanner.text
        # Only calls not yet complete can have news: each call's arguments are sliced once.
        first = next((i for i, sent in enumerate(self.sent) if sent >= 0), len(self.sent))
        for index in range(first, len(self.scanner.spans)):
            name, start, end = self.scanner.spans[index]
            if index == len(self.sent):  # a call is named on its own, its arguments follow
                entries.append({"index": index, "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                                "function": {"name": name, "arguments": ""}})
                self.sent.append(0)
                if finish is None:
                    continue
            sent = self.sent[index]
            length = (end if end is not None else len(text)) - start
            if sent < 0:
                continue
            if length > sent:
                entries.append({"index": index, "function": {"arguments": text[start + sent:start + length]}})
            # a complete call is marked done (-1): nothing of it is looked at again
            self.sent[index] = -1 if end is not None else length
        if entries:
            delta["tool_calls"] = entries
        if finish is not None and not self.sent and self.held:  # not even one call began
            delta["content"] = "".join(self.held)
        return delta, (_finish(finish) if self.sent else finish)
