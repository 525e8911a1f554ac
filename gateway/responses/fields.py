"""The Responses API's request body as a table (gateway.request_fields): `REQUEST`. The validator
(gateway.responses.validation) takes the known fields, the not-implemented fields' neutral values and
every scalar's bounds from it; /openapi.json's `ResponsesRequest` is written from it
(gateway.responses.openapi)."""

from __future__ import annotations

from gateway.openapi_schemas import _BOOL, _INT, CACHE_SALT, _ref
from gateway.request_fields import Neutral, RequestFields, Scalar, Shaped

_STR = {"type": "string"}
_NULLABLE_STR = {"type": ["string", "null"]}
_UNUSED = "Accepted without effect."

REQUEST = RequestFields({
    "model": Shaped({**_STR, "description": "A served name (else 404); the openai SDK requires it."}),
    "input": Shaped({"oneOf": [{**_STR, "description": "One user message."},
                               {"type": "array", "minItems": 1, "items": _ref("ResponsesInputItem")}]}),
    "instructions": Shaped({**_NULLABLE_STR, "description": "The first (system) message; not carried over by "
                            "previous_response_id (OpenAI's rule)."}),
    "tools": Shaped({"type": "array", "items": _ref("ResponsesTool")}),
    "tool_choice": Shaped({"oneOf": [{"type": "string", "enum": ["auto", "none", "required"]},
                                     {"type": "object", "required": ["type", "name"], "properties": {
                                         "type": {"type": "string", "enum": ["function"]}, "name": _STR}}]}),
    "parallel_tool_calls": Scalar("boolean", default=True),
    "text": Shaped({"type": "object", "properties": {"format": {"type": "object", "description": "{type: text} | "
                    "{type: json_object} | {type: json_schema, name, schema, strict}: through the structured-output "
                    "engine, as chat's response_format.", "properties": {
                        "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
                        "name": _STR, "schema": {"type": "object"}, "strict": {"type": ["boolean", "null"]}}},
                    "verbosity": {**_NULLABLE_STR, "description": _UNUSED}}}),
    # no maximum here: chat checks it against the context once the prompt is tokenized
    "max_output_tokens": Scalar("integer", minimum=1, description="Reached: status `incomplete`, "
                                "incomplete_details.reason `max_output_tokens`."),
    "temperature": Scalar("number", minimum=0.0, maximum=2.0),
    "top_p": Scalar("number", exclusive_minimum=0.0, maximum=1.0),
    "stream": Scalar("boolean", default=False),
    "store": Scalar("boolean", default=True, description="Keep the response (and its conversation) for "
                    "--responses-ttl seconds (0: nothing is kept, and the response says store: false), within "
                    "--responses-max-bytes for all (past it the oldest are dropped; one larger than all of it is "
                    "answered with store: false)."),
    "previous_response_id": Shaped({**_NULLABLE_STR, "description": "Continue a stored response's conversation: "
                                    "404 if unknown or expired, 400 when storing is disabled."}),
    "metadata": Shaped({"type": "object", "additionalProperties": _STR, "maxProperties": 16}),
    "user": Shaped(_STR),
    "cache_salt": Shaped(CACHE_SALT),
    "reasoning": Shaped({"type": "object", "properties": {"effort": _NULLABLE_STR, "summary": _NULLABLE_STR},
                         "description": _UNUSED + " Repeated in the response."}),
    "include": Shaped({"type": "array", "items": _STR, "description": _UNUSED}),
    "prompt_cache_key": Shaped({**_STR, "description": _UNUSED}),
    "safety_identifier": Shaped({**_STR, "description": _UNUSED}),
    "stream_options": Shaped({"type": "object", "description": _UNUSED}),
    # OpenAI's, not implemented here: accepted at the value that means "off"
    "truncation": Neutral(("disabled",), {"type": "string", "enum": ["disabled"]}),
    "background": Neutral((False,), _BOOL),
    "service_tier": Neutral(("auto", "default"), {"type": "string", "enum": ["auto", "default"]}),
    "top_logprobs": Neutral((0,), _INT),
    "max_tool_calls": Neutral((), _INT),
    "conversation": Neutral((), {"oneOf": [_STR, {"type": "object"}]}),
    "prompt": Neutral((), {"type": "object"}),
}, required=("input",), description="Served by the chat pipeline (the same admission, budget, structured output "
   "and tool parsing as /v1/chat/completions). Accepted without effect: `reasoning` ({effort, summary}), "
   "`include`, `prompt_cache_key`, `safety_identifier`, `text.verbosity`, `stream_options`. Only at their "
   "neutral value (else a 400 naming them): `truncation` (\"disabled\"), `background` (false), `service_tier` "
   "(auto, default), `top_logprobs` (0), `max_tool_calls`, `conversation`, `prompt` (null). Unknown fields are "
   "ignored (x-baton-ignored-fields) or a 400 with --strict-api.")
