"""OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) -> GenerationSpec.

OpenAI semantics: temperature defaults to 1.0 (sampling) and 0 means greedy; `n` must be 1;
`max_tokens` defaults to 16 for completions and to the room left (capped at 1024) for chat;
`max_completion_tokens` (what aiperf sends) wins over `max_tokens`. A few vLLM extras that map
onto our sampling options are accepted (`top_k`, `repetition_penalty`, `ignore_eos`,
`stop_token_ids`). Known OpenAI fields we cannot honour are accepted only at their neutral value.
"""

from __future__ import annotations

import math

from typing import Any

from gateway.config import Settings
from gateway.errors import validation_error
from gateway.validation import MAX_SEED, MIN_SEED, Fields, GenerationSpec

STATUS = 400  # OpenAI answers invalid requests with 400 invalid_request_error
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = 1024
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}
# Text parts of one message's content: no real client sends more than a handful.
MAX_CONTENT_PARTS = 256

COMMON_FIELDS = {
    "model", "max_tokens", "max_completion_tokens", "stream", "stream_options", "stop",
    "temperature", "top_p", "seed", "n", "presence_penalty", "frequency_penalty", "logit_bias",
    "user", "logprobs",
    # vLLM extras
    "top_k", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "top_logprobs", "response_format", "tools", "tool_choice", "parallel_tool_calls",
    "store", "metadata", "service_tier",
}
COMMON_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
}
COMPLETION_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": (False,),
    "suffix": ("",),
    "best_of": (1,),
    "logprobs": (0, False),
}
CHAT_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logprobs": (False,),
    "top_logprobs": (0,),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
}


def parse_completion(body: dict[str, Any], settings: Settings, vocab_size: int) -> GenerationSpec:
    f = Fields(body, STATUS)
    f.reject_unknown(COMPLETION_FIELDS, "the request")
    for key, neutral in COMPLETION_NEUTRAL.items():
        f.unsupported_unless(key, neutral)
    spec = _common(f, settings, vocab_size, COMPLETIONS_DEFAULT_MAX_TOKENS)
    spec.prompt = _prompt(body.get("prompt"), vocab_size, settings.max_input_tokens)
    return spec


def parse_chat(body: dict[str, Any], settings: Settings, vocab_size: int) -> GenerationSpec:
    f = Fields(body, STATUS)
    f.reject_unknown(CHAT_FIELDS, "the request")
    for key, neutral in CHAT_NEUTRAL.items():
        f.unsupported_unless(key, neutral)
    spec = _common(f, settings, vocab_size, CHAT_DEFAULT_MAX_TOKENS)
    spec.messages = _messages(body.get("messages"), settings.max_chat_messages)
    return spec


def _common(f: Fields, settings: Settings, vocab_size: int, default_max: int) -> GenerationSpec:
    for key, neutral in COMMON_NEUTRAL.items():
        f.unsupported_unless(key, neutral)
    f.string("user")
    model = f.string("model")
    n = f.integer("n")
    if n is not None and n != 1:
        raise f.fail("n", f"must be 1 (got {n}); send one request per completion")
    stream = f.boolean("stream", False)
    include_usage = False
    options = f.get("stream_options")
    if options is not None:
        if not stream:
            raise f.fail("stream_options", "is only allowed when `stream` is true")
        if not isinstance(options, dict):
            raise f.fail("stream_options", "must be an object")
        so = Fields(options, STATUS, prefix="stream_options.")
        so.reject_unknown({"include_usage", "continuous_usage_stats"}, "`stream_options`")
        include_usage = so.boolean("include_usage", False)
        so.boolean("continuous_usage_stats", False)  # accepted; usage comes once, at the end

    max_tokens = f.integer("max_tokens", lo=1, hi=math.inf)  # checked against max_total_tokens below
    max_completion_tokens = f.integer("max_completion_tokens", lo=1, hi=math.inf)
    temperature = f.number("temperature", ge=0.0, le=2.0)
    top_p = f.number("top_p", gt=0.0, le=1.0)
    top_k = f.integer("top_k", lo=-1)
    repetition_penalty = f.number("repetition_penalty", gt=0.0, le=100.0)
    ignore_eos = f.boolean("ignore_eos", False)
    min_tokens = f.integer("min_tokens", lo=0)
    if min_tokens and not ignore_eos:
        raise f.fail("min_tokens", "is not supported; use `ignore_eos` to generate exactly max_tokens")
    spec = GenerationSpec(
        model=model,
        stream=stream,
        include_usage=include_usage,
        max_new_tokens=max_completion_tokens if max_completion_tokens is not None else max_tokens,
        default_max_new_tokens=default_max,
        temperature=temperature if temperature is not None else 1.0,
        top_p=top_p if top_p is not None else 1.0,
        top_k=top_k if top_k not in (None, 0) else -1,
        repetition_penalty=repetition_penalty if repetition_penalty is not None else 1.0,
        seed=f.integer("seed", lo=MIN_SEED, hi=MAX_SEED),
        ignore_eos=ignore_eos,
        stop_token_ids=f.token_ids("stop_token_ids", vocab_size, settings.max_stop_token_ids),
        stop=f.stop_strings("stop", settings.max_stop_sequences, settings.max_stop_length, allow_str=True),
    )
    if spec.temperature == 0.0:  # greedy: the warpers have nothing to act on
        spec.top_p, spec.top_k = 1.0, -1
    return spec


def _prompt(value: Any, vocab_size: int, max_input_tokens: int) -> str | list[int]:
    """A prompt is a string or a list of token ids; a batch of one is unwrapped."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if value is None:
        raise validation_error("`prompt` is required", param="prompt", status=STATUS)
    if isinstance(value, str):
        if value == "":
            raise validation_error("`prompt` cannot be empty", param="prompt", status=STATUS)
        return value
    if isinstance(value, list):
        if not value:
            raise validation_error("`prompt` cannot be empty", param="prompt", status=STATUS)
        if isinstance(value[0], int) and len(value) > max_input_tokens:  # could never be served
            raise validation_error(f"`prompt` has {len(value)} tokens; it must have at most "
                                   f"max_input_tokens={max_input_tokens}", param="prompt", status=STATUS)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            bad = [t for t in value if not 0 <= t < vocab_size]
            if bad:
                raise validation_error(f"`prompt` contains token id {bad[0]} outside [0, {vocab_size})",
                                       param="prompt", status=STATUS)
            return list(value)
        if all(isinstance(p, (str, list)) for p in value):
            raise validation_error("batched prompts are not supported; send one prompt per request",
                                   param="prompt", status=STATUS)
    raise validation_error("`prompt` must be a string or a list of token ids", param="prompt", status=STATUS)


def _messages(value: Any, max_messages: int) -> list[dict[str, str]]:
    """Chat messages -> [{role, content}] with text content only (what a text model can read)."""
    if value is None:
        raise validation_error("`messages` is required", param="messages", status=STATUS)
    if not isinstance(value, list) or not value:
        raise validation_error("`messages` must be a non-empty list", param="messages", status=STATUS)
    if len(value) > max_messages:
        # The chat template's cost grows with the message count, not the text: tens of thousands
        # of empty messages fit in a small body and took seconds to template.
        raise validation_error(f"`messages` has {len(value)} messages; at most {max_messages} are allowed",
                               param="messages", status=STATUS)
    out: list[dict[str, str]] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise validation_error(f"`{where}` must be an object", param=where, status=STATUS)
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise validation_error(f"`{where}.role` must be one of {sorted(CHAT_ROLES)}, got {role!r}",
                                   param=f"{where}.role", status=STATUS)
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content(message.get("content"), where)})
    return out


def _content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if len(content) > MAX_CONTENT_PARTS:
            raise validation_error(f"`{where}.content` has {len(content)} parts; at most {MAX_CONTENT_PARTS} "
                                   "are allowed", param=f"{where}.content", status=STATUS)
        texts: list[str] = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise validation_error(f"`{where}.content[{j}]`: only text parts "
                                       '({"type": "text", "text": ...}) are supported',
                                       param=f"{where}.content", status=STATUS)
            texts.append(part["text"])
        return "".join(texts)
    raise validation_error(f"`{where}.content` must be a string or a list of text parts",
                           param=f"{where}.content", status=STATUS)
