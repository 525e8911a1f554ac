"""Embedding request bodies -> `EmbeddingSpec`, or a clear 4xx naming the field.

OpenAI's `POST /v1/embeddings` (400s): `input` is a string, a list of strings, a list of token ids
or a list of lists of token ids, each non-empty, at most MAX_INPUTS of them; `model` one of the
served names; `encoding_format` `float` | `base64`; `dimensions` in [1, hidden size] (the vector is
cut to it, then renormalized, as OpenAI's text-embedding-3 models do); `user` accepted and unused;
vLLM's `truncate_prompt_tokens` keeps each input's last k tokens (else an input longer than
max_input_tokens is a 400, as OpenAI answers). TEI's `POST /embed` (422s): `inputs` a string or a
list of them, `normalize` (default: the server's, normalized unless --no-normalize), `truncate` (default false: a too-long input is a 422)
with `truncation_direction` `right` (keep the start, TEI's default) | `left`; `prompt_name` needs the checkpoint's sentence-transformers prompts, which Baton
does not apply, so any value is refused by name. Known fields and scalar bounds come from the tables
`gateway.embeddings.fields.OPENAI` / `TEI`, which /openapi.json documents. Unknown fields: as every
other endpoint (gateway.validation: ignored and listed in x-baton-ignored-fields, or a 4xx with --strict-api).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.config import Settings
from gateway.errors import validation_error
from gateway.validation import Fields
from gateway.openai.validation import served_model
from gateway.embeddings.fields import MAX_INPUTS, OPENAI, TEI

OPENAI_STATUS = 400
TEI_STATUS = 422


@dataclass
class EmbeddingSpec:
    inputs: list[str | list[int]]
    model: str | None = None  # the served name asked for (OpenAI)
    base64: bool = False
    dimensions: int | None = None
    normalize: bool | None = None  # None: the server's (--normalize / the checkpoint)
    # Longer inputs: None -> a 4xx; else cut to `keep` tokens, from the left (keep the end) or not
    keep: int | None = None
    keep_end: bool = True
    ignored_fields: list[str] = field(default_factory=list)


def parse_openai(body: dict[str, Any], settings: Settings, vocab_size: int, hidden_size: int) -> EmbeddingSpec:
    f = Fields(body, OPENAI_STATUS)
    ignored = OPENAI.unknown(f, "an embeddings request", settings.strict_api)
    OPENAI.check_neutral(f)
    model = served_model(f, settings)
    encoding = f.string("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise f.fail("encoding_format", f"must be \"float\" or \"base64\", got {encoding[:40]!r}")
    dimensions = OPENAI.read(f, "dimensions")
    if dimensions is not None and dimensions > hidden_size:
        raise f.fail("dimensions", f"must be <= {hidden_size} (this model's embedding size), got {dimensions}")
    f.string("user")
    keep = OPENAI.read(f, "truncate_prompt_tokens", maximum=settings.max_input_tokens)
    inputs = _openai_inputs(f, vocab_size, settings.max_input_tokens if keep is None else None)
    return EmbeddingSpec(inputs, model, encoding == "base64", dimensions, None, keep, True, ignored)


def _openai_inputs(f: Fields, vocab_size: int, max_tokens: int | None) -> list[str | list[int]]:
    value = f.get("input")
    if value is None:
        raise f.fail("input", "is required")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise f.fail("input", "must be a non-empty string, list of strings, list of token ids or list of "
                     "lists of token ids")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        value = [value]  # one input of token ids
    if len(value) > MAX_INPUTS:
        raise f.fail("input", f"has {len(value)} inputs; at most {MAX_INPUTS} are allowed")
    inputs: list[str | list[int]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]" if len(value) > 1 else "input"
        if isinstance(item, str):
            if not item:
                raise f.fail(where, "must not be empty")
            inputs.append(item)
            continue
        if not isinstance(item, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            raise f.fail(where, "must be a string or a list of token ids")
        if not item:
            raise f.fail(where, "must not be empty")
        if max_tokens is not None and len(item) > max_tokens:
            raise f.fail(where, f"has {len(item)} tokens; at most max_input_tokens={max_tokens} "
                         "(or set truncate_prompt_tokens)")
        bad = [t for t in item if not 0 <= t < vocab_size]
        if bad:
            raise f.fail(where, f"contains token id {bad[0]} outside [0, {vocab_size})")
        inputs.append(list(item))
    return inputs


def parse_tei(body: dict[str, Any], settings: Settings) -> EmbeddingSpec:
    f = Fields(body, TEI_STATUS)
    ignored = TEI.unknown(f, "an embed request", settings.strict_api)
    TEI.check_neutral(f)
    value = f.get("inputs")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise f.fail("inputs", "must be a non-empty string or a non-empty list of strings")
    if len(value) > MAX_INPUTS:
        raise f.fail("inputs", f"has {len(value)} inputs; at most {MAX_INPUTS} are allowed")
    empty = [i for i, v in enumerate(value) if not v]
    if empty:
        raise f.fail("inputs", f"input {empty[0]} is empty")
    # not given: the server's choice (--normalize / the checkpoint; normalized by default, as TEI)
    normalize = TEI.read(f, "normalize") if f.get("normalize") is not None else None
    truncate = TEI.read(f, "truncate")
    direction = (f.string("truncation_direction") or "right").lower()
    if direction not in ("left", "right"):
        raise f.fail("truncation_direction", f"must be \"left\" or \"right\", got {direction[:40]!r}")
    if f.get("prompt_name") is not None:
        raise f.fail("prompt_name", "is not supported: this server applies no sentence-transformers prompts")
    return EmbeddingSpec(list(value), normalize=normalize, keep=settings.max_input_tokens if truncate else None,
                         keep_end=direction == "left", ignored_fields=ignored)


def fit(ids: list[int], spec: EmbeddingSpec, settings: Settings, where: str, status: int) -> list[int]:
    """One tokenized input within the limits: cut as the request asks, or a 4xx naming it."""
    if spec.keep is not None and len(ids) > spec.keep:
        ids = ids[-spec.keep:] if spec.keep_end else ids[:spec.keep]
    if not ids:
        raise validation_error(f"`{where}` is empty after tokenization", param=where, status=status)
    if len(ids) > settings.max_input_tokens:
        hint = "truncate_prompt_tokens" if status == OPENAI_STATUS else "truncate: true"
        raise validation_error(f"`{where}` has {len(ids)} tokens; at most max_input_tokens="
                               f"{settings.max_input_tokens} (or set {hint})", param=where, status=status)
    return ids


def check_characters(spec: EmbeddingSpec, settings: Settings, max_token_chars: int, status: int) -> None:
    """Before anything is tokenized: refuse inputs whose characters alone prove them too long. No
    token covers more than `max_token_chars` characters (the vocabulary's longest spelling), so a
    text of c characters has at least ceil(c / max_token_chars) tokens: an input past
    max_input_tokens (unless the request truncates), or a request past max_embedding_tokens in all,
    is answered here, and the tokenizer never sees it."""
    name = "input" if status == OPENAI_STATUS else "inputs"
    many = len(spec.inputs) > 1
    least_tokens = 0
    for i, item in enumerate(spec.inputs):
        if isinstance(item, str):
            tokens = -(-len(item) // max_token_chars)
            if spec.keep is None and tokens > settings.max_input_tokens:
                where = f"{name}[{i}]" if many else name
                hint = "truncate_prompt_tokens" if status == OPENAI_STATUS else "truncate: true"
                raise validation_error(
                    f"`{where}` has {len(item)} characters: more than max_input_tokens={settings.max_input_tokens} "
                    f"tokens can hold (no token of this model spells more than {max_token_chars} characters); "
                    f"send a shorter text (or set {hint})", param=where, status=status)
        else:
            tokens = len(item)
        least_tokens += tokens if spec.keep is None else min(tokens, spec.keep)
    if least_tokens > settings.max_embedding_tokens:
        chars = sum(len(item) for item in spec.inputs if isinstance(item, str))
        raise validation_error(
            f"`{name}` holds at least {least_tokens} tokens in all ({chars} characters; no token of this model "
            f"spells more than {max_token_chars}); an embeddings request may have at most "
            f"max_embedding_tokens={settings.max_embedding_tokens}: send fewer or shorter inputs",
            param=name, status=status)
