"""OpenAI's part of /openapi.json: `POST /v1/completions` and `/v1/chat/completions` (`openai_paths`)
and their schemas (`OPENAI_SCHEMAS`), hand-written: the wire format is OpenAI's (and vLLM's extras).

The request schemas list every field the gateway honours; fields it knows but cannot honour are
named in descriptions (each is a 400 unless at its neutral value). Unknown fields are ignored
(listed in the x-baton-ignored-fields response header), or a 4xx with --strict-api.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.openapi_schemas import _BOOL, _INT, _NUM, _STR_LIST, CACHE_SALT, _ref, request_body

OPENAI_SCHEMAS: dict[str, Any] = {
    "OpenAICommon": {"type": "object", "properties": {
        "model": {"type": "string", "description": "One of the served names (GET /v1/models; default: the "
                  "first); any other is a 404 (type NotFoundError, param model). huggingface_hub's "
                  "placeholders `tgi` and `dummy` mean the first."},
        "max_tokens": {**_INT, "minimum": 1}, "max_completion_tokens": {**_INT, "minimum": 1},
        "stream": _BOOL,
        "stream_options": {"type": "object", "properties": {
            "include_usage": _BOOL,
            "continuous_usage_stats": {**_BOOL, "description": "With include_usage: every chunk carries the "
                                       "usage so far (vLLM)."}}},
        "stop": {"oneOf": [{"type": "string"}, {**_STR_LIST, "maxItems": 16}]},
        "temperature": {**_NUM, "minimum": 0, "maximum": 2, "default": 1, "description": "0: greedy."},
        "top_p": {**_NUM, "exclusiveMinimum": 0, "maximum": 1}, "seed": _INT,
        "n": {**_INT, "minimum": 1, "maximum": 16, "default": 1, "description": "Choices per prompt; choice j "
              "samples with seed + j."},
        "prompt_logprobs": {**_INT, "minimum": 0, "maximum": 20, "description": "vLLM extra: "
                            "choices[].prompt_logprobs, the prompt tokens' logprobs and top k."},
        "presence_penalty": {**_NUM, "minimum": -2, "maximum": 2, "default": 0,
                             "description": "Subtracted from the logit of every token already generated."},
        "frequency_penalty": {**_NUM, "minimum": -2, "maximum": 2, "default": 0,
                              "description": "Subtracted once per occurrence in the generated tokens."},
        "logit_bias": {"type": "object", "maxProperties": 300, "propertyNames": {"pattern": "^[0-9]+$"},
                       "additionalProperties": {**_NUM, "minimum": -100, "maximum": 100},
                       "description": "Token id (as a string, within the vocabulary) -> bias added to its logit."},
        "top_k": {**_INT, "minimum": -1, "description": "vLLM extra; -1 or 0: off."},
        "min_p": {**_NUM, "minimum": 0, "maximum": 1, "default": 0,
                  "description": "vLLM extra: drop tokens below min_p times the top token's probability."},
        "repetition_penalty": {**_NUM, "exclusiveMinimum": 0, "maximum": 100}, "ignore_eos": _BOOL,
        "min_tokens": {**_INT, "minimum": 0, "description": "vLLM extra: no EOS, stop token or stop string "
                       "before this many tokens (at most max_tokens)."},
        "response_format": {"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                                             "strict": _BOOL}}},
            "description": "Structured output (llguidance): any JSON object, or JSON of the schema. An invalid "
                           "schema is a 400 naming the field."},
        "guided_json": {"type": ["object", "string"], "description": "vLLM extra: output JSON of this schema."},
        "guided_regex": {"type": "string", "description": "vLLM extra: output matching this regex."},
        "guided_choice": {**_STR_LIST, "minItems": 1, "description": "vLLM extra: output exactly one of these."},
        "guided_grammar": {"type": "string", "description": "vLLM extra: a Lark or GBNF grammar."},
        "structured_outputs": {"type": "object", "description": "vLLM extra: one of json, regex, choice, grammar, "
                               "json_object.", "properties": {
                                   "json": {"type": ["object", "string"]}, "regex": {"type": "string"},
                                   "choice": _STR_LIST, "grammar": {"type": "string"}, "json_object": _BOOL}},
        "stop_token_ids": {"type": "array", "items": {**_INT, "minimum": 0}, "maxItems": 128},
        "cache_salt": CACHE_SALT, "user": {"type": "string"}}},
    "CompletionRequest": {"allOf": [_ref("OpenAICommon"), {"type": "object", "required": ["prompt"], "properties": {
        "prompt": {"oneOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": _INT, "minItems": 1},
                             {"type": "array", "minItems": 1, "maxItems": 64, "items": {"oneOf": [
                                 {"type": "string", "minLength": 1},
                                 {"type": "array", "items": _INT, "minItems": 1}]}}],
                   "description": "Default max_tokens 16."},
        "echo": {**_BOOL, "default": False, "description": "The prompt before the output (with logprobs: "
                 "its tokens' logprobs too, the first null)."},
        "logprobs": {**_INT, "minimum": 0, "maximum": 20, "description": "Each token's logprob and the top N "
                     "(tokens, token_logprobs, top_logprobs, text_offset)."},
        "best_of": {**_INT, "minimum": 1, "maximum": 16, "description": "Candidates per prompt (>= n); the n "
                    "with the highest total logprob are answered. Not with stream."},
        "add_special_tokens": {**_BOOL, "default": True, "description": "vLLM extra, for a text prompt."}}}]},
    "ChatMessage": {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "tool_calls": {"type": "array", "items": _ref("ToolCall"), "description": "Passed to the chat template."},
        "tool_call_id": {"type": "string"}, "name": {"type": "string"},
        "content": {"oneOf": [{"type": "null"}, {"type": "string"}, {"type": "array", "maxItems": 256, "items": {
            "type": "object", "properties": {
                "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}]}}},
    "ChatRequest": {"allOf": [_ref("OpenAICommon"), {"type": "object", "required": ["messages"], "properties": {
        "messages": {"type": "array", "minItems": 1, "maxItems": 1024, "items": _ref("ChatMessage"),
                     "description": "Rendered with the model's chat template (add_generation_prompt). "
                                    "Default max_tokens: the room left, at most 1024."},
        "logprobs": {**_BOOL, "default": False, "description": "choices[].logprobs.content: each token's logprob."},
        "top_logprobs": {**_INT, "minimum": 0, "maximum": 20, "description": "With logprobs: the N most likely "
                         "tokens at each position."},
        "tools": {"type": "array", "maxItems": 128, "items": {"type": "object", "properties": {
            "type": {"type": "string", "enum": ["function"]}, "function": {"type": "object", "required": ["name"],
                "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                               "parameters": {"type": "object"}, "strict": _BOOL}}}},
                  "description": "Given to the chat template (see gateway/tools.py)."},
        "tool_choice": {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {
            "type": "object", "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {"type": "object", "properties": {"name": {"type": "string"}}}}}],
                        "description": "required / a named function: the output is constrained to the arguments' "
                                       "schema and answered as message.tool_calls."},
        "parallel_tool_calls": {**_BOOL, "default": True},
        "chat_template_kwargs": {"type": "object", "maxProperties": 32, "description": "vLLM's: extra variables "
                                 "for the chat template, e.g. {\"enable_thinking\": false} (which also turns "
                                 "--reasoning-parser off for the request)."}}}]},
    "ToolCall": {"type": "object", "properties": {
        "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}},
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
                "role": {"type": "string"}, "content": {"type": ["string", "null"]},
                "tool_calls": {"type": "array", "items": _ref("ToolCall")},
                "reasoning_content": {"type": "string", "description": "With --reasoning-parser: the think "
                                      "block's text (absent when there was none)."},
                "reasoning": {"type": "string", "description": "The same text as reasoning_content, under "
                              "the name current vLLM uses."}}},
            "finish_reason": {"type": "string", "enum": ["stop", "length", "tool_calls"]}}}}}},
}


def openai_paths(op: Callable[..., dict[str, Any]], errors: dict[str, Any],
                 ignored_header: dict[str, Any]) -> dict[str, Any]:
    """Its paths, given gateway.openapi's helpers (`errors`: the OpenAI-shaped error responses)."""
    stream_doc = ("SSE when stream=true: `data: {chunk}` events, then `data: [DONE]`; "
                  "with stream_options.include_usage a last chunk has `choices: []` and usage.")

    return {
        "/v1/completions": {"post": op("OpenAI completions", {
            "200": {"description": "A completion, or " + stream_doc, "headers": ignored_header, "content": {
                "application/json": {"schema": _ref("CompletionResponse")},
                "text/event-stream": {"schema": {"type": "string"}}}}, **errors},
            request_body("CompletionRequest"), True)},
        "/v1/chat/completions": {"post": op("OpenAI chat completions", {
            "200": {"description": "A chat completion, or " + stream_doc, "headers": ignored_header,
                    "content": {
                "application/json": {"schema": _ref("ChatResponse")},
                "text/event-stream": {"schema": {"type": "string"}}}}, **errors},
            request_body("ChatRequest"), True)},
    }
