"""The request and response schemas of /openapi.json (components.schemas), hand-written like the
paths in gateway.openapi: the wire formats are the clients' (TGI, OpenAI, vLLM), not our code's.

The OpenAI request schemas list every field the gateway honours; fields it knows but cannot honour
are named in descriptions (each is a 400 unless at its neutral value). Unknown fields are ignored
(listed in the x-baton-ignored-fields response header), or a 4xx with --strict-api.
"""

from __future__ import annotations

from typing import Any


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


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
    "TgiParameters": {
        "type": "object",
        "description": "TGI generation parameters. Fields TGI defines but this server does not implement "
                       "(typical_p, watermark, frequency_penalty, adapter_id) are accepted only at "
                       "their neutral value (else 422 naming the "
                       "field); unknown fields are ignored and listed in x-baton-ignored-fields (422 with "
                       "--strict-api).",
        "properties": {
            "max_new_tokens": {**_INT, "minimum": 1, "description": "Default 100 (capped by the room left)."},
            "do_sample": {**_BOOL, "default": False, "description": "As TGI: the request samples when do_sample "
                          "is true or any warper is set (temperature other than 1, top_p < 1, top_k); "
                          "otherwise it is greedy. temperature 0 is greedy."},
            "temperature": {**_NUM, "minimum": 0},
            "top_p": {**_NUM, "exclusiveMinimum": 0, "maximum": 1},
            "top_k": {**_INT, "minimum": 1},
            "repetition_penalty": {**_NUM, "exclusiveMinimum": 0},
            "seed": {**_INT, "minimum": 0},
            "grammar": {"type": "object", "required": ["type", "value"], "properties": {
                "type": {"type": "string", "enum": ["json", "regex", "json_schema"]}, "value": {}},
                "description": "Structured output: JSON of a schema (an object or JSON text), a regex, or "
                               "{\"name\", \"schema\"}. Invalid: 422 naming the field."},
            "stop": {**_STR_LIST, "maxItems": 16, "description": "Stop sequences; the text is cut before the match."},
            "truncate": {**_INT, "minimum": 1, "description": "Keep only the last N prompt tokens."},
            "details": {**_BOOL, "default": False},
            "return_full_text": {**_BOOL, "default": False},
            "decoder_input_details": {**_BOOL, "default": False, "description": "details.prefill: every prompt "
                                      "token with its logprob (the first null). Not when streaming."},
            "top_n_tokens": {**_INT, "minimum": 0, "maximum": 5, "description": "details.top_tokens and each "
                             "stream event's top_tokens: the N most likely tokens at each step."},
            "best_of": {**_INT, "minimum": 1, "maximum": 4, "description": "Sampled candidates (needs sampling, "
                        "not streamed); the one with the highest total logprob is answered, the others in "
                        "details.best_of_sequences."},
            "cache_salt": CACHE_SALT,
        },
    },
    "TgiRequest": {
        "type": "object", "required": ["inputs"],
        "description": "Unknown fields are ignored and listed in x-baton-ignored-fields (422 with --strict-api).",
        "properties": {"inputs": {"type": "string", "minLength": 1}, "parameters": _ref("TgiParameters"),
                       "stream": {**_BOOL, "description": "Only for POST /: stream (SSE) or not."},
                       "add_special_tokens": {**_BOOL, "default": True}},
    },
    "TgiToken": {"type": "object", "properties": {
        "id": _INT, "text": {"type": "string"}, "logprob": {"type": ["number", "null"]}, "special": _BOOL}},
    "TgiDetails": {"type": "object", "properties": {
        "finish_reason": {"type": "string", "enum": ["length", "eos_token", "stop_sequence"]},
        "generated_tokens": _INT, "seed": {"type": ["integer", "null"]}, "input_length": _INT,
        "prefill": {"type": "array", "items": _ref("TgiToken")},
        "tokens": {"type": "array", "items": _ref("TgiToken")}}},
    "TgiResponse": {"type": "object", "required": ["generated_text"], "properties": {
        "generated_text": {"type": "string"}, "details": _ref("TgiDetails")}},
    "TgiStreamEvent": {"type": "object", "description": "One SSE `data:` event per generated token.",
                       "properties": {"index": _INT, "token": _ref("TgiToken"),
                                      "generated_text": {"type": ["string", "null"],
                                                         "description": "Set on the last event only."},
                                      "details": {"oneOf": [_ref("TgiDetails"), {"type": "null"}],
                                                  "description": "Last event only, when details=true "
                                                                 "(no tokens/prefill lists)."}}},
    "TgiError": {"type": "object", "required": ["error", "error_type"], "properties": {
        "error": {"type": "string"},
        "error_type": {"type": "string", "enum": ["validation", "overloaded", "unavailable", "authentication",
                                                  "payload_too_large", "generation", "not_found",
                                                  "unsupported_media_type", "invalid_host", "timeout"]}}},
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
    # Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens)
    "MessagesBlock": {"type": "object", "required": ["type"], "description": "A content block: `text` {text}, "
                      "`tool_use` {id, name, input} (assistant), `tool_result` {tool_use_id, content (a string or "
                      "text blocks), is_error} (user); `thinking` blocks of earlier turns are dropped. Image and "
                      "document blocks are a 400 (a text-only model).", "properties": {
        "type": {"type": "string", "enum": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]},
        "text": {"type": "string"}, "id": {"type": "string"}, "name": {"type": "string"},
        "input": {"type": "object"}, "tool_use_id": {"type": "string"},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "is_error": _BOOL}},
    "MessagesCountTokensRequest": {"type": "object", "required": ["model", "messages"], "properties": {
        "model": {"type": "string", "description": "A served name (else 404 not_found_error)."},
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"], "properties": {
                "role": {"type": "string", "enum": ["user", "assistant"]},
                "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _ref("MessagesBlock")}]}}},
            "description": "Ends with a user message (continuing a final assistant message is a 400)."},
        "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"], "properties": {
                "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}]},
        "tools": {"type": "array", "maxItems": 128, "items": {
            "type": "object", "required": ["name", "input_schema"], "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_.\\-]{1,64}$"}, "description": {"type": "string"},
                "input_schema": {"type": "object"}}}},
        "tool_choice": {"type": "object", "required": ["type"], "description": "any: at least one call "
                        "(constrained output); tool: that one (`name`); auto: the template's tool-call format "
                        "is parsed; none: text.", "properties": {
            "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"},
            "disable_parallel_tool_use": _BOOL}},
        "thinking": {"type": "object", "required": ["type"], "description": "Maps to the chat template's "
                     "`enable_thinking` where the template takes it; budget_tokens is not enforced.", "properties": {
            "type": {"type": "string", "enum": ["enabled", "adaptive", "between_tools", "disabled"]},
            "budget_tokens": {**_INT, "minimum": 1}}},
        "output_config": {"type": "object", "properties": {"effort": {"type": "string"}, "format": {
            "type": "object", "required": ["type", "schema"], "description": "The answer follows the JSON schema "
            "(constrained decoding).", "properties": {"type": {"type": "string", "enum": ["json_schema"]},
                                                      "schema": {"type": "object"}}}}}}},
    "MessagesRequest": {"allOf": [_ref("MessagesCountTokensRequest"), {
        "type": "object", "required": ["max_tokens"], "description": "Unknown fields are ignored and listed in "
        "x-baton-ignored-fields (400 with --strict-api).", "properties": {
            "max_tokens": {**_INT, "minimum": 1}, "stream": _BOOL, "stop_sequences": {**_STR_LIST, "maxItems": 16},
            "temperature": {**_NUM, "minimum": 0, "maximum": 1}, "top_p": {**_NUM, "exclusiveMinimum": 0, "maximum": 1},
            "top_k": {**_INT, "minimum": 0}, "metadata": {"type": "object", "description": "Accepted, unused."},
            "cache_salt": CACHE_SALT}}]},
    "MessagesResponse": {"type": "object", "required": ["id", "type", "role", "model", "content", "stop_reason",
                                                        "usage"], "properties": {
        "id": {"type": "string"}, "type": {"type": "string", "enum": ["message"]},
        "role": {"type": "string", "enum": ["assistant"]}, "model": {"type": "string"},
        "content": {"type": "array", "items": _ref("MessagesBlock")},
        "stop_reason": {"type": "string", "enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
        "stop_sequence": {"type": ["string", "null"]},
        "usage": {"type": "object", "properties": {"input_tokens": _INT, "output_tokens": _INT}}}},
    "AnthropicError": {"type": "object", "properties": {"type": {"type": "string", "enum": ["error"]}, "error": {
        "type": "object", "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}},
    "OpenAIError": {"type": "object", "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": ["integer", "string", "null"]}}}}},
}
