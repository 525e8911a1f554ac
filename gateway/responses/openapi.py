"""The Responses API's part of /openapi.json: its paths (`responses_paths`, given gateway.openapi's
helpers) and schemas (`RESPONSES_SCHEMAS`), hand-written like the rest: the wire format is OpenAI's.
`ResponsesRequest` is written from the table the validator reads (gateway.responses.fields).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.openapi_schemas import _ref
from gateway.responses.fields import REQUEST

_STR = {"type": "string"}
_NULLABLE_STR = {"type": ["string", "null"]}
_INT = {"type": "integer"}
_TEXT_PART = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"type": "string", "enum": ["input_text", "output_text"]}, "text": _STR}}

RESPONSES_SCHEMAS: dict[str, Any] = {
    "ResponsesInputItem": {"type": "object", "description": "A message ({role, content}; `type` \"message\" "
                           "optional), a `function_call` {call_id, name, arguments} (an earlier tool call), a "
                           "`function_call_output` {call_id, output} (its result) or a `reasoning` item (dropped). "
                           "Any other item or content part type is a 400 naming it.", "properties": {
        "type": {"type": "string", "enum": ["message", "function_call", "function_call_output", "reasoning"]},
        "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]},
        "content": {"oneOf": [_STR, {"type": "array", "items": _TEXT_PART}]},
        "call_id": _STR, "name": _STR, "arguments": {**_STR, "description": "JSON text."},
        "output": {"oneOf": [_STR, {"type": "array", "items": _TEXT_PART}]}}},
    "ResponsesTool": {"type": "object", "required": ["type", "name"], "description": "Function tools only "
                      "(another `type` is a 400 naming `tools[i].type`).", "properties": {
        "type": {"type": "string", "enum": ["function"]}, "name": _STR, "description": _NULLABLE_STR,
        "parameters": {"type": "object", "description": "A JSON schema (compiled: an invalid one is a 400)."},
        "strict": {"type": ["boolean", "null"]}}},
    "ResponsesRequest": REQUEST.schema(),
    "ResponsesOutputItem": {"type": "object", "description": "`message` {id msg_..., role, status, content: "
                            "[{type: output_text, text, annotations}]}, `function_call` {id fc_..., call_id, name, "
                            "arguments, status} or `reasoning` {id rs_..., summary, content: [{type: "
                            "reasoning_text, text}]} (a model's thoughts, when a reasoning parser splits them).",
                            "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["message", "function_call", "reasoning"]}, "id": _STR,
        "status": {"type": "string", "enum": ["in_progress", "completed", "incomplete"]}}},
    "Response": {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output"],
                 "description": "OpenAI's Response object; it also repeats the request's settings (instructions, "
                                "tools, tool_choice, text, temperature, top_p, max_output_tokens, store, ...).",
                 "properties": {
        "id": {**_STR, "description": "resp_..."}, "object": {"type": "string", "enum": ["response"]},
        "created_at": _INT, "model": _STR,
        "status": {"type": "string", "enum": ["completed", "incomplete", "failed", "in_progress"]},
        "incomplete_details": {"type": ["object", "null"]}, "error": {"type": ["object", "null"]},
        "output": {"type": "array", "items": _ref("ResponsesOutputItem")},
        "usage": {"type": "object", "properties": {"input_tokens": _INT, "output_tokens": _INT, "total_tokens": _INT,
                                                   "input_tokens_details": {"type": "object"},
                                                   "output_tokens_details": {"type": "object"}}},
        "previous_response_id": _NULLABLE_STR}},
}

_STREAM_DOC = ("SSE when stream=true: `event: <type>` + `data: {type, sequence_number, ...}` (numbered from 0): "
               "response.created, response.in_progress, then per item response.output_item.added, "
               "response.content_part.added, response.output_text.delta (response.reasoning_text.delta, "
               "response.function_call_arguments.delta), their .done events and response.output_item.done; "
               "last response.completed, response.incomplete (max_output_tokens reached) or response.failed "
               "(an error after the stream began). No [DONE].")


def responses_paths(op: Callable[..., dict[str, Any]], json_response: Callable[[Any, str], dict[str, Any]],
                    errors: dict[str, Any], ignored_header: dict[str, Any]) -> dict[str, Any]:
    """The paths, built with gateway.openapi's `op`, `_json`, OpenAI errors and ignored-fields header."""
    body = {"required": True, "content": {"application/json": {"schema": _ref("ResponsesRequest")}}}
    error = _ref("OpenAIError")
    by_id = {
        "400": json_response(error, "`response_id` is no response id (`resp_...`)."),
        "404": json_response(error, "No such stored response (never stored, expired, deleted, dropped "
                                    "past --responses-max-bytes, or --responses-ttl 0)."),
        "503": json_response(error, "Redis unreachable.")}
    by_id_param = {"parameters": [{"name": "response_id", "in": "path", "required": True, "schema": _STR}]}
    return {
        "/v1/responses": {"post": op("OpenAI Responses API (what Codex CLI and the Agents SDK speak)", {
            "200": {"description": "A Response, or " + _STREAM_DOC, "headers": ignored_header, "content": {
                "application/json": {"schema": _ref("Response")},
                "text/event-stream": {"schema": {"type": "string"}}}},
            **errors,
            "404": json_response(error, "`model` names no served model, or `previous_response_id` no stored "
                                        "response (param names which).")}, body, True)},
        "/v1/responses/{response_id}": {
            "get": by_id_param | op("A stored Response (store: true, within --responses-ttl)", {
                "200": json_response(_ref("Response"), "The response as it was answered."), **by_id}, None, True),
            "delete": by_id_param | op("Delete a stored Response", {
                "200": json_response({"type": "object", "properties": {
                    "id": _STR, "object": _STR, "deleted": {"type": "boolean"}}}, "Deleted."), **by_id}, None, True)},
    }
