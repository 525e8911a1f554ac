"""Anthropic's Messages API in /openapi.json: `POST /v1/messages` and `/v1/messages/count_tokens`
(`messages_paths`) and their schemas (`MESSAGES_SCHEMAS`), hand-written: the wire format is Anthropic's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.openapi_schemas import _BOOL, _INT, _NUM, _STR_LIST, CACHE_SALT, _ref, request_body

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
    "MessagesCountTokensRequest": {"type": "object", "required": ["model", "messages"], "properties": {
        "model": {"type": "string", "description": "A served name (else 404 not_found_error)."},
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"], "properties": {
                "role": {"type": "string", "enum": ["user", "assistant"]},
                "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _ref("MessagesBlock")}]}}},
            "description": "Ends with a user message (continuing a final assistant message is a 400)."},
        "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"], "properties": {
                "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}]},
        "tools": {"type": "array", "maxItems": 128, "items": {
            "type": "object", "required": ["name", "input_schema"], "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_.\\-]{1,64}$"}, "description": {"type": "string"},
                "input_schema": {"type": "object"}}}},
        "tool_choice": {"type": "object", "required": ["type"], "description": "any: at least one call "
                        "(constrained output); tool: that one (`name`); auto: the template's tool-call format "
                        "is parsed; none: text.", "properties": {
            "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"},
            "disable_parallel_tool_use": _BOOL}},
        "thinking": {"type": "object", "required": ["type"], "description": "Maps to the chat template's "
                     "`enable_thinking` where the template takes it; budget_tokens is not enforced.", "properties": {
            "type": {"type": "string", "enum": ["enabled", "adaptive", "between_tools", "disabled"]},
            "budget_tokens": {**_INT, "minimum": 1}}},
        "output_config": {"type": "object", "properties": {"effort": {"type": "string"}, "format": {
            "type": "object", "required": ["type", "schema"], "description": "The answer follows the JSON schema "
            "(constrained decoding).", "properties": {"type": {"type": "string", "enum": ["json_schema"]},
                                                      "schema": {"type": "object"}}}}}}},
    "MessagesRequest": {"allOf": [_ref("MessagesCountTokensRequest"), {
        "type": "object", "required": ["max_tokens"], "description": "Unknown fields are ignored and listed in "
        "x-baton-ignored-fields (400 with --strict-api).", "properties": {
            "max_tokens": {**_INT, "minimum": 1}, "stream": _BOOL, "stop_sequences": {**_STR_LIST, "maxItems": 16},
            "temperature": {**_NUM, "minimum": 0, "maximum": 1}, "top_p": {**_NUM, "exclusiveMinimum": 0, "maximum": 1},
            "top_k": {**_INT, "minimum": 0}, "metadata": {"type": "object", "description": "Accepted, unused."},
            "cache_salt": CACHE_SALT}}]},
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
