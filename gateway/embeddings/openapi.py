"""The embeddings part of /openapi.json: OpenAI's `POST /v1/embeddings` and TEI's `POST /embed`
(`embeddings_paths`, given gateway.openapi's helpers) and their schemas (`EMBEDDINGS_SCHEMAS`),
hand-written like the rest: the wire formats are OpenAI's and TEI's. Bounds mirror
gateway.embeddings.validation (the fuzz tests generate bodies from these schemas)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.openapi_schemas import _ref
from gateway.embeddings.validation import MAX_INPUTS

_STR = {"type": "string", "minLength": 1}
_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": 100}}

EMBEDDINGS_SCHEMAS: dict[str, Any] = {
    "EmbeddingsRequest": {"type": "object", "required": ["input"], "description": "Each input is a prefill-only "
                          "job (admitted as one for their summed prompt tokens). Text is tokenized with the "
                          "tokenizer's special tokens. Unknown fields are ignored (x-baton-ignored-fields) or a "
                          "400 with --strict-api.", "properties": {
        "input": {"oneOf": [_STR, {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": _STR}, _IDS,
                            {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": _IDS}],
                  "description": f"A string, strings, token ids or lists of token ids (at most {MAX_INPUTS}, each "
                                 "non-empty and within max_input_tokens unless truncate_prompt_tokens)."},
        "model": {"type": "string", "description": "One of the served names (else 404)."},
        "encoding_format": {"type": "string", "enum": ["float", "base64"],
                            "description": "base64: the little-endian float32 bytes."},
        "dimensions": {"type": "integer", "minimum": 1, "description": "Cut the vector to this length, then "
                       "renormalize; more than the model's hidden size is a 400 naming it."},
        "user": {"type": "string", "description": "Accepted, unused."},
        "truncate_prompt_tokens": {"type": "integer", "minimum": 1, "description": "vLLM's: keep each input's "
                                   "last k tokens (at most max_input_tokens)."}}},
    "EmbeddingsResponse": {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
        "object": {"type": "string", "enum": ["list"]},
        "data": {"type": "array", "items": {"type": "object", "required": ["object", "index", "embedding"],
                                            "properties": {
            "object": {"type": "string", "enum": ["embedding"]}, "index": {"type": "integer"},
            "embedding": {"oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]}}}},
        "model": {"type": "string"},
        "usage": {"type": "object", "properties": {"prompt_tokens": {"type": "integer"},
                                                   "total_tokens": {"type": "integer"}}}}},
    "EmbedRequest": {"type": "object", "required": ["inputs"], "description": "TEI's shape.", "properties": {
        "inputs": {"oneOf": [_STR, {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": _STR}]},
        "normalize": {"type": "boolean", "description": "Default: the server's (--normalize / the checkpoint)."},
        "truncate": {"type": "boolean", "description": "Cut inputs longer than max_input_tokens (else a 422)."},
        "truncation_direction": {"type": "string", "enum": ["right", "left", "Right", "Left"],
                                 "description": "right (TEI's default) keeps the start, left the end."},
        "prompt_name": {"type": "null", "description": "Refused by name when given: no sentence-transformers "
                        "prompts are applied."}}},
}


def embeddings_paths(op: Callable[..., dict[str, Any]], json_response: Callable[..., dict[str, Any]],
                     openai_errors: dict[str, Any], tgi_errors: dict[str, Any],
                     ignored_header: dict[str, Any]) -> dict[str, Any]:
    def body(name: str) -> dict[str, Any]:
        return {"required": True, "content": {"application/json": {"schema": _ref(name)}}}

    vectors = {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}
    return {
        "/v1/embeddings": {"post": op("OpenAI embeddings: the prompt's final-norm hidden states pooled "
                                      "(--pooling last|mean|cls), normalized unless --no-normalize", {
            "200": {**json_response(_ref("EmbeddingsResponse"), "One embedding per input, by index."),
                    "headers": ignored_header}, **openai_errors}, body("EmbeddingsRequest"), True)},
        "/embed": {"post": op("TEI embed: one vector per input", {
            "200": {**json_response(vectors, "The vectors, in input order."), "headers": ignored_header},
            **tgi_errors}, body("EmbedRequest"), True)},
    }
