"""TGI's scalar `parameters` as one table: each field's JSON type, bounds, default and description.

The one source for both sides: the validator (gateway.tgi.validation) reads each of these fields
through its entry, and /openapi.json's `TgiParameters` schema writes each from the same entry
(gateway.tgi.openapi), so the documented bounds are the checked ones. The fields that are not
scalars (`grammar`, `stop`, `cache_salt`) keep their own checks and schemas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from gateway.validation import MAX_SEED, Fields

DEFAULT_MAX_NEW_TOKENS = 100
MAX_TOP_N_TOKENS = 5  # TGI's default --max-top-n-tokens
MAX_BEST_OF = 4  # TGI's default --max-best-of
MAX_INT = 2**31 - 1  # an integer without a bound of its own still gets one (gateway.validation.Fields)


@dataclass(frozen=True)
class Parameter:
    """One field of `parameters`. Bounds are inclusive but `exclusive_minimum`; a number's bounds are
    floats (the 4xx prints them as given). `maximum` None: no bound here (max_new_tokens is checked
    against max_total_tokens once the prompt is tokenized)."""

    type: Literal["integer", "number", "boolean"]
    minimum: float | None = None
    exclusive_minimum: float | None = None
    maximum: float | None = None
    default: bool | None = None
    description: str | None = None

    def read(self, fields: Fields, name: str) -> Any:
        """The field's value (None when absent; a boolean's default), or the 4xx naming it."""
        if self.type == "boolean":
            return fields.boolean(name, bool(self.default))
        if self.type == "integer":
            lo = None if self.minimum is None else int(self.minimum)
            return fields.integer(name, lo=lo, hi=math.inf if self.maximum is None else self.maximum)
        return fields.number(name, gt=self.exclusive_minimum, ge=self.minimum, le=self.maximum)

    def schema(self) -> dict[str, Any]:
        """The field's JSON Schema, as /openapi.json documents it."""
        out: dict[str, Any] = {"type": self.type}
        for key, value in (("minimum", self.minimum), ("exclusiveMinimum", self.exclusive_minimum),
                           ("maximum", self.maximum), ("default", self.default),
                           ("description", self.description)):
            if value is not None:
                out[key] = value
        return out


PARAMETERS: dict[str, Parameter] = {
    "max_new_tokens": Parameter("integer", minimum=1, description=f"Default {DEFAULT_MAX_NEW_TOKENS} (capped "
                                "by the room left)."),
    "do_sample": Parameter("boolean", default=False, description="As TGI: the request samples when do_sample "
                           "is true or any warper is set (temperature other than 1, top_p < 1, top_k); "
                           "otherwise it is greedy. temperature 0 is greedy."),
    "temperature": Parameter("number", minimum=0.0, maximum=100.0),
    "top_p": Parameter("number", exclusive_minimum=0.0, maximum=1.0),
    "top_k": Parameter("integer", minimum=1, maximum=MAX_INT),
    "repetition_penalty": Parameter("number", exclusive_minimum=0.0, maximum=100.0),
    "seed": Parameter("integer", minimum=0, maximum=MAX_SEED),
    "truncate": Parameter("integer", minimum=1, maximum=MAX_INT,
                          description="Keep only the last N prompt tokens."),
    "details": Parameter("boolean", default=False),
    "return_full_text": Parameter("boolean", default=False),
    "decoder_input_details": Parameter("boolean", default=False, description="details.prefill: every prompt "
                                       "token with its logprob (the first null). Not when streaming."),
    "top_n_tokens": Parameter("integer", minimum=0, maximum=MAX_TOP_N_TOKENS, description="details.top_tokens "
                              "and each stream event's top_tokens: the N most likely tokens at each step."),
    "best_of": Parameter("integer", minimum=1, maximum=MAX_BEST_OF, description="Sampled candidates (needs "
                         "sampling, not streamed); the one with the highest total logprob is answered, the "
                         "others in details.best_of_sequences."),
}


def read(fields: Fields, name: str) -> Any:
    """`parameters.<name>` checked by its table entry."""
    return PARAMETERS[name].read(fields, name)
