"""TGI request bodies (`/generate`, `/generate_stream`, `POST /`) -> GenerationSpec (gateway.generation_spec).

TGI semantics kept here: a request samples when `do_sample` is true or any warper is set
(`temperature` other than 1, `top_p` < 1, `top_k`), as TGI's NextTokenChooser
decides, and is greedy otherwise; `max_new_tokens` defaults to 100; a sampled request without a
seed gets a random one, reported back in `details.seed`. Known TGI fields we cannot honour are
accepted at their neutral value and rejected, by name, otherwise; fields TGI does not know are
ignored (see gateway.validation), or rejected by name with --strict-api. The model's
generation_config.json defaults (gateway.sampling_defaults) fill in `repetition_penalty` and the
warpers a sampled request leaves unset; they never make a greedy request sample.
"""

from __future__ import annotations

import random
from typing import Any

from gateway import sampling_defaults
from gateway.config import Settings
from gateway.errors import validation_error
from gateway.generation_spec import ApiView, Choices, GenerationSpec, Prompt, provisional_sampling
from gateway.structured import tgi_structured
from gateway.tgi.parameters import DEFAULT_MAX_NEW_TOKENS, PARAMETERS, REQUEST
from gateway.validation import Fields

STATUS = 422  # TGI answers every validation error with 422

def parse_tgi(body: dict[str, Any], settings: Settings, streaming: bool) -> GenerationSpec:
    """`streaming`: whether the route streams (`/generate_stream`, or `POST /` with `stream: true`);
    the route decides, not the body: `/generate_stream` streams whatever `stream` says."""
    top = Fields(body, STATUS)
    ignored = REQUEST.unknown(top, "the request", settings.strict_api)
    inputs = top.string("inputs")
    if inputs is None:
        raise validation_error("`inputs` is required", param="inputs", status=STATUS)
    if inputs == "":
        raise validation_error("`inputs` cannot be empty", param="inputs", status=STATUS)
    REQUEST.read(top, "stream")  # checked; POST / reads it to pick the route
    stream = streaming
    add_special_tokens = REQUEST.read(top, "add_special_tokens")

    raw = body.get("parameters")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise validation_error("`parameters` must be an object", param="parameters", status=STATUS)
    p = Fields(raw, STATUS, prefix="parameters.")
    ignored += PARAMETERS.unknown(p, "`parameters`", settings.strict_api)
    PARAMETERS.check_neutral(p)

    # The scalar fields are checked by their entries in gateway.tgi.parameters (/openapi.json's too).
    do_sample = PARAMETERS.read(p, "do_sample")
    temperature = PARAMETERS.read(p, "temperature")
    top_p = PARAMETERS.read(p, "top_p")
    top_k = PARAMETERS.read(p, "top_k")
    repetition_penalty = PARAMETERS.read(p, "repetition_penalty")
    seed = PARAMETERS.read(p, "seed")
    max_new_tokens = PARAMETERS.read(p, "max_new_tokens")  # checked against max_total_tokens once tokenized
    stop = p.stop_strings("stop", settings.max_stop_sequences, settings.max_stop_length, allow_str=False)
    prompt = Prompt(input=inputs, add_special_tokens=add_special_tokens, truncate=PARAMETERS.read(p, "truncate"))
    api = ApiView(stream=stream, details=PARAMETERS.read(p, "details"),
                  return_full_text=PARAMETERS.read(p, "return_full_text"),
                  ignored_fields=ignored)
    # TGI samples when asked to or when any warper would change the distribution; a temperature
    # of exactly 1 or top_p of 1 changes nothing, so alone they leave the request greedy.
    warped = ((temperature is not None and temperature != 1.0) or (top_p is not None and top_p < 1.0)
              or top_k is not None)
    # What the request leaves unset takes the model's generation_config.json default; those decide
    # how a request samples, never whether: that stays TGI's rule above (its own fields only).
    filled = sampling_defaults.for_settings(settings).fill(temperature=temperature, top_p=top_p, top_k=top_k,
                                                           repetition_penalty=repetition_penalty)
    greedy = not (do_sample or warped) or filled["temperature"] == 0.0
    sampling: dict[str, Any] = {"repetition_penalty": filled["repetition_penalty"], "cache_salt": p.cache_salt()}
    if greedy:
        # Greedy: the warpers have nothing to act on and the seed is moot (none is reported).
        sampling.update(temperature=0.0, top_p=1.0, top_k=-1, seed=None)
    else:
        # TGI reports the seed it sampled with, so a client can replay the request.
        sampling.update(temperature=filled["temperature"], top_p=filled["top_p"], top_k=filled["top_k"],
                        min_p=filled["min_p"], seed=seed if seed is not None else random.getrandbits(63))
        api.report_seed = True
    sampling["structured"] = tgi_structured(p)  # parameters.grammar: json, regex
    choices = _logprobs_and_best_of(p, sampling, stream, greedy)
    return GenerationSpec(prompt=prompt, api=api, choices=choices, max_new_tokens=max_new_tokens,
                          default_max_new_tokens=DEFAULT_MAX_NEW_TOKENS, stop=stop,
                          sampling=provisional_sampling(max_new_tokens, DEFAULT_MAX_NEW_TOKENS, **sampling))


def _logprobs_and_best_of(p: Fields, sampling: dict[str, Any], stream: bool, greedy: bool) -> Choices:
    """top_n_tokens (details.top_tokens / each stream event's top_tokens), decoder_input_details
    (details.prefill with the prompt's logprobs) and best_of (as TGI: sampled, not streamed)."""
    top_n = PARAMETERS.read(p, "top_n_tokens")
    if top_n:
        sampling["logprobs"] = top_n
    if PARAMETERS.read(p, "decoder_input_details"):
        if stream:
            raise p.fail("decoder_input_details", "is not available when streaming (TGI's rule)")
        sampling["prompt_logprobs"] = 0
    best_of = PARAMETERS.read(p, "best_of")
    if best_of is not None and best_of > 1:
        if greedy:
            raise p.fail("best_of", "needs sampling: set `do_sample` (greedy candidates would all be the same)")
        if stream:
            raise p.fail("best_of", "cannot be streamed (TGI's rule)")
        return Choices(n=best_of, keep=1)
    return Choices()
