"""The model's tokenizer, used to count and encode prompts and to decode generated tokens.

It is the Hugging Face tokenizer of the served model directory, so the gateway counts exactly the
tokens the workers will run. Chat templating and long texts run in a thread so that one big request
does not stall every other stream, and the heartbeat, on the event loop (a loop stalled for the
heartbeat TTL gets the gateway declared dead and its requests dropped).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from transformers import AutoTokenizer

from gateway.config import Settings
from gateway.errors import ApiError, ContextOverflow, context_length_exceeded, validation_error
from gateway.tools import choose_parser, for_template
from gateway.generation_spec import GenerationSpec
from gateway.loop_gate import LoopGate

T = TypeVar("T")
# Below this many characters (or token ids) tokenizing inline is cheaper than a thread hop.
_INLINE_CHARS = 4096


class PromptTokenizer:
    def __init__(self, model_dir: Path, chat_template: str | None = None) -> None:
        self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        if chat_template is not None:  # --chat-template: replaces the model's own
            self.hf.chat_template = chat_template
        # The Rust tokenizer decodes without transformers' per-call Python overhead (hot path).
        self.backend = self.hf.backend_tokenizer
        self.vocab_size = len(self.hf)
        self.special_ids = frozenset(self.hf.all_special_ids)
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))
        # Each token's text alone, as logprobs show it: asked for up to 21 times per generated
        # token (the token and its top 20), so decoded once per id (at most the vocabulary).
        self._token_texts: dict[int, str] = {}
        # The longest token's spelling in the vocabulary (a byte-level token spells each byte with
        # one character, so no token covers more characters of a text than this): a text longer
        # than n times this has more than n tokens, which a request's size is checked against
        # before anything is tokenized (gateway.embeddings.validation).
        self.max_token_chars = max(1, max(map(len, self.hf.get_vocab()), default=1))

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_texts(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Many texts in one call: the fast tokenizer encodes a batch in Rust (without the GIL, on
        its own threads), much faster than one call each. Blocking: see `texts_ids`."""
        return list(self.hf(texts, add_special_tokens=add_special_tokens)["input_ids"])

    async def texts_ids(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode_texts` off the event loop, one such batch at a time per gateway: a batch of up
        to a body's worth of text holds a core for about a second, and four at once on 2 cores kept
        the loop from turning for 0.4 s (one at a time: 0.05 s)."""
        if sum(map(len, texts)) <= _INLINE_CHARS:
            return self.encode_texts(texts, add_special_tokens)
        async with _one_batch_at_a_time():
            return await asyncio.to_thread(self.encode_texts, texts, add_special_tokens)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None, max_chars: int | None = None) -> list[int]:
        # tools and tool calls go to the template (see gateway.tools.for_template); template_kwargs
        # are the request's chat_template_kwargs (checked: none clashes with these parameters)
        text = self.hf.apply_chat_template(for_template(messages, self.hf.chat_template), tools=tools or None,
                                           add_generation_prompt=add_generation_prompt, tokenize=False,
                                           **(template_kwargs or {}))
        if max_chars is not None and len(text) > max_chars:  # the rendered text, whatever the template dropped
            raise PromptTooLong(len(text))
        # The template already wrote the special tokens; by default do not add a BOS again.
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (vLLM's /tokenize `token_strs`)."""
        return [str(t) for t in self.hf.convert_ids_to_tokens(ids)]

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.backend.decode([token_id], skip_special_tokens=False)
        return text

    async def prompt_ids(self, spec: GenerationSpec, status: int, settings: Settings | None = None) -> list[int]:
        """The prompt's token ids (chat: through the chat template). With `settings`, a text whose
        characters alone prove it longer than max_input_tokens is refused before it is tokenized
        (`refuse_by_characters`): a body of many MB would hold a core and memory for nothing."""
        prompt = spec.prompt
        if isinstance(prompt.input, list):
            return list(prompt.input)
        # TGI's truncate keeps the prompt's last tokens: any length is then served
        max_chars = self.max_token_chars * settings.max_input_tokens if settings and prompt.truncate is None else None
        try:
            if prompt.messages is not None:
                if not self.has_chat_template:
                    raise validation_error("this model has no chat template; use /v1/completions", status=status)
                calling = spec.api.tool_calling
                if calling is not None:  # "auto": the flag's tool-call parser, else the template's
                    choose_parser(calling, self.hf.chat_template)
                return await self.chat_ids(prompt.messages, status, True, False,
                                           calling.tools if calling is not None else None, prompt.chat_template_kwargs,
                                           max_chars)
            assert isinstance(prompt.input, str)
            if max_chars is not None and len(prompt.input) > max_chars:
                raise PromptTooLong(len(prompt.input))
            return await maybe_in_thread(len(prompt.input), self.encode_text, prompt.input, prompt.add_special_tokens)
        except PromptTooLong as exc:
            assert settings is not None
            raise self.refuse_by_characters(exc.chars, settings, "messages" if prompt.messages is not None
                                            else "prompt", status) from None

    def refuse_by_characters(self, chars: int, settings: Settings, param: str, status: int) -> ApiError:
        """context_length_exceeded for a text of `chars` characters: no token of this model spells
        more than max_token_chars of them, so it has at least chars / max_token_chars tokens."""
        assert settings.max_input_tokens is not None and settings.max_total_tokens is not None
        least = -(-chars // self.max_token_chars)
        overflow = ContextOverflow(least, 0, settings.max_total_tokens, settings.max_input_tokens)
        message = (f"This model's maximum context length is {overflow.limit} tokens and prompts may have at most "
                   f"{overflow.prompt_limit}. However, your prompt has at least {least} tokens ({chars} characters; "
                   f"no token of this model spells more than {self.max_token_chars}). Please reduce the length "
                   "of the prompt.")
        return ApiError(status, message, kind="validation", param=param, code="context_length_exceeded",
                        context=overflow)

    async def chat_ids(self, messages: list[dict[str, Any]], status: int, add_generation_prompt: bool = True,
                       add_special_tokens: bool = False, tools: list[dict[str, Any]] | None = None,
                       template_kwargs: dict[str, Any] | None = None, max_chars: int | None = None) -> list[int]:
        """`encode_chat` off the event loop, a template's refusal as a 4xx naming `messages`."""
        try:
            # Always off the loop: the template's cost grows with the number of messages, so even a
            # body of empty messages is not cheap (the count is capped in validation).
            return await asyncio.to_thread(self.encode_chat, messages, add_generation_prompt, add_special_tokens,
                                           tools, template_kwargs, max_chars)
        except PromptTooLong:
            raise
        except Exception as exc:  # jinja raises for messages the template refuses
            raise validation_error(f"the chat template rejected the messages: {exc}",
                                   param="messages", status=status) from None


class PromptTooLong(Exception):
    """A prompt text with more characters than max_input_tokens tokens can spell (see prompt_ids)."""

    def __init__(self, chars: int) -> None:
        super().__init__(chars)
        self.chars = chars


_one_batch_at_a_time = LoopGate()  # this event loop's gate (gateway.loop_gate)


async def maybe_in_thread(size: int, fn: Callable[..., T], *args: Any) -> T:
    if size <= _INLINE_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def apply_limits(spec: GenerationSpec, prompt_ids: list[int], settings: Settings,
                 status: int) -> tuple[list[int], int]:
    """Check the prompt against the token limits; return it (maybe truncated) and max_new_tokens."""
    truncate = spec.prompt.truncate
    if truncate is not None and len(prompt_ids) > truncate:
        prompt_ids = prompt_ids[-truncate:]  # TGI: keep the last `truncate` tokens
    n = len(prompt_ids)
    if n == 0:
        raise validation_error("the prompt is empty after tokenization", status=status)
    limit, prompt_limit = settings.max_total_tokens, settings.max_input_tokens
    if n > prompt_limit:
        raise context_length_exceeded(ContextOverflow(n, 0, limit, prompt_limit), param="messages" if spec.prompt.messages is not None else "prompt",
                                      status=status)
    room = limit - n
    if spec.max_new_tokens is None:
        return prompt_ids, max(1, min(spec.default_max_new_tokens, room))
    if n + spec.max_new_tokens > limit:
        raise context_length_exceeded(ContextOverflow(n, spec.max_new_tokens, limit, prompt_limit),
                                      param="max_tokens", status=status)
    return prompt_ids, spec.max_new_tokens
