"""The schemas of /openapi.json that belong to no one API (the error shapes, the dashboard's data),
and the pieces every API's part builds its schemas from. Each API's own schemas are its package's
(gateway.<api>.openapi), hand-written like the paths: the wire formats are the clients'.
"""

from __future__ import annotations

from typing import Any


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def request_body(name: str) -> dict[str, Any]:
    """A required JSON request body of the named schema."""
    return {"required": True, "content": {"application/json": {"schema": _ref(name)}}}


_STR_LIST = {"type": "array", "items": {"type": "string"}}
_NUM = {"type": "number"}
_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}
# vLLM's field, on every generation request
CACHE_SALT = {"type": "string", "minLength": 1, "maxLength": 1024, "description": "vLLM extra: the prefix cache "
              "shares this request's blocks only with requests of the same salt (else cached_tokens and timing "
              "tell whether someone sent the same prefix). Use a secret, random value per tenant, e.g. 32 random "
              "bytes in base64; absent: the shared, unsalted cache."}

SCHEMAS: dict[str, Any] = {
    "TgiError": {"type": "object", "required": ["error", "error_type"], "properties": {
        "error": {"type": "string"},
        "error_type": {"type": "string", "enum": ["validation", "overloaded", "unavailable", "authentication",
                                                  "payload_too_large", "generation", "not_found",
                                                  "unsupported_media_type", "invalid_host", "timeout"]}}},
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
    "AnthropicError": {"type": "object", "properties": {"type": {"type": "string", "enum": ["error"]}, "error": {
        "type": "object", "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}},
    "OpenAIError": {"type": "object", "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": ["integer", "string", "null"]}}}}},
}
