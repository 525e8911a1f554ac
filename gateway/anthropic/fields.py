"""Anthropic's Messages request bodies as tables (gateway.request_fields): what count_tokens takes
(`COUNT_TOKENS`) and what /v1/messages adds (`MESSAGES_OWN`). The validator
(gateway.anthropic.validation) reads the known fields and every scalar from them; /openapi.json's
`MessagesCountTokensRequest` and `MessagesRequest` are written from them (gateway.anthropic.openapi)."""

from __future__ import annotations

from gateway.openapi_schemas import _BOOL, _INT, _STR_LIST, CACHE_SALT, _ref
from gateway.request_fields import MAX_INT, RequestFields, Scalar, Shaped

_UNUSED = {"description": "Accepted, unused (the KV store reuses prefixes by itself)."}

COUNT_TOKENS = RequestFields({
    "model": Shaped({"type": "string", "description": "A served name (else 404 not_found_error)."}),
    "messages": Shaped({"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role", "content"], "properties": {
            "role": {"type": "string", "enum": ["user", "assistant"]},
            "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _ref("MessagesBlock")}]}}},
        "description": "Ends with a user message (continuing a final assistant message is a 400)."}),
    "system": Shaped({"oneOf": [{"type": "string"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"], "properties": {
            "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}]}),
    "tools": Shaped({"type": "array", "maxItems": 128, "items": {
        "type": "object", "required": ["name", "input_schema"], "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_.\\-]{1,64}$"}, "description": {"type": "string"},
            "input_schema": {"type": "object"}}}}),
    "tool_choice": Shaped({"type": "object", "required": ["type"], "description": "any: at least one call "
                           "(constrained output); tool: that one (`name`); auto: the template's tool-call format "
                           "is parsed; none: text.", "properties": {
                               "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]},
                               "name": {"type": "string"}, "disable_parallel_tool_use": _BOOL}}),
    "thinking": Shaped({"type": "object", "required": ["type"], "description": "Maps to the chat template's "
                        "`enable_thinking` where the template takes it; budget_tokens is not enforced.",
                        "properties": {
                            "type": {"type": "string", "enum": ["enabled", "adaptive", "between_tools", "disabled"]},
                            "budget_tokens": {**_INT, "minimum": 1}}}),
    "output_config": Shaped({"type": "object", "properties": {"effort": {"type": "string"}, "format": {
        "type": "object", "required": ["type", "schema"], "description": "The answer follows the JSON schema "
        "(constrained decoding).", "properties": {"type": {"type": "string", "enum": ["json_schema"]},
                                                  "schema": {"type": "object"}}}}}),
    "cache_control": Shaped({"type": "object", **_UNUSED}),
}, required=("model", "messages"))

MESSAGES_OWN = RequestFields({
    "max_tokens": Scalar("integer", minimum=1),
    "stream": Scalar("boolean", default=False),
    "stop_sequences": Shaped({**_STR_LIST, "maxItems": 16}),
    "temperature": Scalar("number", minimum=0.0, maximum=1.0, description="Anthropic's range. Unset: the model's "
                          "generation_config.json default, else 1."),
    "top_p": Scalar("number", exclusive_minimum=0.0, maximum=1.0),
    "top_k": Scalar("integer", minimum=0, maximum=MAX_INT),
    "metadata": Shaped({"type": "object", "description": "Accepted, unused."}),
    "cache_salt": Shaped(CACHE_SALT),
}, required=("max_tokens",), description="Unknown fields are ignored and listed in x-baton-ignored-fields (400 "
                                         "with --strict-api).")

MESSAGES = COUNT_TOKENS | MESSAGES_OWN
