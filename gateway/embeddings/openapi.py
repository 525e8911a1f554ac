"""The embeddings part of /openapi.json: OpenAI's `POST /v1/embeddings` and TEI's `POST /embed`
(`embeddings_paths`, given gateway.openapi's helpers) and their schemas (`EMBEDDINGS_SCHEMAS`),
hand-written like the rest: the wire formats are OpenAI's and TEI's. The request bodies are
written from the tables the validator reads (gateway.embeddings.fields; the fuzz tests generate
bodies from these schemas)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.openapi_schemas import _ref
from gateway.embeddings.fields import OPENAI, TEI

EMBEDDINGS_SCHEMAS: dict[str, Any] = {
    "EmbeddingsRequest": OPENAI.schema(),
    "EmbeddingsResponse": {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
        "object": {"type": "string", "enum": ["list"]},
        "data": {"type": "array", "items": {"type": "object", "required": ["object", "index", "embedding"],
                                            "properties": {
            "object": {"type": "string", "enum": ["embedding"]}, "index": {"type": "integer"},
            "embedding": {"oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]}}}},
        "model": {"type": "string"},
        "usage": {"type": "object", "properties": {"prompt_tokens": {"type": "integer"},
                                                   "total_tokens": {"type": "integer"}}}}},
    "EmbedRequest": TEI.schema(),
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
