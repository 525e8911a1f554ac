"""OpenAI's part of /openapi.json: `POST /v1/completions` and `/v1/chat/completions` (`openai_paths`)
and their schemas (`OPENAI_SCHEMAS`): the wire format is OpenAI's (and vLLM's extras).

The request schemas are written from the tables the validator reads (gateway.openai.fields): every
field the gateway accepts, fields it knows but cannot honour marked so (a 400 unless at their neutral
value). Unknown fields are ignored (listed in the x-baton-ignored-fields response header), or a 4xx
with --strict-api. The responses' schemas are written here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.openai.fields import CHAT_OWN, COMMON, COMPLETION_OWN
from gateway.openapi_schemas import _INT, _ref, request_body

OPENAI_SCHEMAS: dict[str, Any] = {
    "OpenAICommon": COMMON.schema(),
    "CompletionRequest": {"allOf": [_ref("OpenAICommon"), COMPLETION_OWN.schema()]},
    "ChatMessage": {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "tool_calls": {"type": "array", "items": _ref("ToolCall"), "description": "Passed to the chat template."},
        "tool_call_id": {"type": "string"}, "name": {"type": "string"},
        "content": {"oneOf": [{"type": "null"}, {"type": "string"}, {"type": "array", "maxItems": 256, "items": {
            "type": "object", "properties": {
                "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}]}}},
    "ChatRequest": {"allOf": [_ref("OpenAICommon"), CHAT_OWN.schema()]},
    "ToolCall": {"type": "object", "properties": {
        "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}},
    "Usage": {"type": "object", "properties": {"prompt_tokens": _INT, "completion_tokens": _INT,
                                               "total_tokens": _INT}},
    "CompletionResponse": {"type": "object", "properties": {
        "id": {"type": "string"}, "object": {"type": "string", "enum": ["text_completion"]}, "created": _INT,
        "model": {"type": "string"}, "usage": _ref("Usage"),
        "choices": {"type": "array", "items": {"type": "object", "properties": {
            "index": _INT, "text": {"type": "string"},
            "finish_reason": {"type": "string", "enum": ["stop", "length"]}}}}}},
    "ChatResponse": {"type": "object", "properties": {
        "id": {"type": "string"}, "object": {"type": "string", "enum": ["chat.completion"]}, "created": _INT,
        "model": {"type": "string"}, "usage": _ref("Usage"),
        "choices": {"type": "array", "items": {"type": "object", "properties": {
            "index": _INT, "message": {"type": "object", "properties": {
                "role": {"type": "string"}, "content": {"type": ["string", "null"]},
                "tool_calls": {"type": "array", "items": _ref("ToolCall")},
                "reasoning_content": {"type": "string", "description": "With --reasoning-parser: the think "
                                      "block's text (absent when there was none)."},
                "reasoning": {"type": "string", "description": "The same text as reasoning_content, under "
                              "the name current vLLM uses."}}},
            "finish_reason": {"type": "string", "enum": ["stop", "length", "tool_calls"]}}}}}},
}


def openai_paths(op: Callable[..., dict[str, Any]], errors: dict[str, Any],
                 ignored_header: dict[str, Any]) -> dict[str, Any]:
    """Its paths, given gateway.openapi's helpers (`errors`: the OpenAI-shaped error responses)."""
    stream_doc = ("SSE when stream=true: `data: {chunk}` events, then `data: [DONE]`; "
                  "with stream_options.include_usage a last chunk has `choices: []` and usage.")

    return {
        "/v1/completions": {"post": op("OpenAI completions", {
            "200": {"description": "A completion, or " + stream_doc, "headers": ignored_header, "content": {
                "application/json": {"schema": _ref("CompletionResponse")},
                "text/event-stream": {"schema": {"type": "string"}}}}, **errors},
            request_body("CompletionRequest"), True)},
        "/v1/chat/completions": {"post": op("OpenAI chat completions", {
            "200": {"description": "A chat completion, or " + stream_doc, "headers": ignored_header,
                    "content": {
                "application/json": {"schema": _ref("ChatResponse")},
                "text/event-stream": {"schema": {"type": "string"}}}}, **errors},
            request_body("ChatRequest"), True)},
    }
