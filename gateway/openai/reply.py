"""One OpenAI chat or completion answer over its choices: `OpenAIReply` builds the whole response
(`full()`), each stream chunk (`chunk()`), and the usage; `sse()` frames one event.

Chat's answer is also what the other chat-shaped APIs translate from (the Responses and Messages
routes): an assistant message `{"content", "tool_calls", ...}` with an OpenAI finish reason, or
streamed deltas of it, so every parser (tool calls, reasoning) is applied in one place.

With a reasoning parser (`--reasoning-parser`, gateway.parsers.reasoning) the output is split first:
`message.reasoning_content` (only when there was reasoning) and streamed `delta.reasoning_content`
pieces, then the tool-call parsing (gateway.tools) reads the answer after the think block only.
The same text is also under `reasoning`, the name current vLLM uses, so clients written against
either spelling read it.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from baton.common.finish_reason import FinishReason
from gateway import siblings
from gateway.finish import spelled
from gateway.generation import Generation, Step
from gateway.logprobs_format import CompletionLogprobs, chat_logprobs, merge, vllm_prompt_logprobs
from gateway.parsers import reasoning
from gateway.tools import ToolStream, assistant_message


class OpenAIReply:
    """Identity and shape of one OpenAI response (completion or chat) over its choices."""

    def __init__(self, gens: list[Generation], chat: bool) -> None:
        self.gens = gens
        self.all_gens = gens  # every candidate, also those best_of drops: the usage counts them
        self.spec = gens[0].spec
        self.api = self.spec.api  # what the response looks like
        self.sampling = self.spec.sampling  # what was asked for (logprobs, prompt_logprobs)
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = self.api.model or gens[0].svc.settings.model_name
        self.object = ("chat.completion" if chat else "text_completion")
        self.tokenizer = gens[0].svc.tokenizer
        self._logprobs = {id(g): CompletionLogprobs(self.tokenizer) for g in gens}
        self.generated: int | None = None  # tokens of every choice, when best_of dropped some
        calling = self.api.tool_calling  # streamed tool calls: each choice's deltas rewritten
        self._tool_streams = {id(g): ToolStream(calling) for g in gens} if chat and calling is not None else {}
        self.reasoning_parser = self.api.reasoning_parser if chat else None
        # streamed: each choice's think-block split, fed as its text comes
        self._thinking = {id(g): reasoning.make(self.reasoning_parser) for g in gens} if self.reasoning_parser else {}

    def keep_best(self) -> None:
        """best_of: answer with the `keep` best choices of each prompt (gateway.siblings); all
        generated tokens still count in the usage, as OpenAI bills them."""
        keep = self.spec.choices.keep
        if keep is None:
            return
        self.generated = sum(len(g.tokens) for g in self.gens)
        self.gens = siblings.keep_best(self.gens, self.spec.choices.n, keep)

    def usage(self) -> dict[str, Any]:
        # A prompt counts once however many choices it has (OpenAI's rule for n), and whichever
        # of them best_of keeps.
        prompts = [g for g in self.all_gens if g.sibling == 0]
        prompt = sum(len(g.prompt_ids) for g in prompts)
        completion = self.generated if self.generated is not None else sum(len(g.tokens) for g in self.gens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(g.num_cached_tokens for g in prompts)}}

    def formatting_cost(self) -> int:
        """About how many token entries the full answer formats (each token once, plus its top
        logprobs; with echo the prompt's too)."""
        per_token = 1 + (self.sampling.logprobs or 0)
        tokens = sum(len(g.tokens) + (len(g.prompt_ids) if self.api.echo else 0) for g in self.gens)
        return tokens * per_token

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self) -> dict[str, Any]:
        choices = []
        for gen in self.gens:
            finish = spelled(gen.finish_reason or FinishReason.LENGTH, "openai")
            if self.chat:
                logprobs = chat_logprobs(self.tokenizer, gen.tokens) if self.sampling.logprobs is not None else None
                thought, answer = (reasoning.split(self.reasoning_parser, gen.text) if self.reasoning_parser
                                   else (None, gen.text))
                message, finish = assistant_message(self.api.tool_calling, answer, finish)  # tool_calls
                if thought is not None:
                    message["reasoning_content"] = message["reasoning"] = thought
                choices.append({"index": gen.choice, "message": message, "logprobs": logprobs, "finish_reason": finish})
            else:
                parts = [self._echo_logprobs(gen)] if self.api.echo else []
                parts.append(self._logprobs[id(gen)].tokens(gen.tokens))
                logprobs = merge(parts) if self.sampling.logprobs is not None else None
                choices.append({"index": gen.choice, "text": self._echo_text(gen) + gen.text,
                                "logprobs": logprobs, "finish_reason": finish})
            if self.sampling.prompt_logprobs is not None:
                choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(self.tokenizer, gen.prompt_ids,
                                                                      gen.prompt_logprobs)
        return {**self.head(self.object), "choices": choices, "usage": self.usage()}

    def _split(self, gen: Generation, text: str, last: bool) -> tuple[str, str]:
        """A step's (reasoning, content) pieces; the last step flushes what the split held."""
        thinking = self._thinking[id(gen)]
        thought, answer = thinking.feed(text) if text else ("", "")
        if last:
            more_thought, more_answer = thinking.finish()
            thought, answer = thought + more_thought, answer + more_answer
        return thought, answer

    def _echo_text(self, gen: Generation) -> str:
        if not self.api.echo:
            return ""
        prompt = gen.spec.prompt.input
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(gen.prompt_ids, skip_special_tokens=False)

    def _echo_logprobs(self, gen: Generation) -> dict[str, Any]:
        return self._logprobs[id(gen)].prompt(gen.prompt_ids, gen.prompt_logprobs)

    def chunk(self, gen: Generation, step: Step | None, role: bool = False, echo: bool = False) -> dict[str, Any]:
        """The chunk for one choice: its role (chat's first), its echoed prompt (completions'
        first, with echo), or a step's text, logprobs and finish."""
        tokens = step.tokens if step is not None else []
        text = step.text if step is not None else ""
        finish = spelled(step.finish, "openai") if step is not None else None
        wants_logprobs = self.sampling.logprobs is not None
        if self.chat:
            delta: dict[str, Any] = {}
            thought = ""
            if not role and self._thinking:
                thought, text = self._split(gen, text, finish is not None)
            if role:
                delta["role"] = "assistant"
                delta["content"] = ""
            elif text:
                delta["content"] = text
            if self._tool_streams:
                delta, finish = self._tool_streams[id(gen)].rewrite(delta, finish)
            if thought:
                delta["reasoning_content"] = delta["reasoning"] = thought
            logprobs = chat_logprobs(self.tokenizer, tokens) if wants_logprobs and tokens else None
            choice = {"index": gen.choice, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            body = {**self.head("chat.completion.chunk"), "choices": [choice]}
        else:
            if echo:
                text = self._echo_text(gen)
                logprobs = self._echo_logprobs(gen) if wants_logprobs else None
            else:
                logprobs = self._logprobs[id(gen)].tokens(tokens) if wants_logprobs and tokens else None
            choice = {"index": gen.choice, "text": text, "logprobs": logprobs, "finish_reason": finish}
            body = {**self.head("text_completion"), "choices": [choice]}
        if self.api.continuous_usage:
            body["usage"] = self.usage()
        elif self.api.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return body


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n"
