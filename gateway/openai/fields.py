"""OpenAI's request bodies as tables (gateway.request_fields): the fields completions and chat share
(`COMMON`, with vLLM's extras) and each endpoint's own (`COMPLETION_OWN`, `CHAT_OWN`). The validator
(gateway.openai.validation) reads every scalar, the known fields and the not-implemented fields'
neutral values from them; /openapi.json's `OpenAICommon`, `CompletionRequest` and `ChatRequest` are
written from them (gateway.openai.openapi)."""

from __future__ import annotations

from gateway.openapi_schemas import _BOOL, _INT, _NUM, _STR_LIST, CACHE_SALT, _ref
from gateway.request_fields import MAX_INT, Neutral, RequestFields, Scalar, Shaped
from gateway.validation import MAX_SEED, MIN_SEED
from baton.common.sampling_params import MAX_LOGPROBS

MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_CHOICES = 16  # n and best_of (each choice is a request's worth of work)
MAX_BATCH_PROMPTS = 64  # prompts in one completions request (each with n choices)
MAX_CONTENT_PARTS = 256  # text parts of one message's content: no real client sends more than a handful
MAX_TEMPLATE_KWARGS = 32
_UNSET = "Unset: the model's generation_config.json default (vLLM's rule), else "

COMMON = RequestFields({
    "model": Shaped({"type": "string", "description": "One of the served names (GET /v1/models; default: the "
                     "first); any other is a 404 (type NotFoundError, param model). huggingface_hub's "
                     "placeholders `tgi` and `dummy` mean the first."}),
    "max_tokens": Scalar("integer", minimum=1),
    "max_completion_tokens": Scalar("integer", minimum=1, description="Wins over max_tokens."),
    "stream": Scalar("boolean", default=False),
    "stream_options": Shaped({"type": "object", "properties": {
        "include_usage": _BOOL,
        "continuous_usage_stats": {**_BOOL, "description": "With include_usage: every chunk carries the usage "
                                   "so far (vLLM)."}}}),
    "stop": Shaped({"oneOf": [{"type": "string"}, {**_STR_LIST, "maxItems": 16}]}),
    "temperature": Scalar("number", minimum=0.0, maximum=2.0, description=_UNSET + "1. 0: greedy."),
    "top_p": Scalar("number", exclusive_minimum=0.0, maximum=1.0, description=_UNSET + "1."),
    "seed": Scalar("integer", minimum=MIN_SEED, maximum=MAX_SEED),
    "n": Scalar("integer", minimum=1, maximum=MAX_CHOICES, default=1, description="Choices per prompt; choice j "
                "samples with seed + j."),
    "prompt_logprobs": Scalar("integer", minimum=0, maximum=MAX_LOGPROBS, description="vLLM extra: "
                              "choices[].prompt_logprobs, the prompt tokens' logprobs and top k."),
    "presence_penalty": Scalar("number", minimum=-2.0, maximum=2.0, default=0,
                               description="Subtracted from the logit of every token already generated."),
    "frequency_penalty": Scalar("number", minimum=-2.0, maximum=2.0, default=0,
                                description="Subtracted once per occurrence in the generated tokens."),
    "logit_bias": Shaped({"type": "object", "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": "^[0-9]+$"},
                          "additionalProperties": {**_NUM, "minimum": -100, "maximum": 100},
                          "description": "Token id (as a string, within the vocabulary) -> bias added to its "
                                         "logit."}),
    "top_k": Scalar("integer", minimum=-1, maximum=MAX_INT, description="vLLM extra; -1 or 0: off. " + _UNSET
                    + "off."),
    "min_p": Scalar("number", minimum=0.0, maximum=1.0, description="vLLM extra: drop tokens below min_p times "
                    "the top token's probability. " + _UNSET + "0."),
    "repetition_penalty": Scalar("number", exclusive_minimum=0.0, maximum=100.0, description="vLLM extra. "
                                 + _UNSET + "1."),
    "ignore_eos": Scalar("boolean", default=False, description="vLLM extra."),
    "min_tokens": Scalar("integer", minimum=0, maximum=MAX_INT, description="vLLM extra: no EOS, stop token or "
                         "stop string before this many tokens (at most max_tokens)."),
    "response_format": Shaped({"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                                         "strict": _BOOL}}},
        "description": "Structured output (llguidance): any JSON object, or JSON of the schema. An invalid schema "
                       "is a 400 naming the field."}),
    "guided_json": Shaped({"type": ["object", "string"], "description": "vLLM extra: output JSON of this schema."}),
    "guided_regex": Shaped({"type": "string", "description": "vLLM extra: output matching this regex."}),
    "guided_choice": Shaped({**_STR_LIST, "minItems": 1, "description": "vLLM extra: output exactly one of these."}),
    "guided_grammar": Shaped({"type": "string", "description": "vLLM extra: a Lark or GBNF grammar."}),
    "structured_outputs": Shaped({"type": "object", "description": "vLLM extra: one of json, regex, choice, "
                                  "grammar, json_object.", "properties": {
                                      "json": {"type": ["object", "string"]}, "regex": {"type": "string"},
                                      "choice": _STR_LIST, "grammar": {"type": "string"}, "json_object": _BOOL}}),
    "stop_token_ids": Shaped({"type": "array", "items": {**_INT, "minimum": 0}, "maxItems": 128}),
    "cache_salt": Shaped(CACHE_SALT),
    "user": Shaped({"type": "string"}),
    "use_beam_search": Neutral((False,), _BOOL),
}, description="Unknown fields are ignored and listed in x-baton-ignored-fields (400 with --strict-api).")

COMPLETION_OWN = RequestFields({
    "prompt": Shaped({"oneOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": _INT, "minItems": 1},
                                {"type": "array", "minItems": 1, "maxItems": MAX_BATCH_PROMPTS, "items": {"oneOf": [
                                    {"type": "string", "minLength": 1},
                                    {"type": "array", "items": _INT, "minItems": 1}]}}],
                      "description": "Default max_tokens 16."}),
    "echo": Scalar("boolean", default=False, description="The prompt before the output (with logprobs: its "
                   "tokens' logprobs too, the first null)."),
    "logprobs": Scalar("integer", minimum=0, maximum=MAX_LOGPROBS, description="Each token's logprob and the top "
                       "N (tokens, token_logprobs, top_logprobs, text_offset)."),
    "best_of": Scalar("integer", minimum=1, maximum=MAX_CHOICES, description="Candidates per prompt (>= n); the n "
                      "with the highest total logprob are answered. Not with stream."),
    "add_special_tokens": Scalar("boolean", default=True, description="vLLM extra, for a text prompt."),
    "suffix": Neutral(("",), {"type": "string"}),
}, required=("prompt",))

CHAT_OWN = RequestFields({
    "messages": Shaped({"type": "array", "minItems": 1, "items": _ref("ChatMessage"),
                        "description": "Rendered with the model's chat template (add_generation_prompt). Default "
                                       "max_tokens: the room left, at most 1024. At most --max-chat-messages."}),
    "logprobs": Scalar("boolean", default=False, description="choices[].logprobs.content: each token's logprob."),
    "top_logprobs": Scalar("integer", minimum=0, maximum=MAX_LOGPROBS, description="With logprobs: the N most "
                           "likely tokens at each position."),
    "tools": Shaped({"type": "array", "maxItems": 128, "items": {"type": "object", "properties": {
        "type": {"type": "string", "enum": ["function"]}, "function": {"type": "object", "required": ["name"],
            "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                           "parameters": {"type": "object"}, "strict": _BOOL}}}},
        "description": "Given to the chat template (see gateway/tools.py)."}),
    "tool_choice": Shaped({"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {
        "type": "object", "properties": {
            "type": {"type": "string", "enum": ["function"]},
            "function": {"type": "object", "properties": {"name": {"type": "string"}}}}}],
        "description": "required / a named function: the output is constrained to the arguments' schema and "
                       "answered as message.tool_calls."}),
    "parallel_tool_calls": Scalar("boolean", default=True),
    "chat_template_kwargs": Shaped({"type": "object", "maxProperties": MAX_TEMPLATE_KWARGS, "description": "vLLM's: "
                                    "extra variables for the chat template, e.g. {\"enable_thinking\": false} "
                                    "(which also turns --reasoning-parser off for the request)."}),
    "store": Shaped({"description": "Accepted, unused."}),
    "metadata": Shaped({"description": "Accepted, unused."}),
    "service_tier": Shaped({"description": "Accepted, unused."}),
    "functions": Neutral(([],), {"type": "array"}),
    "function_call": Neutral(("none", "auto"), {}),
    "echo": Neutral((False,), _BOOL),
}, required=("messages",))

COMPLETION = COMMON | COMPLETION_OWN
CHAT = COMMON | CHAT_OWN
