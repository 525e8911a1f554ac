"""What a request wants generated (vLLM's names): one type, used by the gateway, on the wire and in
the engine. No torch here: the gateway imports it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from baton.common.structured import check_shape

GREEDY_TEMPERATURE = 1e-5  # below this, sampling is greedy
MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs (vLLM's default max_logprobs is 20 too)
MAX_CACHE_SALT_CHARS = 1024  # a salt needs ~43 (256 random bits, base64); it rides on every message


@dataclass
class SamplingParams:
    """What a request wants generated. temperature 0 means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    # OpenAI's penalties: logit -= presence * [token appeared in the output] + frequency * count
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the top one's
    # [token id, bias] pairs added to the logits (a list, not a map: the wire's maps have str keys)
    logit_bias: list[list[float]] = field(default_factory=list)
    # Log-probabilities to return (vLLM's meaning): None = none; k = the sampled token's and the k
    # most likely ones', from the model's raw logits (before penalties, bias and warpers).
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    # EOS and stop_token_ids cannot be sampled before this many output tokens (vLLM's min_tokens)
    min_tokens: int = 0
    # Structured output: {"kind": ..., "spec": ...} the output must match (see baton.common.structured)
    structured: dict | None = None
    # vLLM's cache_salt: mixed into the first block's id (kvstore.hashing), so the prefix cache
    # shares this request's blocks only with requests of the same salt. Not sampling, but it rides
    # here to reach every engine that hashes the request's blocks (prefill, handoff, decode).
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.n != 1:
            raise ValueError("only n=1 is supported")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not all(isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], int)
                   and isinstance(pair[1], (int, float)) and -100 <= pair[1] <= 100 for pair in self.logit_bias):
            raise ValueError("logit_bias holds [token id, bias] pairs with bias in [-100, 100]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be null or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.structured is not None:
            check_shape(self.structured)
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and 0 < len(self.cache_salt)
                                                <= MAX_CACHE_SALT_CHARS):
            raise ValueError(f"cache_salt must be null or a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                             "characters")
        if self.seed is None:
            # A request without a seed still gets one, fixed at creation: its stream of random
            # draws then survives preemption and a move to another worker unchanged.
            self.seed = int.from_bytes(os.urandom(7), "little")

    @property
    def edits_logits(self) -> bool:
        """Whether the logits change before the pick (penalties, bias): the sampler's slow path."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))

    @property
    def greedy(self) -> bool:
        # A temperature this small is greedy in effect; dividing by it would overflow the logits
        # to inf and the probabilities to NaN (vLLM draws the same line).
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
