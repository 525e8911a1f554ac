"""Anthropic's Messages API in /openapi.json: `POST /v1/messages` and `/v1/messages/count_tokens`
(`messages_paths`) and their schemas (`MESSAGES_SCHEMAS`): the wire format is Anthropic's. The request
bodies are written from the tables the validator reads (gateway.anthropic.fields)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.anthropic.fields import COUNT_TOKENS, MESSAGES_OWN
from gateway.openapi_schemas import _BOOL, _INT, _ref, request_body

MESSAGES_SCHEMAS: dict[str, Any] = {
    "MessagesBlock": {"type": "object", "required": ["type"], "description": "A content block: `text` {text}, "
                      "`tool_use` {id, name, input} (assistant), `tool_result` {tool_use_id, content (a string or "
                      "text blocks), is_error} (user); `thinking` blocks of earlier turns are dropped. Image and "
                      "document blocks are a 400 (a text-only model).", "properties": {
        "type": {"type": "string", "enum": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]},
        "text": {"type": "string"}, "id": {"type": "string"}, "name": {"type": "string"},
        "input": {"type": "object"}, "tool_use_id": {"type": "string"},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "is_error": _BOOL}},
    "MessagesCountTokensRequest": COUNT_TOKENS.schema(),
    "MessagesRequest": {"allOf": [_ref("MessagesCountTokensRequest"), MESSAGES_OWN.schema()]},
    "MessagesResponse": {"type": "object", "required": ["id", "type", "role", "model", "content", "stop_reason",
                                                        "usage"], "properties": {
        "id": {"type": "string"}, "type": {"type": "string", "enum": ["message"]},
        "role": {"type": "string", "enum": ["assistant"]}, "model": {"type": "string"},
        "content": {"type": "array", "items": _ref("MessagesBlock")},
        "stop_reason": {"type": "string", "enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
        "stop_sequence": {"type": ["string", "null"]},
        "usage": {"type": "object", "properties": {"input_tokens": _INT, "output_tokens": _INT}}}},
}


def messages_paths(op: Callable[..., dict[str, Any]], json_response: Callable[..., dict[str, Any]],
                   errors: dict[str, Any], ignored_header: dict[str, Any]) -> dict[str, Any]:
    """Its paths, given gateway.openapi's helpers (`errors`: the Anthropic-shaped error responses)."""
    return {
        "/v1/messages": {"post": op("Anthropic Messages (what Claude Code and the anthropic SDK speak)", {
            "200": {"description": "A message, or with stream=true SSE `event: <type>` + `data: {...}`: message_start, "
                    "ping, content_block_start / content_block_delta (text_delta, thinking_delta, input_json_delta) "
                    "/ content_block_stop per block, message_delta (stop_reason, usage), message_stop; an error "
                    "after the stream started is `event: error`.", "headers": ignored_header, "content": {
                "application/json": {"schema": _ref("MessagesResponse")},
                "text/event-stream": {"schema": {"type": "string"}}}}, **errors},
            request_body("MessagesRequest"), True)},
        "/v1/messages/count_tokens": {"post": op("Anthropic: the prompt's token count, as generation templates it", {
            "200": {**json_response({"type": "object", "required": ["input_tokens"],
                                     "properties": {"input_tokens": _INT}}, "The count."),
                    "headers": ignored_header},
            **errors}, request_body("MessagesCountTokensRequest"), True)},
    }
