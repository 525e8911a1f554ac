"""vLLM's tokenizer endpoints in /openapi.json: `POST /tokenize` and `/detokenize` (`tokenize_paths`)
and their schemas (`TOKENIZE_SCHEMAS`), in vLLM's shapes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.openapi_schemas import _BOOL, _INT, _ref, request_body

TOKENIZE_SCHEMAS: dict[str, Any] = {
    "TokenizeRequest": {"type": "object", "description": "vLLM's shape: `prompt` or `messages`.", "properties": {
        "model": {"type": "string"}, "prompt": {"type": "string"},
        "messages": {"type": "array", "minItems": 1, "maxItems": 1024, "items": _ref("ChatMessage")},
        "add_special_tokens": {**_BOOL, "description": "Default true for prompt, false for messages."},
        "add_generation_prompt": {**_BOOL, "default": True, "description": "messages only."},
        "return_token_strs": {**_BOOL, "default": False}}},
    "TokenizeResponse": {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
        "count": _INT, "max_model_len": {**_INT, "description": "max_total_tokens."},
        "tokens": {"type": "array", "items": _INT},
        "token_strs": {"type": ["array", "null"], "items": {"type": "string"}}}},
    "DetokenizeRequest": {"type": "object", "required": ["tokens"], "properties": {
        "model": {"type": "string"}, "tokens": {"type": "array", "items": {**_INT, "minimum": 0}}}},
    "DetokenizeResponse": {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
}


def tokenize_paths(op: Callable[..., dict[str, Any]], json_response: Callable[..., dict[str, Any]],
                   errors: dict[str, Any], ignored_header: dict[str, Any]) -> dict[str, Any]:
    """Its paths, given gateway.openapi's helpers (`errors`: the OpenAI-shaped error responses)."""
    return {
        "/tokenize": {"post": op("vLLM: a prompt's (or chat's) token ids, as generation would run them", {
            "200": {**json_response(_ref("TokenizeResponse"), "The token ids and their count."),
                    "headers": ignored_header},
            **errors}, request_body("TokenizeRequest"), True)},
        "/detokenize": {"post": op("vLLM: token ids back to text (special tokens kept)", {
            "200": {**json_response(_ref("DetokenizeResponse"), "The text."), "headers": ignored_header},
            **errors}, request_body("DetokenizeRequest"), True)},
    }
