"""Anthropic Messages request bodies (`/v1/messages`, `/v1/messages/count_tokens`) -> an OpenAI chat body.

The Messages API runs through the chat pipeline (gateway.openai.validation.parse_chat and on): this
module checks every Messages field itself, so that a 4xx names the field as the client sent it
(`messages.0.content.1.tool_use_id`, Anthropic's dotted paths), then writes the chat body:
- `system` (a string or text blocks, joined by newlines) -> a first system message;
- user text blocks -> the user message's text; `tool_result` blocks -> `role: "tool"` messages
  (before the user's own text, as Anthropic requires them first), `is_error` prefixed "Error: ";
- assistant text -> content, `tool_use` blocks -> `tool_calls` (input as the JSON arguments);
  earlier turns' `thinking`/`redacted_thinking` blocks are dropped (templates drop past reasoning);
- image and document blocks are a 400 naming the block: the served model reads text only; a final
  assistant message (Anthropic's "prefill") is a 400 too: the template would close that turn and
  start another, which is not what the client asked;
- `tools` -> function tools, `tool_choice` auto|any|tool|none -> "auto"|"required"|named|"none",
  `disable_parallel_tool_use` -> `parallel_tool_calls: false`; server tools (a `type` other than
  "custom") are refused by name;
- `stop_sequences` -> `stop`, `max_tokens` (required, as Anthropic requires it), `temperature`
  (Anthropic's range, 0 to 1), `top_p`, `top_k`; `metadata` is accepted and unused;
- `output_config.format` (a JSON schema) -> `response_format`, through the structured-output engine;
- `thinking` {type enabled|adaptive|between_tools|disabled, budget_tokens} -> the chat template's
  `enable_thinking` (chat_template_kwargs); a reasoning parser's split comes back as a thinking block.
Unknown fields (top level and in blocks) follow the other endpoints' policy: ignored and listed in
x-baton-ignored-fields, or a 400 with --strict-api.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from gateway.openai import validation as openai_validation
from gateway.config import Settings
from gateway.errors import ApiError, validation_error
from gateway.tools import MAX_TOOLS, NAME
from gateway.anthropic.fields import COUNT_TOKENS, MESSAGES
from gateway.validation import Fields

STATUS = 400  # Anthropic answers invalid requests with 400 invalid_request_error
MAX_BLOCKS = openai_validation.MAX_CONTENT_PARTS

# `cache_control` is a caching hint the request and every block may carry (Claude Code sends it):
# accepted, unused (the KV store reuses prefixes by itself). So are the tool hints below.
_TEXT_KEYS = {"type", "text", "cache_control", "citations"}
_TOOL_USE_KEYS = {"type", "id", "name", "input", "cache_control"}
_TOOL_RESULT_KEYS = {"type", "tool_use_id", "content", "is_error", "cache_control"}
_TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control", "strict", "defer_loading",
              "input_examples", "eager_input_streaming", "allowed_callers"}
_NOT_TEXT = {"image", "document", "search_result", "container_upload"}
_THINKING_BLOCKS = {"thinking", "redacted_thinking"}


@dataclass
class MessagesRequest:
    """A checked Messages request: the chat body to run, and what the answer needs besides."""

    chat: dict[str, Any]
    stream: bool = False
    ignored: list[str] = field(default_factory=list)


def to_chat(body: dict[str, Any], settings: Settings, count_only: bool = False) -> MessagesRequest:
    """Check a Messages body (count_tokens' when `count_only`) and translate it to a chat body."""
    f = Fields(body, STATUS)
    table = COUNT_TOKENS if count_only else MESSAGES
    ignored = table.unknown(f, "the request", settings.strict_api)
    model = f.get("model")
    if model is None:
        raise f.fail("model", "is required")
    chat: dict[str, Any] = {"model": f.string("model")}
    messages = _system(f, ignored, settings.strict_api) + _messages(f, settings, ignored)
    chat["messages"] = messages
    tools = _tools(f, settings, ignored)
    if tools:
        chat["tools"] = tools
    chat.update(_tool_choice(f, tools))
    chat.update(_output_config(f, ignored, settings.strict_api))
    _thinking(f, chat, f.get("max_tokens"), ignored, settings.strict_api)
    if count_only:
        return MessagesRequest(chat, ignored=ignored)
    if f.get("max_tokens") is None:
        raise f.fail("max_tokens", "is required")
    chat["max_tokens"] = MESSAGES.read(f, "max_tokens")  # checked against the context once tokenized
    stop = f.stop_strings("stop_sequences", settings.max_stop_sequences, settings.max_stop_length, allow_str=False)
    if stop:
        chat["stop"] = stop
    for name in ("temperature", "top_p", "top_k"):
        chat[name] = MESSAGES.read(f, name)
    chat["cache_salt"] = f.cache_salt()  # vLLM's extra (chat's): blocks shared only under this salt
    metadata = f.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise f.fail("metadata", "must be an object")
    stream = MESSAGES.read(f, "stream")
    return MessagesRequest({k: v for k, v in chat.items() if v is not None}, stream=stream, ignored=ignored)


def _system(f: Fields, ignored: list[str], strict: bool) -> list[dict[str, Any]]:
    system = f.get("system")
    if system is None:
        return []
    if isinstance(system, str):
        text = system
    elif isinstance(system, list):
        if len(system) > MAX_BLOCKS:
            raise f.fail("system", f"has {len(system)} blocks; at most {MAX_BLOCKS} are allowed")
        text = "\n".join(_text_block(block, f"system.{j}", ignored, strict) for j, block in enumerate(system))
    else:
        raise f.fail("system", "must be a string or a list of text blocks")
    return [{"role": "system", "content": text}] if text else []


def _text_block(block: Any, where: str, ignored: list[str], strict: bool) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise _fail(where, 'must be a text block ({"type": "text", "text": ...})')
    if not isinstance(block.get("text"), str):
        raise _fail(f"{where}.text", "must be a string")
    ignored += Fields(block, STATUS, prefix=where + ".").unknown(_TEXT_KEYS, f"`{where}`", strict)
    return block["text"]


def _fail(where: str, message: str) -> ApiError:
    return validation_error(f"`{where}` {message}", param=where, status=STATUS)


def _messages(f: Fields, settings: Settings, ignored: list[str]) -> list[dict[str, Any]]:
    value = f.get("messages")
    if value is None:
        raise f.fail("messages", "is required")
    if not isinstance(value, list) or not value:
        raise f.fail("messages", "must be a non-empty list")
    if len(value) > settings.max_chat_messages:
        raise f.fail("messages", f"has {len(value)} messages; at most {settings.max_chat_messages} are allowed")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise _fail(where, "must be an object")
        ignored += Fields(message, STATUS, prefix=where + ".").unknown({"role", "content"}, f"`{where}`",
                                                                      settings.strict_api)
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise _fail(f"{where}.role", f'must be "user" or "assistant", got {json.dumps(role)[:40]}')
        content = message.get("content")
        if isinstance(content, str):
            blocks: list[Any] = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            if len(content) > MAX_BLOCKS:
                raise _fail(f"{where}.content", f"has {len(content)} blocks; at most {MAX_BLOCKS} are allowed")
            blocks = content
        else:
            raise _fail(f"{where}.content", "must be a string or a list of content blocks")
        convert = _user if role == "user" else _assistant
        out += convert(blocks, where + ".content", ignored, settings.strict_api)
    if value[-1].get("role") == "assistant":
        raise _fail(f"messages.{len(value) - 1}.role", "is assistant: continuing a final assistant message "
                                                       "(prefill) is not supported; end with a user message")
    return out


def _block_type(block: Any, where: str, allowed: set[str]) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise _fail(f"{where}.type", f"must be a string naming the block, one of {sorted(allowed)}")
    if kind in _NOT_TEXT:
        raise _fail(f"{where}.type", f"is {kind!r}: this server serves a text-only model, so {kind} blocks "
                                     "are not supported")
    if kind not in allowed:
        raise _fail(f"{where}.type", f"must be one of {sorted(allowed)} here, got {json.dumps(kind)[:40]}")
    return str(kind)


def _user(blocks: list[Any], where: str, ignored: list[str], strict: bool) -> list[dict[str, Any]]:
    tool_messages: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        if _block_type(block, at, {"text", "tool_result"}) == "text":
            texts.append(_text_block(block, at, ignored, strict))
            continue
        b = Fields(block, STATUS, prefix=at + ".")
        ignored += b.unknown(_TOOL_RESULT_KEYS, f"`{at}`", strict)
        tool_use_id = b.string("tool_use_id")
        if not tool_use_id:
            raise b.fail("tool_use_id", "is required (the id of the tool_use block this answers)")
        result = block.get("content")
        if result is None:
            text = ""
        elif isinstance(result, str):
            text = result
        elif isinstance(result, list) and len(result) <= MAX_BLOCKS:
            parts = []
            for k, part in enumerate(result):
                _block_type(part, f"{at}.content.{k}", {"text"})  # an image in a result: named
                parts.append(_text_block(part, f"{at}.content.{k}", ignored, strict))
            text = "\n".join(parts)
        else:
            raise b.fail("content", "must be a string or a list of text blocks")
        if b.boolean("is_error", False):
            text = "Error: " + text
        tool_messages.append({"role": "tool", "tool_call_id": tool_use_id, "content": text})
    # Tool results answer the assistant turn before: they come first, the user's text after them.
    return tool_messages + ([{"role": "user", "content": "\n".join(texts)}] if texts or not tool_messages else [])


def _assistant(blocks: list[Any], where: str, ignored: list[str], strict: bool) -> list[dict[str, Any]]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = _block_type(block, at, {"text", "tool_use"} | _THINKING_BLOCKS)
        if kind == "text":
            texts.append(_text_block(block, at, ignored, strict))
        elif kind == "tool_use":
            b = Fields(block, STATUS, prefix=at + ".")
            ignored += b.unknown(_TOOL_USE_KEYS, f"`{at}`", strict)
            call_id, name = b.string("id"), b.string("name")
            if not call_id:
                raise b.fail("id", "is required")
            if not name:
                raise b.fail("name", "is required")
            if not isinstance(block.get("input"), dict):
                raise b.fail("input", "must be an object (the tool's arguments)")
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(block["input"], ensure_ascii=False)}})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _tools(f: Fields, settings: Settings, ignored: list[str]) -> list[dict[str, Any]]:
    tools = f.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise f.fail("tools", f"must be a list of at most {MAX_TOOLS} tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise _fail(where, "must be an object {name, description, input_schema}")
        t = Fields(tool, STATUS, prefix=where + ".")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise t.fail("type", f"is {json.dumps(kind)[:60]}: server tools are not supported; "
                                 "give custom tools {name, description, input_schema}")
        ignored += t.unknown(_TOOL_KEYS, f"`{where}`", settings.strict_api)
        name = tool.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise t.fail("name", "must be 1 to 64 letters, digits, '_', '.' or '-'")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise t.fail("input_schema", "is required: a JSON schema object")
        function: dict[str, Any] = {"name": name, "parameters": schema}
        description = t.string("description")
        if description is not None:
            function["description"] = description
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(f: Fields, tools: list[dict[str, Any]]) -> dict[str, Any]:
    choice = f.get("tool_choice")
    if choice is None:
        return {}
    if not isinstance(choice, dict):
        raise f.fail("tool_choice", 'must be an object {"type": "auto" | "any" | "tool" | "none"}')
    c = Fields(choice, STATUS, prefix="tool_choice.")
    kind = choice.get("type")
    out: dict[str, Any] = {}
    if c.boolean("disable_parallel_tool_use", False):
        out["parallel_tool_calls"] = False
    if kind in ("auto", "none"):
        out["tool_choice"] = kind
    elif kind in ("any", "tool"):
        if not tools:
            raise f.fail("tool_choice", f"type {kind!r} needs `tools`")
        if kind == "any":
            out["tool_choice"] = "required"
        else:
            name = c.string("name")
            if name not in {t["function"]["name"] for t in tools}:
                raise c.fail("name", f"names no tool in `tools` (got {json.dumps(name)[:80]})")
            out["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise c.fail("type", f'must be "auto", "any", "tool" or "none", got {json.dumps(kind)[:40]}')
    return out


def _output_config(f: Fields, ignored: list[str], strict: bool) -> dict[str, Any]:
    """`output_config.format` (a JSON schema the answer follows) -> chat's response_format; `effort`
    is accepted (a model that reasons decides for itself)."""
    config = f.get("output_config")
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise f.fail("output_config", "must be an object")
    c = Fields(config, STATUS, prefix="output_config.")
    ignored += c.unknown({"format", "effort"}, "`output_config`", strict)
    c.string("effort")
    fmt = config.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise c.fail("format", 'must be {"type": "json_schema", "schema": {...}}')
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}}


_THINKING_TYPES = {"enabled", "adaptive", "between_tools", "disabled"}


def _thinking(f: Fields, chat: dict[str, Any], max_tokens: Any, ignored: list[str], strict: bool) -> None:
    thinking = f.get("thinking")
    if thinking is None:
        return
    if not isinstance(thinking, dict):
        raise f.fail("thinking", 'must be an object {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}')
    t = Fields(thinking, STATUS, prefix="thinking.")
    kind = thinking.get("type")
    if not isinstance(kind, str) or kind not in _THINKING_TYPES:
        raise t.fail("type", f"must be one of {sorted(_THINKING_TYPES)}, got {json.dumps(kind)[:40]}")
    ignored += t.unknown({"type", "budget_tokens", "display"}, "`thinking`", strict)  # display: how it shows
    budget = t.integer("budget_tokens", lo=1)
    if kind == "enabled" and budget is None:
        raise t.fail("budget_tokens", 'is required when type is "enabled"')
    if budget is not None and isinstance(max_tokens, int) and budget >= max_tokens:
        raise t.fail("budget_tokens", f"({budget}) must be less than max_tokens ({max_tokens})")
    # The budget itself is not enforced: the model stops thinking when it does (as vLLM serves it).
    chat["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}


_CHAT_PARAMS = [(re.compile(r"tools\[(\d+)\]\.function\.parameters"), r"tools.\1.input_schema"),
                (re.compile(r"tools\[(\d+)\]\.function\.name"), r"tools.\1.name"),
                (re.compile(r"^stop$"), "stop_sequences"), (re.compile(r"`stop`"), "`stop_sequences`"),
                (re.compile(r"response_format(\.json_schema\.schema)?"), "output_config.format")]


def renamed(exc: ApiError) -> ApiError:
    """A chat-pipeline error with the chat field names it gives put back in Messages' names."""
    message, param = exc.message, exc.param
    for pattern, name in _CHAT_PARAMS:
        message = pattern.sub(name, message)
        param = pattern.sub(name, param) if param else param
    return ApiError(exc.status, message, kind=exc.kind, param=param, headers=exc.headers, code=exc.code,
                    context=exc.context)
