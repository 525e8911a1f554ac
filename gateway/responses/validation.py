"""`POST /v1/responses` bodies (OpenAI's Responses API) -> a checked `ResponsesRequest`, which
builds the chat-completions body the chat pipeline serves (gateway.openai.validation.parse_chat).

Rules:
- `input` is a string (one user message) or a list of items: messages (role user, assistant,
  system or developer; content a string or `input_text`/`output_text` parts), `function_call`
  items (an assistant's tool call; consecutive calls join one assistant message, as chat has them)
  and `function_call_output` items (a `tool` message); `reasoning` items are dropped (a template
  re-renders no model's thoughts). Any other item or part type is a 400 naming it.
- `instructions` become the first (system) message; as OpenAI does, they are not carried over by
  `previous_response_id`, whose stored conversation goes between them and the new input.
- `tools` are function tools only (others are a 400 naming `tools[i].type`); `tool_choice`,
  `parallel_tool_calls`, `text.format` (-> chat's `response_format`), `max_output_tokens` (->
  `max_completion_tokens`), `temperature`, `top_p`, `model` and `user` pass to chat, whose checks
  (schemas compiled, context) apply; the scalars are first checked here by the table
  (gateway.responses.fields), so their 400s name this API's fields; `responses_error` renames the
  fields chat's errors name back to this API's (`messages[3]` -> `input[2]`, `response_format` ->
  `text.format`, ...).
- Hints that change nothing here are accepted: `reasoning` ({effort, summary}), `include`,
  `prompt_cache_key`, `safety_identifier`, `metadata`, `text.verbosity`, `stream_options`. Known
  fields we cannot honour are accepted only at their neutral value (`truncation: "disabled"`,
  `background: false`, ...). Known fields, neutral values and scalar bounds come from the table
  `gateway.responses.fields.REQUEST`, which /openapi.json documents. Unknown fields follow
  gateway.validation's policy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from gateway import sampling_defaults
from gateway.config import Settings
from gateway.errors import ApiError
from gateway.tools import MAX_TOOLS
from gateway.validation import Fields
from gateway.openai.validation import MAX_CONTENT_PARTS, STATUS
from gateway.responses.fields import REQUEST

RESPONSE_ID = re.compile(r"^resp_[A-Za-z0-9_-]{1,128}$")
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
MAX_METADATA = 16  # OpenAI's limits on `metadata`: 16 pairs, keys <= 64 and values <= 512 characters


@dataclass
class ResponsesRequest:
    """One checked Responses request: what the chat pipeline gets and what the response repeats."""

    chat: dict[str, Any]  # the chat-completions body, without `messages`
    input_messages: list[dict[str, Any]]  # this request's input, as chat messages
    input_origins: list[str]  # the Responses field each of them came from (for error messages)
    instructions: str | None
    previous_response_id: str | None
    store: bool
    stream: bool
    settings: dict[str, Any]  # the request's settings, as the response object repeats them
    ignored: list[str] = field(default_factory=list)

    def chat_body(self, history: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
        """The chat body after `history` (a previous response's conversation), and the origin of
        each of its messages."""
        head = [{"role": "system", "content": self.instructions}] if self.instructions else []
        origins = ["instructions"] * len(head) + ["previous_response_id"] * len(history) + self.input_origins
        return {**self.chat, "messages": head + history + self.input_messages}, origins


def check_response_id(value: Any, where: str) -> str:
    """An id of ours (`resp_...`); anything else is a 400 naming `where`, as OpenAI answers."""
    if not isinstance(value, str) or not RESPONSE_ID.match(value):
        shown = repr(value)[:80]
        raise ApiError(STATUS, f"Invalid `{where}`: {shown}. Expected an ID that begins with 'resp_'.",
                       param=where)
    return value


def parse_responses(body: dict[str, Any], settings: Settings) -> ResponsesRequest:
    f = Fields(body, STATUS)
    ignored = REQUEST.unknown(f, "the request", settings.strict_api)
    REQUEST.check_neutral(f)
    for key in ("user", "prompt_cache_key", "safety_identifier"):
        f.string(key)
    _string_list(f, "include")
    if f.get("stream_options") is not None and not isinstance(f.get("stream_options"), dict):
        raise f.fail("stream_options", "must be an object")
    instructions = f.string("instructions")
    previous = f.get("previous_response_id")
    if previous is not None:
        check_response_id(previous, "previous_response_id")
    messages, origins = _input(f, settings.max_chat_messages)
    tools = _tools(f)
    tool_choice = _tool_choice(f)
    response_format, text, text_ignored = _text(f, settings.strict_api)
    reasoning = _reasoning(f)
    # max_output_tokens, temperature, top_p and the flags, checked by the table (errors name them)
    scalars = {name: REQUEST.read(f, name) for name in REQUEST.scalars()}
    stream = scalars["stream"]
    chat: dict[str, Any] = {"stream": stream}
    salt = f.cache_salt()  # vLLM's extra (chat's): the prefix cache shares blocks only under this salt
    if salt is not None:
        chat["cache_salt"] = salt
    for key in ("model", "user"):
        if f.get(key) is not None:
            chat[key] = f.get(key)
    for key in ("temperature", "top_p", "parallel_tool_calls"):
        if f.get(key) is not None:
            chat[key] = scalars[key]
    if scalars["max_output_tokens"] is not None:
        chat["max_completion_tokens"] = scalars["max_output_tokens"]
    if tools:
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                           if t.get(k) is not None}} for t in tools]
    if tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(tool_choice)
    if response_format is not None:
        chat["response_format"] = response_format
    # The response repeats the sampling that applies: the model's default where the request set none.
    applied = sampling_defaults.for_settings(settings).fill(temperature=scalars["temperature"], top_p=scalars["top_p"])
    echoed = {
        "instructions": instructions, "tools": tools, "tool_choice": tool_choice or "auto",
        "parallel_tool_calls": scalars["parallel_tool_calls"],
        "temperature": applied["temperature"], "top_p": applied["top_p"],
        "max_output_tokens": scalars["max_output_tokens"], "previous_response_id": previous,
        "text": text, "metadata": _metadata(f), "user": f.get("user"), "truncation": "disabled",
        "reasoning": reasoning, "background": False, "service_tier": "default", "top_logprobs": 0,
        "max_tool_calls": None, "prompt_cache_key": f.get("prompt_cache_key"),
        "safety_identifier": f.get("safety_identifier"),
    }
    return ResponsesRequest(chat=chat, input_messages=messages, input_origins=origins, instructions=instructions,
                            previous_response_id=previous, store=scalars["store"], stream=stream,
                            settings=echoed, ignored=ignored + text_ignored)


def _string_list(f: Fields, key: str) -> None:
    value = f.get(key)
    if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise f.fail(key, "must be a list of strings")


def _input(f: Fields, max_messages: int) -> tuple[list[dict[str, Any]], list[str]]:
    value = f.get("input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}], ["input"]
    if not isinstance(value, list) or not value:
        raise f.fail("input", "is required: a string or a non-empty list of input items")
    if len(value) > max_messages:
        raise f.fail("input", f"has {len(value)} items; at most {max_messages} are allowed")
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    call_names: dict[str, str] = {}  # call_id -> function name, for the tool messages
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise f.fail(where, "must be an object (an input item)")
        g = Fields(item, STATUS, prefix=where + ".")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(g, item))
        elif kind == "function_call":
            call = _function_call(g)
            call_names[call["id"]] = call["function"]["name"]
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # one assistant turn, several calls
                continue
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _required_string(g, "call_id")
            tool: dict[str, Any] = {"role": "tool", "tool_call_id": call_id, "content": _output(g)}
            if call_id in call_names:
                tool["name"] = call_names[call_id]
            messages.append(tool)
        elif kind == "reasoning":
            continue  # the model's earlier thoughts: chat templates drop them too
        else:
            raise g.fail("type", f"must be message, function_call, function_call_output or reasoning "
                                 f"(got {str(kind)[:40]!r}: this server takes no other input items)")
        origins.append(where)
    if not messages:
        raise f.fail("input", "holds no message or function call (reasoning items alone say nothing)")
    return messages, origins


def _message(g: Fields, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise g.fail("role", f"must be one of {', '.join(MESSAGE_ROLES)} (got {str(role)[:40]!r})")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise g.fail("content", "must be a string or a list of input_text / output_text parts")
    if len(content) > MAX_CONTENT_PARTS:
        raise g.fail("content", f"has {len(content)} parts; at most {MAX_CONTENT_PARTS} are allowed")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else None
            raise g.fail(f"content[{j}].type", f"must be input_text or output_text (got {str(kind)[:40]!r}: "
                                               "this server reads text only)")
        text = part.get("text")
        if not isinstance(text, str):
            raise g.fail(f"content[{j}].text", "must be a string")
        texts.append(text)
    return {"role": role, "content": "".join(texts)}


def _required_string(g: Fields, key: str) -> str:
    value = g.string(key)
    if not value:
        raise g.fail(key, "is required (a non-empty string)")
    return value


def _function_call(g: Fields) -> dict[str, Any]:
    call_id, name = _required_string(g, "call_id"), _required_string(g, "name")
    arguments = g.string("arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments or "{}"}}


def _output(g: Fields) -> str:
    output = g.get("output")
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS
                                        and isinstance(p.get("text"), str) for p in output):
        return "".join(p["text"] for p in output)
    raise g.fail("output", "must be a string or a list of input_text parts")


def _tools(f: Fields) -> list[dict[str, Any]]:
    tools = f.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise f.fail("tools", f"must be a list of at most {MAX_TOOLS} tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise f.fail(where, 'must be {"type": "function", "name": ..., "parameters": ...}')
        if tool.get("type") != "function":
            raise f.fail(where + ".type", f"{str(tool.get('type'))[:40]!r} is not supported by this server: "
                                          "only function tools (type \"function\")")
        g = Fields(tool, STATUS, prefix=where + ".")
        g.string("description")
        g.boolean("strict", True)
        out.append({"type": "function", "name": tool.get("name"), "description": tool.get("description"),
                    "parameters": tool.get("parameters"), "strict": tool.get("strict", True)})
    return out


def _tool_choice(f: Fields) -> str | dict[str, Any] | None:
    choice = f.get("tool_choice")
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        Fields(choice, STATUS, prefix="tool_choice.").string("name")
        return {"type": "function", "name": choice.get("name")}
    if isinstance(choice, dict):
        raise f.fail("tool_choice.type", f"{str(choice.get('type'))[:40]!r} is not supported by this server: "
                                         'only "function"')
    raise f.fail("tool_choice", 'must be "auto", "none", "required" or {"type": "function", "name": ...}')


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice["name"]}}


def _text(f: Fields, strict: bool) -> tuple[dict[str, Any] | None, dict[str, Any], list[str]]:
    """`text` -> (chat's response_format, the `text` the response repeats, ignored names)."""
    value = f.get("text")
    if value is None:
        return None, {"format": {"type": "text"}}, []
    if not isinstance(value, dict):
        raise f.fail("text", "must be an object")
    t = Fields(value, STATUS, prefix="text.")
    ignored = t.unknown({"format", "verbosity"}, "`text`", strict)
    t.string("verbosity")  # a hint for OpenAI's models; ours answer as they answer
    fmt = value.get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_schema", "json_object"):
        raise t.fail("format", 'must be {"type": "text"}, {"type": "json_object"} or '
                               '{"type": "json_schema", "name": ..., "schema": ...}')
    echoed = {"format": fmt, **({"verbosity": value["verbosity"]} if value.get("verbosity") else {})}
    if fmt["type"] == "text":
        return None, echoed, ignored
    if fmt["type"] == "json_object":
        return {"type": "json_object"}, echoed, ignored
    if not isinstance(fmt.get("schema"), dict):
        raise t.fail("format.schema", "is required: a JSON schema (an object)")
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
    return {"type": "json_schema", "json_schema": spec}, echoed, ignored


def _reasoning(f: Fields) -> dict[str, Any]:
    value = f.get("reasoning")
    if value is None:
        return {"effort": None, "summary": None}
    if not isinstance(value, dict):
        raise f.fail("reasoning", "must be an object ({effort, summary})")
    r = Fields(value, STATUS, prefix="reasoning.")
    return {"effort": r.string("effort"), "summary": r.string("summary") or r.string("generate_summary")}


def _metadata(f: Fields) -> dict[str, str]:
    value = f.get("metadata")
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA:
        raise f.fail("metadata", f"must be an object of at most {MAX_METADATA} string pairs")
    for key, item in value.items():
        if len(key) > 64 or not isinstance(item, str) or len(item) > 512:
            raise f.fail("metadata", "keys must be at most 64 characters and values strings of at most 512")
    return dict(value)


# ---- chat's errors, in this API's names ----

_RENAMES = [
    (re.compile(r"response_format\.json_schema\."), "text.format."),
    (re.compile(r"response_format"), "text.format"),
    (re.compile(r"max_completion_tokens|max_tokens"), "max_output_tokens"),
    (re.compile(r"(tools\[\d+\])\.function\."), r"\1."),
    (re.compile(r"tool_choice\.function\."), "tool_choice."),
]
_MESSAGE = re.compile(r"messages\[(\d+)\]")


def responses_error(exc: ApiError, origins: list[str]) -> ApiError:
    """Chat's error `exc`, naming the Responses fields the chat fields came from."""

    def rename(text: str) -> str:
        for pattern, replacement in _RENAMES:
            text = pattern.sub(replacement, text)
        text = _MESSAGE.sub(lambda m: origins[int(m.group(1))] if int(m.group(1)) < len(origins) else m.group(0),
                            text)
        return re.sub(r"\bmessages\b", "input", text)

    renamed = ApiError(exc.status, rename(exc.message), kind=exc.kind,
                       param=rename(exc.param) if exc.param else exc.param, headers=exc.headers, code=exc.code,
                       context=exc.context)
    return renamed
