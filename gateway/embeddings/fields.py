"""The embedding request bodies as tables (gateway.request_fields): OpenAI's `POST /v1/embeddings`
(`OPENAI`) and TEI's `POST /embed` (`TEI`). The validator (gateway.embeddings.validation) takes the
known fields and every scalar's bounds from them; /openapi.json's `EmbeddingsRequest` and
`EmbedRequest` are written from them (gateway.embeddings.openapi)."""

from __future__ import annotations

from gateway.request_fields import RequestFields, Scalar, Shaped

MAX_INPUTS = 2048  # OpenAI's own cap on inputs per request

_STR = {"type": "string", "minLength": 1}
# token ids: the real bound is the vocabulary (checked at run time); 100 keeps generated bodies valid
_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": 100}}

OPENAI = RequestFields({
    "input": Shaped({"oneOf": [_STR, {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": _STR}, _IDS,
                               {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": _IDS}],
                     "description": f"A string, strings, token ids or lists of token ids (at most {MAX_INPUTS}, "
                                    "each non-empty and within max_input_tokens unless truncate_prompt_tokens)."}),
    "model": Shaped({"type": "string", "description": "One of the served names (else 404)."}),
    "encoding_format": Shaped({"type": "string", "enum": ["float", "base64"],
                               "description": "base64: the little-endian float32 bytes."}),
    # no maximum here: the model's hidden size, checked at run time with its own message
    "dimensions": Scalar("integer", minimum=1, description="Cut the vector to this length, then renormalize; "
                         "more than the model's hidden size is a 400 naming it."),
    "user": Shaped({"type": "string", "description": "Accepted, unused."}),
    # its maximum is the setting max_input_tokens: read(f, name, maximum=settings.max_input_tokens)
    "truncate_prompt_tokens": Scalar("integer", minimum=1, description="vLLM's: keep each input's last k tokens "
                                     "(at most max_input_tokens)."),
}, required=("input",), description="Each input is a prefill-only job (admitted as one for their summed prompt "
   "tokens). Text is tokenized with the tokenizer's special tokens. Unknown fields are ignored "
   "(x-baton-ignored-fields) or a 400 with --strict-api.")

TEI = RequestFields({
    "inputs": Shaped({"oneOf": [_STR, {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": _STR}]}),
    # no default: absent means the server's choice, which `read` cannot answer (the validator asks first)
    "normalize": Scalar("boolean", description="Default: the server's (--normalize / the checkpoint)."),
    "truncate": Scalar("boolean", default=False, description="Cut inputs longer than max_input_tokens (else a "
                       "422)."),
    "truncation_direction": Shaped({"type": "string", "enum": ["right", "left", "Right", "Left"],
                                    "description": "right (TEI's default) keeps the start, left the end."}),
    # TEI's, not implemented here; refused with its own message (why), not check_neutral's
    "prompt_name": Shaped({"type": "null", "description": "Refused by name when given: no sentence-transformers "
                           "prompts are applied."}),
}, required=("inputs",), description="TEI's shape.")
