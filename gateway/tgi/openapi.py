"""TGI's part of /openapi.json: `POST /generate`, `/generate_stream` and `/` (`tgi_paths`, given
gateway.openapi's helpers) and their schemas (`TGI_SCHEMAS`). The wire format is TGI's; the
request body and its `parameters` are written from the tables the validator checks them with
(gateway.tgi.parameters)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.openapi_schemas import _BOOL, _INT, _ref, request_body
from gateway.tgi.parameters import PARAMETERS, REQUEST

TGI_SCHEMAS: dict[str, Any] = {
    "TgiParameters": PARAMETERS.schema(),
    "TgiRequest": REQUEST.schema(),
    "TgiToken": {"type": "object", "properties": {
        "id": _INT, "text": {"type": "string"}, "logprob": {"type": ["number", "null"]}, "special": _BOOL}},
    "TgiDetails": {"type": "object", "properties": {
        "finish_reason": {"type": "string", "enum": ["length", "eos_token", "stop_sequence"]},
        "generated_tokens": _INT, "seed": {"type": ["integer", "null"]}, "input_length": _INT,
        "prefill": {"type": "array", "items": _ref("TgiToken")},
        "tokens": {"type": "array", "items": _ref("TgiToken")}}},
    "TgiResponse": {"type": "object", "required": ["generated_text"], "properties": {
        "generated_text": {"type": "string"}, "details": _ref("TgiDetails")}},
    "TgiStreamEvent": {"type": "object", "description": "One SSE `data:` event per generated token.",
                       "properties": {"index": _INT, "token": _ref("TgiToken"),
                                      "generated_text": {"type": ["string", "null"],
                                                         "description": "Set on the last event only."},
                                      "details": {"oneOf": [_ref("TgiDetails"), {"type": "null"}],
                                                  "description": "Last event only, when details=true "
                                                                 "(no tokens/prefill lists)."}}},
}


def tgi_paths(op: Callable[..., dict[str, Any]], json_response: Callable[..., dict[str, Any]],
              tgi_errors: dict[str, Any], ignored_header: dict[str, Any]) -> dict[str, Any]:
    body = request_body("TgiRequest")
    stream_doc = ("SSE: one `data:{TgiStreamEvent}` per token; the last carries generated_text and "
                  "details; an error mid-stream is `data:{\"error\", \"error_type\": \"generation\"}`.")
    sse = {"description": stream_doc, "content": {"text/event-stream": {"schema": {"type": "string"}}}}
    return {
        "/generate": {"post": op("TGI: generate text", {
            "200": {**json_response(_ref("TgiResponse"), "Generated text (details when asked)."),
                    "headers": ignored_header},
            **tgi_errors}, body, True)},
        "/generate_stream": {"post": op("TGI: generate text as a token stream", {
            "200": {**sse, "headers": ignored_header}, **tgi_errors}, body, True)},
        "/": {"post": op("TGI compat route (huggingface_hub posts here): `stream` picks the mode", {
            "200": {"description": "stream=false: a JSON list of one TgiResponse; stream=true: " + stream_doc,
                    "headers": ignored_header,
                    "content": {"application/json": {"schema": {"type": "array", "items": _ref("TgiResponse")}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **tgi_errors}, body, True)},
    }
