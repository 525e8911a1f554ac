"""TGI's request body as tables (gateway.request_fields): the top level (`REQUEST`) and the
`parameters` object (`PARAMETERS`). The validator (gateway.tgi.validation) takes the known fields,
the neutral values and every scalar's bounds from them; /openapi.json's `TgiRequest` and
`TgiParameters` schemas are written from the same entries (gateway.tgi.openapi)."""

from __future__ import annotations

from gateway.openapi_schemas import _BOOL, _ref, _STR_LIST, CACHE_SALT
from gateway.request_fields import MAX_INT, Neutral, RequestFields, Scalar, Shaped
from gateway.validation import MAX_SEED

DEFAULT_MAX_NEW_TOKENS = 100
MAX_TOP_N_TOKENS = 5  # TGI's default --max-top-n-tokens
MAX_BEST_OF = 4  # TGI's default --max-best-of

PARAMETERS = RequestFields({
    "max_new_tokens": Scalar("integer", minimum=1, description=f"Default {DEFAULT_MAX_NEW_TOKENS} (capped by "
                             "the room left)."),
    "do_sample": Scalar("boolean", default=False, description="As TGI: the request samples when do_sample is "
                        "true or any warper is set (temperature other than 1, top_p < 1, top_k); otherwise it "
                        "is greedy. temperature 0 is greedy."),
    "temperature": Scalar("number", minimum=0.0, maximum=100.0),
    "top_p": Scalar("number", exclusive_minimum=0.0, maximum=1.0),
    "top_k": Scalar("integer", minimum=1, maximum=MAX_INT),
    "repetition_penalty": Scalar("number", exclusive_minimum=0.0, maximum=100.0),
    "seed": Scalar("integer", minimum=0, maximum=MAX_SEED),
    "truncate": Scalar("integer", minimum=1, maximum=MAX_INT, description="Keep only the last N prompt tokens."),
    "details": Scalar("boolean", default=False),
    "return_full_text": Scalar("boolean", default=False),
    "decoder_input_details": Scalar("boolean", default=False, description="details.prefill: every prompt token "
                                    "with its logprob (the first null). Not when streaming."),
    "top_n_tokens": Scalar("integer", minimum=0, maximum=MAX_TOP_N_TOKENS, description="details.top_tokens and "
                           "each stream event's top_tokens: the N most likely tokens at each step."),
    "best_of": Scalar("integer", minimum=1, maximum=MAX_BEST_OF, description="Sampled candidates (needs "
                      "sampling, not streamed); the one with the highest total logprob is answered, the others "
                      "in details.best_of_sequences."),
    "grammar": Shaped({"type": "object", "required": ["type", "value"], "properties": {
        "type": {"type": "string", "enum": ["json", "regex", "json_schema"]}, "value": {}},
        "description": "Structured output: JSON of a schema (an object or JSON text), a regex, or "
                       "{\"name\", \"schema\"}. Invalid: 422 naming the field."}),
    "stop": Shaped({**_STR_LIST, "maxItems": 16, "description": "Stop sequences; the text is cut before the "
                    "match."}),
    # vLLM's, not TGI's: the prefix cache shares this request's blocks only under its salt
    "cache_salt": Shaped(CACHE_SALT),
    # TGI's, not implemented here: accepted at the value that means "off"
    "adapter_id": Neutral((), {"type": "string"}),
    "frequency_penalty": Neutral((0,), {"type": "number"}),
    "typical_p": Neutral((1,), {"type": "number"}),
    "watermark": Neutral((False,), _BOOL),
}, description="TGI generation parameters. Unknown fields are ignored and listed in x-baton-ignored-fields "
               "(422 with --strict-api).")

REQUEST = RequestFields({
    "inputs": Shaped({"type": "string", "minLength": 1}),
    "parameters": Shaped(_ref("TgiParameters")),
    "stream": Scalar("boolean", default=False, description="Only for POST /: stream (SSE) or not."),
    "add_special_tokens": Scalar("boolean", default=True),
}, required=("inputs",), description="Unknown fields are ignored and listed in x-baton-ignored-fields (422 with "
                                     "--strict-api).")
