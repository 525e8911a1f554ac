"""The hand-written OpenAPI 3 description of every gateway endpoint (served at /openapi.json).

Hand-written on purpose: the wire formats are dictated by the clients (TGI, OpenAI), not derived
from our code, so this file states the contract and tests check the endpoints against it.
"""

from __future__ import annotations

from typing import Any

from gateway.config import Settings


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _sse(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"text/event-stream": {"schema": {"type": "string"}}}}


def _tgi_errors() -> dict[str, Any]:
    e = _ref("TgiError")
    return {
        "400": _json(e, "Host header not allowed (error_type `invalid_host`)."),
        "401": _json(e, "Missing or wrong API key (when one is configured)."),
        "408": _json(e, "Body not received within --body-read-timeout (error_type `timeout`)."),
        "413": _json(e, "Request body larger than --max-body-bytes."),
        "415": _json(e, "Content-Type is not application/json (error_type `unsupported_media_type`)."),
        "422": _json(e, "Invalid request (error_type `validation`)."),
        "429": _json(e, "Overloaded (error_type `overloaded`): too many requests in flight or queue full."),
        "500": _json(e, "Generation failed after admission (error_type `generation`)."),
        "503": _json(e, "Redis unreachable or restarted (the request's state was lost: retry), or "
                      "waited longer than --max-queue-wait for admission."),
    }


def _openai_errors() -> dict[str, Any]:
    e = _ref("OpenAIError")
    return {
        "400": _json(e, "Invalid request or Host header not allowed (type `invalid_request_error`)."),
        "401": _json(e, "Missing or wrong API key (when one is configured)."),
        "408": _json(e, "Body not received within --body-read-timeout (type `timeout`)."),
        "413": _json(e, "Request body larger than --max-body-bytes."),
        "415": _json(e, "Content-Type is not application/json."),
        "429": _json(e, "Overloaded (type `overloaded`, code 429); see Retry-After."),
        "500": _json(e, "Generation failed after admission."),
        "503": _json(e, "Redis unreachable or restarted (the request's state was lost: retry), or "
                      "waited longer than --max-queue-wait for admission."),
    }


_STR_LIST = {"type": "array", "items": {"type": "string"}}
_NUM = {"type": "number"}
_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}

SCHEMAS: dict[str, Any] = {
    "TgiParameters": {
        "type": "object",
        "description": "TGI generation parameters. Fields TGI defines but this server does not implement "
                       "(best_of, grammar, top_n_tokens, typical_p, watermark, frequency_penalty, adapter_id) "
                       "are accepted only at their neutral value; unknown fields are rejected.",
        "properties": {
            "max_new_tokens": {**_INT, "minimum": 1, "description": "Default 100 (capped by the room left)."},
            "do_sample": {**_BOOL, "default": False, "description": "False: greedy; sampling parameters ignored."},
            "temperature": {**_NUM, "minimum": 0},
            "top_p": {**_NUM, "exclusiveMinimum": 0, "maximum": 1},
            "top_k": {**_INT, "minimum": 1},
            "repetition_penalty": {**_NUM, "exclusiveMinimum": 0},
            "seed": {**_INT, "minimum": 0},
            "stop": {**_STR_LIST, "maxItems": 16, "description": "Stop sequences; the text is cut before the match."},
            "truncate": {**_INT, "minimum": 1, "description": "Keep only the last N prompt tokens."},
            "details": {**_BOOL, "default": False},
            "return_full_text": {**_BOOL, "default": False},
            "decoder_input_details": {**_BOOL, "description": "Accepted and ignored (prefill is always [])."},
        },
    },
    "TgiRequest": {
        "type": "object", "required": ["inputs"], "additionalProperties": False,
        "properties": {"inputs": {"type": "string", "minLength": 1}, "parameters": _ref("TgiParameters"),
                       "stream": {**_BOOL, "description": "Only for POST /: stream (SSE) or not."},
                       "add_special_tokens": {**_BOOL, "default": True}},
    },
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
    "TgiError": {"type": "object", "required": ["error", "error_type"], "properties": {
        "error": {"type": "string"},
        "error_type": {"type": "string", "enum": ["validation", "overloaded", "unavailable", "authentication",
                                                  "payload_too_large", "generation", "not_found",
                                                  "unsupported_media_type", "invalid_host", "timeout"]}}},
    "OpenAICommon": {"type": "object", "properties": {
        "model": {"type": "string", "description": "Accepted; the response names the served model."},
        "max_tokens": {**_INT, "minimum": 1}, "max_completion_tokens": {**_INT, "minimum": 1},
        "stream": _BOOL,
        "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}},
        "stop": {"oneOf": [{"type": "string"}, {**_STR_LIST, "maxItems": 16}]},
        "temperature": {**_NUM, "minimum": 0, "maximum": 2, "default": 1, "description": "0: greedy."},
        "top_p": {**_NUM, "exclusiveMinimum": 0, "maximum": 1}, "seed": _INT,
        "n": {"type": "integer", "enum": [1]},
        "top_k": _INT, "repetition_penalty": _NUM, "ignore_eos": _BOOL,
        "stop_token_ids": {"type": "array", "items": {**_INT, "minimum": 0}, "maxItems": 128},
        "user": {"type": "string"}}},
    "CompletionRequest": {"allOf": [_ref("OpenAICommon"), {"type": "object", "required": ["prompt"], "properties": {
        "prompt": {"oneOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": _INT, "minItems": 1}],
                   "description": "Default max_tokens 16."},
        "echo": {"type": "boolean", "enum": [False]}}}]},
    "ChatMessage": {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "maxItems": 256, "items": {
            "type": "object", "properties": {
                "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}]}}},
    "ChatRequest": {"allOf": [_ref("OpenAICommon"), {"type": "object", "required": ["messages"], "properties": {
        "messages": {"type": "array", "minItems": 1, "maxItems": 1024, "items": _ref("ChatMessage"),
                     "description": "Rendered with the model's chat template (add_generation_prompt). "
                                    "Default max_tokens: the room left, at most 1024."}}}]},
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
                "role": {"type": "string"}, "content": {"type": "string"}}},
            "finish_reason": {"type": "string", "enum": ["stop", "length"]}}}}}},
    "DashboardData": {"type": "object", "required": ["time", "now", "series", "workers"], "properties": {
        "time": {**_NUM, "description": "Server time (Unix seconds)."},
        "model": {"type": "string"}, "gateway_id": {"type": "string"},
        "interval_s": {**_NUM, "description": "Seconds between points of the series."},
        "window_s": {**_NUM, "description": "Window of the latency percentiles (seconds)."},
        "rate_window_s": {**_NUM, "description": "Window of the headline rates (seconds)."},
        "history_s": {**_NUM, "description": "Span the series cover when full (seconds)."},
        "redis": {"type": "object", "properties": {"ok": _BOOL, "error": {"type": ["string", "null"]}}},
        "now": {"type": "object",
                "description": "Current values; latencies in seconds (null: no sample in the window).",
                "properties": {
                    "running": _INT, "waiting": _INT, "budget_in_use": _INT, "budget_total": _INT,
                    "tokens_per_s": _NUM, "requests_per_s": _NUM, "rejections_per_s": _NUM,
                    "ttft_p50": {"type": ["number", "null"]}, "ttft_p99": {"type": ["number", "null"]},
                    "itl_p50": {"type": ["number", "null"]}, "itl_p99": {"type": ["number", "null"]},
                    "generated_tokens": _NUM, "prompt_tokens": _NUM, "preemptions": _INT, "rejections": _INT,
                    "rejections_by_reason": {"type": "object", "additionalProperties": _INT},
                    "finished_by_reason": {"type": "object", "additionalProperties": _INT},
                    "failed_by_reason": {"type": "object", "additionalProperties": _INT},
                    "streams": {"type": "object", "description": "prefill / decode: length (XLEN), pending "
                                "(delivered, not acked), lag (not yet delivered to the group).",
                                "additionalProperties": {"type": "object", "properties": {
                                    "length": {"type": ["integer", "null"]}, "pending": {"type": ["integer", "null"]},
                                    "lag": {"type": ["integer", "null"]}}}}}},
        "series": {"type": "object", "description": "Parallel arrays, one point per interval (oldest first): `t` "
                   "(Unix seconds), tokens_per_s, requests_per_s, ttft_p50, ttft_p99, itl_p50, itl_p99 (seconds, "
                   "over the last window_s), running, waiting, budget_in_use, budget_total, rejections_per_s, "
                   "preemptions_per_s, kv_usage (mean over decode workers, 0-1), prefill_backlog, decode_backlog.",
                   "additionalProperties": {"type": "array", "items": {"type": ["number", "null"]}}},
        "workers": {"type": "array", "items": {"type": "object", "properties": {
            "kind": {"type": "string", "enum": ["gateway", "prefill", "decode"]}, "worker_id": {"type": "string"},
            "age_s": {**_NUM, "description": "Seconds since its last heartbeat."},
            "status": {"type": "string", "enum": ["ok", "stale", "lost"],
                       "description": "lost: the heartbeat expired (listed for a minute)."},
            "running": {"type": ["integer", "null"]}, "waiting": {"type": ["integer", "null"]},
            "kv_used": {"type": ["integer", "null"]}, "kv_total": {"type": ["integer", "null"]},
            "kv_usage": {"type": ["number", "null"]}, "preemptions": {"type": ["integer", "null"]},
            "finished": {"type": ["integer", "null"]}}}}}},
    "OpenAIError": {"type": "object", "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": ["integer", "string", "null"]}}}}},
}


def openapi_spec(settings: Settings) -> dict[str, Any]:
    tgi_body = {"required": True, "content": {"application/json": {"schema": _ref("TgiRequest")}}}
    generation_security: list[dict[str, list[str]]] = [{"bearer": []}] if settings.api_key else []
    stream_doc = ("SSE: one `data:{TgiStreamEvent}` per token; the last carries generated_text and "
                  "details; an error mid-stream is `data:{\"error\", \"error_type\": \"generation\"}`.")
    openai_stream_doc = ("SSE when stream=true: `data: {chunk}` events, then `data: [DONE]`; "
                         "with stream_options.include_usage a last chunk has `choices: []` and usage.")

    def op(summary: str, responses: dict[str, Any], body: dict[str, Any] | None = None,
           secured: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"summary": summary, "responses": responses}
        if body is not None:
            out["requestBody"] = body
        if secured:
            out["security"] = generation_security
        return out

    def openai_body(name: str) -> dict[str, Any]:
        return {"required": True, "content": {"application/json": {"schema": _ref(name)}}}

    paths = {
        "/generate": {"post": op("TGI: generate text", {
            "200": _json(_ref("TgiResponse"), "Generated text (details when asked)."), **_tgi_errors()},
            tgi_body, True)},
        "/generate_stream": {"post": op("TGI: generate text as a token stream", {
            "200": _sse(stream_doc), **_tgi_errors()}, tgi_body, True)},
        "/": {"post": op("TGI compat route (huggingface_hub posts here): `stream` picks the mode", {
            "200": {"description": "stream=false: a JSON list of one TgiResponse; stream=true: " + stream_doc,
                    "content": {"application/json": {"schema": {"type": "array", "items": _ref("TgiResponse")}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **_tgi_errors()}, tgi_body, True)},
        "/v1/completions": {"post": op("OpenAI completions", {
            "200": {"description": "A completion, or " + openai_stream_doc, "content": {
                "application/json": {"schema": _ref("CompletionResponse")},
                "text/event-stream": {"schema": {"type": "string"}}}}, **_openai_errors()},
            openai_body("CompletionRequest"), True)},
        "/v1/chat/completions": {"post": op("OpenAI chat completions", {
            "200": {"description": "A chat completion, or " + openai_stream_doc, "content": {
                "application/json": {"schema": _ref("ChatResponse")},
                "text/event-stream": {"schema": {"type": "string"}}}}, **_openai_errors()},
            openai_body("ChatRequest"), True)},
        "/v1/models": {"get": op("OpenAI: the served model", {"200": _json(
            {"type": "object", "properties": {"object": {"type": "string"}, "data": {"type": "array"}}},
            "A list with the one served model.")}, secured=True)},
        "/info": {"get": op("TGI-style model and limits", {"200": _json({"type": "object"},
            "model_id, max_input_tokens, max_total_tokens, max_concurrent_requests, ...")})},
        "/health": {"get": op("Liveness: Redis reachable", {
            "200": _json({"type": "object"}, "Redis answers; counts of live workers."),
            "503": _json(_ref("TgiError"), "Redis unreachable.")})},
        "/stats": {"get": op("Token budget, running/waiting requests, rejections, worker heartbeats",
                             {"200": _json({"type": "object"}, "Gateway state.")}, secured=True)},
        "/dashboard": {"get": op("Live dashboard: one self-contained HTML page (no external assets) that polls "
                                 "/dashboard/data every second", {
            "200": {"description": "The dashboard page.", "content": {"text/html": {"schema": {"type": "string"}}}},
            "401": _json(_ref("TgiError"), "Missing or wrong API key (when one is configured).")}, secured=True)},
        "/dashboard/data": {"get": op("The dashboard's data: current state, time series, worker health", {
            "200": _json(_ref("DashboardData"), "Sampled once a second by the gateway."),
            "401": _json(_ref("TgiError"), "Missing or wrong API key (when one is configured).")}, secured=True)},
        "/metrics": {"get": op("Prometheus metrics (baton:*)", {
            "200": {"description": "Prometheus text format.",
                    "content": {"text/plain": {"schema": {"type": "string"}}}}})},
        "/openapi.json": {"get": op("This document", {"200": _json({"type": "object"}, "OpenAPI 3 document.")})},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "Baton gateway", "version": "0.1.0",
                 "description": f"Serves `{settings.model_name}` with TGI- and OpenAI-compatible APIs. "
                                f"Limits: max_input_tokens={settings.max_input_tokens}, "
                                f"max_total_tokens={settings.max_total_tokens}."},
        "paths": paths,
        "components": {"schemas": SCHEMAS,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
