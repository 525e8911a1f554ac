"""OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) -> GenerationSpec (gateway.generation_spec).

OpenAI semantics: temperature defaults to 1.0 (sampling) and 0 means greedy (a sampling field the
request leaves unset takes the model's generation_config.json default: gateway.sampling_defaults);
`n` choices (and completions' `best_of`, batched prompts) up to MAX_CHOICES per prompt; `logprobs` (completions: the
top-k count; chat: a flag with `top_logprobs`), completions' `echo` and vLLM's `prompt_logprobs`;
`max_tokens` defaults to 16 for completions and to the room left (capped at 1024) for chat;
`max_completion_tokens` (what aiperf sends) wins over `max_tokens`. `presence_penalty`,
`frequency_penalty` and `logit_bias` are honoured, and a few vLLM extras that map onto our sampling
options are accepted (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`).
`model` must be one of the served names (else 404, as vLLM answers). Known fields we cannot honour
are accepted only at their neutral value; unknown fields are ignored (see gateway.validation).
Chat's `chat_template_kwargs` (vLLM's) are extra template variables: an object of at most
MAX_TEMPLATE_KWARGS names (identifiers, none of apply_chat_template's own parameters), small
once encoded; `enable_thinking: false` (or `thinking: false`) turns the reasoning parser off.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from gateway import sampling_defaults
from gateway.config import Settings
from gateway.errors import ApiError, ContextOverflow, context_length_exceeded, validation_error
from baton.common.structured import InvalidStructure, compiled_grammar
from gateway.parsers.reasoning import think_first
from gateway.structured import openai_structured
from gateway.tools import message_extras, parse_tools
from gateway.generation_spec import ApiView, Choices, GenerationSpec, Prompt, provisional_sampling
from gateway.openai.fields import (CHAT, COMMON, COMPLETION, MAX_BATCH_PROMPTS,
                                   MAX_CONTENT_PARTS, MAX_LOGIT_BIAS, MAX_TEMPLATE_KWARGS)
from gateway.validation import Fields

STATUS = 400  # OpenAI answers invalid requests with 400 invalid_request_error
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = 1024
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}
# content parts of other media (OpenAI's and vLLM's names): refused as such, not as malformed text
MEDIA_PARTS = frozenset({"image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "file"})
# What huggingface_hub's chat_completion sends as `model` when its "model" is a URL (TGI ignores
# the field): served by the first name, or that client could never chat with us.
PLACEHOLDER_MODELS = frozenset({"tgi", "dummy"})
MAX_TEMPLATE_KWARGS_BYTES = 8192
# apply_chat_template's own parameters: a template variable of that name would clash with them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


@dataclass
class _Common:
    """The fields both OpenAI APIs share, checked; each API adds its own, then builds the spec."""

    sampling: dict[str, Any]  # SamplingParams' fields
    api: ApiView
    n: int
    max_new_tokens: int | None
    default_max_new_tokens: int
    stop: list[str]

    def spec(self, prompt: Prompt, choices: Choices) -> GenerationSpec:
        return GenerationSpec(prompt=prompt, api=self.api, choices=choices, max_new_tokens=self.max_new_tokens,
                              default_max_new_tokens=self.default_max_new_tokens, stop=self.stop,
                              sampling=provisional_sampling(self.max_new_tokens, self.default_max_new_tokens,
                                                            **self.sampling))


def parse_completion(body: dict[str, Any], settings: Settings, vocab_size: int) -> GenerationSpec:
    f = Fields(body, STATUS)
    ignored = COMPLETION.unknown(f, "the request", settings.strict_api)
    COMPLETION.check_neutral(f)
    common = _common(f, settings, vocab_size, COMPLETIONS_DEFAULT_MAX_TOKENS, ignored)
    prompts = _prompts(body.get("prompt"), vocab_size, settings)
    prompt = Prompt(input=prompts[0]) if len(prompts) == 1 else Prompt(batch=prompts)
    prompt.add_special_tokens = COMPLETION.read(f, "add_special_tokens")  # vLLM's extra, for text prompts
    # logprobs: the number of top alternatives per token (0: the chosen token's only)
    sampling = common.sampling
    sampling["logprobs"] = logprobs = COMPLETION.read(f, "logprobs")
    common.api.echo = COMPLETION.read(f, "echo")
    if common.api.echo and logprobs is not None:
        sampling["prompt_logprobs"] = max(sampling["prompt_logprobs"] or 0, logprobs)
    choices = Choices(n=common.n)
    best_of = COMPLETION.read(f, "best_of")
    if best_of is not None and best_of != common.n:
        if best_of < common.n:
            raise f.fail("best_of", f"must be at least n ({common.n}), got {best_of}")
        if common.api.stream:
            raise f.fail("best_of", "cannot be streamed: the best choices are known only at the end")
        choices = Choices(n=best_of, keep=common.n)
    return common.spec(prompt, choices)


def parse_chat(body: dict[str, Any], settings: Settings, vocab_size: int) -> GenerationSpec:
    f = Fields(body, STATUS)
    ignored = CHAT.unknown(f, "the request", settings.strict_api)
    CHAT.check_neutral(f)
    common = _common(f, settings, vocab_size, CHAT_DEFAULT_MAX_TOKENS, ignored)
    prompt = Prompt(messages=parse_messages(body.get("messages"), settings.max_chat_messages),
                    chat_template_kwargs=template_kwargs(f))
    sampling = common.sampling
    common.api.tool_calling, tool_constraint = parse_tools(f, sampling["structured"] is not None)
    if common.api.tool_calling is not None:
        common.api.tool_calling.parser = settings.tool_call_parser  # None: the template's (gateway.tools)
    sampling["structured"] = tool_constraint or sampling["structured"]
    common.api.reasoning_parser = _reasoning_parser(settings, prompt.chat_template_kwargs, sampling)
    top_logprobs = CHAT.read(f, "top_logprobs")
    if CHAT.read(f, "logprobs"):
        sampling["logprobs"] = top_logprobs or 0
    elif top_logprobs:
        raise f.fail("top_logprobs", "needs `logprobs` to be true")
    return common.spec(prompt, Choices(n=common.n))


def template_kwargs(f: Fields) -> dict[str, Any] | None:
    """`chat_template_kwargs`, checked (see the module doc)."""
    value = f.get("chat_template_kwargs")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise f.fail("chat_template_kwargs", "must be an object of template variables")
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise f.fail("chat_template_kwargs", f"has {len(value)} names; at most {MAX_TEMPLATE_KWARGS} are allowed")
    for key in value:
        if not key.isidentifier():
            raise f.fail("chat_template_kwargs", f"names must be identifiers, got {json.dumps(key)[:80]}")
        if key in RESERVED_TEMPLATE_KWARGS:
            raise f.fail("chat_template_kwargs", f"cannot set {key!r}: the request's own fields do")
    if len(json.dumps(value)) > MAX_TEMPLATE_KWARGS_BYTES:
        raise f.fail("chat_template_kwargs", f"is larger than {MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON")
    return value


def _reasoning_parser(settings: Settings, kwargs: dict[str, Any] | None, sampling: dict[str, Any]) -> str | None:
    """The request's reasoning parser: the flag's, unless thinking is off; a JSON constraint then
    allows a think block before the JSON (a regex, choice or grammar one leaves no room for it)."""
    name = settings.reasoning_parser
    if name is None or (kwargs and (kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False)):
        return None
    if sampling["structured"] is not None:
        wrapped = think_first(sampling["structured"], name)
        if wrapped is None:
            return None
        try:  # the JSON compiled on its own; its grammar should too (checked, as every constraint is)
            compiled_grammar(wrapped["kind"], wrapped["spec"])
        except InvalidStructure:
            return None  # the constraint as asked, on the whole output: no room for a thought
        sampling["structured"] = wrapped
    return name


def _common(f: Fields, settings: Settings, vocab_size: int, default_max: int, ignored: list[str]) -> _Common:
    f.string("user")
    model = served_model(f, settings)
    n = COMMON.read(f, "n")
    stream = COMMON.read(f, "stream")
    include_usage = continuous_usage = False
    options = f.get("stream_options")
    if options is not None:
        if not stream:
            raise f.fail("stream_options", "is only allowed when `stream` is true")
        if not isinstance(options, dict):
            raise f.fail("stream_options", "must be an object")
        so = Fields(options, STATUS, prefix="stream_options.")
        ignored = ignored + so.unknown({"include_usage", "continuous_usage_stats"}, "`stream_options`",
                                       settings.strict_api)
        include_usage = so.boolean("include_usage", False)
        # vLLM: usage on every chunk only when include_usage is set too
        continuous_usage = include_usage and so.boolean("continuous_usage_stats", False)

    # The scalars are checked by their entries in gateway.openai.fields (/openapi.json's too);
    # max_tokens is checked against max_total_tokens once the prompt is tokenized.
    max_tokens, max_completion_tokens, temperature, top_p, top_k, repetition_penalty, ignore_eos, min_tokens = (
        COMMON.read(f, name) for name in ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                                          "repetition_penalty", "ignore_eos", "min_tokens"))
    asked_max = max_completion_tokens if max_completion_tokens is not None else max_tokens
    if min_tokens and asked_max is not None and min_tokens > asked_max:
        raise f.fail("min_tokens", f"({min_tokens}) must be at most max_tokens ({asked_max})")
    presence, frequency, min_p = (COMMON.read(f, name) for name in ("presence_penalty", "frequency_penalty", "min_p"))
    # What the request leaves unset takes the model's generation_config.json default (vLLM's rule).
    sampling: dict[str, Any] = dict(
        **sampling_defaults.for_settings(settings).fill(temperature=temperature, top_p=top_p, top_k=top_k,
                                                        min_p=min_p, repetition_penalty=repetition_penalty),
        seed=COMMON.read(f, "seed"),
        ignore_eos=ignore_eos,
        stop_token_ids=f.token_ids("stop_token_ids", vocab_size, settings.max_stop_token_ids),
    )
    stop = f.stop_strings("stop", settings.max_stop_sequences, settings.max_stop_length, allow_str=True)
    sampling.update(
        presence_penalty=presence if presence is not None else 0.0,
        frequency_penalty=frequency if frequency is not None else 0.0,
        logit_bias=_logit_bias(f, vocab_size),
        min_tokens=min_tokens or 0,
        prompt_logprobs=COMMON.read(f, "prompt_logprobs"),  # vLLM's extra
        cache_salt=f.cache_salt(),  # vLLM's extra: this request's blocks are shared only under its salt
    )
    sampling["structured"] = openai_structured(f)  # response_format, guided_*, structured_outputs
    if sampling["temperature"] == 0.0:  # greedy: the warpers have nothing to act on
        sampling.update(top_p=1.0, top_k=-1, min_p=0.0)
    api = ApiView(model=model, stream=stream, include_usage=include_usage, continuous_usage=continuous_usage,
                  ignored_fields=ignored)
    return _Common(sampling=sampling, api=api, n=n or 1, max_new_tokens=asked_max,
                   default_max_new_tokens=default_max, stop=stop)


def served_model(f: Fields, settings: Settings) -> str | None:
    """The served name asked for; None (or "", as vLLM allows) means the first one."""
    model = f.string("model")
    if not model or model in PLACEHOLDER_MODELS:
        return None
    if model not in settings.served_model_names:
        shown = model if len(model) <= 200 else model[:200] + "..."
        raise ApiError(404, f"The model `{shown}` does not exist.", kind="model_not_found", param="model")
    return model


def _logit_bias(f: Fields, vocab_size: int) -> list[list[float]]:
    """OpenAI's {"token id": bias} object -> [[id, bias], ...] (the wire's maps have str keys)."""
    value = f.get("logit_bias")
    if value is None:
        return []
    if not isinstance(value, dict):
        raise f.fail("logit_bias", "must be an object mapping token ids (as strings) to biases in [-100, 100]")
    if len(value) > MAX_LOGIT_BIAS:
        raise f.fail("logit_bias", f"has {len(value)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    biases: dict[int, float] = {}
    for key, bias in value.items():
        # Digits only, and few of them: int() of a huge digit string is slow (and raises in 3.11+).
        if not (key.isascii() and key.isdigit() and len(key) <= 12):
            raise f.fail("logit_bias", f"keys must be token ids, got {json.dumps(key)[:40]}")
        token = int(key)
        if token >= vocab_size:
            raise f.fail("logit_bias", f"contains token id {token} outside [0, {vocab_size})")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise f.fail("logit_bias", f"values must be numbers, got {json.dumps(bias)[:40]} for token {token}")
        if not (isinstance(bias, int) or math.isfinite(bias)) or not -100 <= bias <= 100:
            raise f.fail("logit_bias", f"values must be in [-100, 100], got {bias} for token {token}")
        biases[token] = float(bias)
    return [[token, bias] for token, bias in biases.items()]


def _prompts(value: Any, vocab_size: int, settings: Settings) -> list[str | list[int]]:
    """`prompt`: a string, a list of token ids, or a batch of either (a list of them)."""
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        if len(value) > MAX_BATCH_PROMPTS:
            raise validation_error(f"`prompt` is a batch of {len(value)} prompts; at most {MAX_BATCH_PROMPTS} "
                                   "are allowed", param="prompt", status=STATUS)
        return [_prompt(p, vocab_size, settings) for p in value]
    return [_prompt(value, vocab_size, settings)]


def _prompt(value: Any, vocab_size: int, settings: Settings) -> str | list[int]:
    """A prompt is a string or a list of token ids."""
    if value is None:
        raise validation_error("`prompt` is required", param="prompt", status=STATUS)
    if isinstance(value, str):
        if value == "":
            raise validation_error("`prompt` cannot be empty", param="prompt", status=STATUS)
        return value
    if isinstance(value, list):
        if not value:
            raise validation_error("`prompt` cannot be empty", param="prompt", status=STATUS)
        if isinstance(value[0], int) and len(value) > settings.max_input_tokens:  # could never be served
            overflow = ContextOverflow(len(value), 0, settings.max_total_tokens, settings.max_input_tokens)
            raise context_length_exceeded(overflow, param="prompt", status=STATUS)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            bad = [t for t in value if not 0 <= t < vocab_size]
            if bad:
                raise validation_error(f"`prompt` contains token id {bad[0]} outside [0, {vocab_size})",
                                       param="prompt", status=STATUS)
            return list(value)
    raise validation_error("`prompt` must be a string or a list of token ids", param="prompt", status=STATUS)


def parse_messages(value: Any, max_messages: int) -> list[dict[str, str]]:
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
                    "content": _content(message.get("content"), where),
                    **message_extras(Fields(message, STATUS, prefix=where + "."))})  # tool calls, ids
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
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind in MEDIA_PARTS:
                raise validation_error(f"`{where}.content[{j}]`: {kind} input is not served: this server runs the "
                                       "text model only (a vision-language checkpoint's language model)",
                                       param=f"{where}.content", status=STATUS)
            if not isinstance(part, dict) or kind != "text" or not isinstance(part.get("text"), str):
                raise validation_error(f"`{where}.content[{j}]`: only text parts "
                                       '({"type": "text", "text": ...}) are supported',
                                       param=f"{where}.content", status=STATUS)
            texts.append(part["text"])
        return "".join(texts)
    raise validation_error(f"`{where}.content` must be a string or a list of text parts",
                           param=f"{where}.content", status=STATUS)
