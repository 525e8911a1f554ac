"""What one API request asks for, once validated: `GenerationSpec` = prompt + sampling + API view + choices.

Rules of this file:
- The four parts do not overlap. `Prompt` is what to tokenize; `SamplingParams` (baton's, the very
  object that goes on the wire) is how to generate, built once by validation and never copied
  field by field; `ApiView` is only what formatting the response needs (it never reaches a worker);
  `Choices` is how many generations the prompt gets and how many the answer keeps.
- `sampling.max_tokens` is provisional until the prompt is tokenized: the room left for output is
  known only then (gateway.tokenizer.apply_limits), so the length asked for lives in
  `max_new_tokens` / `default_max_new_tokens`, and each generation sets its own `max_tokens`,
  `min_tokens` and seed (gateway.siblings.sampling_for).
- Nothing here imports HTTP or Redis: validation builds specs, routes and generations read them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from baton.common.sampling_params import SamplingParams

PromptInput = str | list[int]


@dataclass
class Prompt:
    """What to complete, before tokenization: one input (text or token ids), a batch of them
    (completions), or chat messages (then `input` is None)."""

    input: PromptInput | None = None
    batch: list[PromptInput] | None = None
    messages: list[dict[str, Any]] | None = None  # normalized to {role, content, ...tool fields}
    add_special_tokens: bool = True  # for text inputs (TGI's and vLLM's `add_special_tokens`)
    truncate: int | None = None  # TGI: keep only the last `truncate` prompt tokens
    # chat: vLLM's `chat_template_kwargs`, extra variables for the chat template (e.g. enable_thinking)
    chat_template_kwargs: dict[str, Any] | None = None


@dataclass
class ApiView:
    """What the API's response needs and the workers never see."""

    stream: bool = False
    # TGI
    details: bool = False
    return_full_text: bool = False
    report_seed: bool = False  # details.seed: the seed a sampled request drew with (null when greedy)
    # OpenAI
    echo: bool = False  # completions: the prompt (and its logprobs) before the output
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    model: str | None = None  # the served name the request asked for (None: the first one)
    tool_calling: Any = None  # chat's tools (gateway.tools.ToolCalling), or None
    # chat: the --reasoning-parser that splits reasoning_content from content (gateway.parsers.reasoning)
    reasoning_parser: str | None = None
    # Unknown fields that were ignored (never with strict_api), named with their prefix.
    ignored_fields: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Choices:
    """`n` generations per prompt (OpenAI's n, or best_of when larger); with `keep`, the answer
    holds only the `keep` of highest total logprob (best_of)."""

    n: int = 1
    keep: int | None = None


@dataclass
class GenerationSpec:
    """One validated request, independent of the API it came from (before tokenization)."""

    prompt: Prompt
    sampling: SamplingParams
    api: ApiView
    choices: Choices = Choices()
    max_new_tokens: int | None = None  # None: the API's default, capped by the room left
    default_max_new_tokens: int = 100
    stop: list[str] = field(default_factory=list)  # stop strings: applied by the gateway, on text

    def per_prompt(self) -> list[GenerationSpec]:
        """One spec per prompt of a batch (the spec itself when it has no batch)."""
        if self.prompt.batch is None:
            return [self]
        return [dataclasses.replace(self, prompt=dataclasses.replace(self.prompt, input=one, batch=None))
                for one in self.prompt.batch]


def provisional_sampling(max_new_tokens: int | None, default_max_new_tokens: int, **fields: Any) -> SamplingParams:
    """The request's SamplingParams, with a `max_tokens` that passes its checks until the real one
    is known (see the module doc): what was asked, or the default, and never below min_tokens."""
    asked = max_new_tokens if max_new_tokens is not None else default_max_new_tokens
    return SamplingParams(max_tokens=max(1, asked, fields.get("min_tokens", 0)), **fields)
