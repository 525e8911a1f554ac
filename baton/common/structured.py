"""Structured output: what a request's output must match, as it travels, and its grammar.

A request's constraint is a plain dict in `SamplingParams.structured` (msgpack-able, so it crosses
the wire unchanged): `{"kind": KIND, "spec": TEXT}` with

- `json_schema`: `spec` is the schema, as JSON text;
- `json_object`: any JSON object (`spec` is ignored);
- `regex`: `spec` is a regular expression the whole output must match;
- `choice`: `spec` is a JSON list of strings, the output is exactly one of them;
- `grammar`: `spec` is a context-free grammar in Lark syntax (llguidance's) or GBNF (llama.cpp's,
  what vLLM's `guided_grammar` takes with xgrammar), converted to Lark.

The grammar engine is llguidance (see docs/design-decisions.md, "Structured output"): the gateway
compiles a spec here to refuse an invalid one with a 4xx before it costs a worker anything (no
tokenizer needed: about a millisecond), and the worker that samples builds a token matcher from the
same grammar (`baton.engine.structured`). No torch here: the gateway imports this module.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20
# JSON is generated as Python's json.dumps writes it (", " and ": ", no other whitespace): what
# models are trained on, and no room for a model (a random one above all) to spin on whitespace.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class InvalidStructure(ValueError):
    """The spec cannot be compiled (bad schema, regex or grammar); the message says why."""


def check_shape(structured: Any) -> None:
    """What `SamplingParams` checks: a known kind and a string spec (not whether it compiles)."""
    if not isinstance(structured, dict) or set(structured) - {"kind", "spec"}:
        raise InvalidStructure('structured must be {"kind": ..., "spec": ...}')
    if structured.get("kind") not in KINDS:
        raise InvalidStructure(f"structured kind must be one of {KINDS}, got {structured.get('kind')!r}")
    spec = structured.get("spec", "")
    if not isinstance(spec, str) or len(spec) > MAX_SPEC_CHARS:
        raise InvalidStructure(f"structured spec must be a string of at most {MAX_SPEC_CHARS} characters")


def json_schema(schema: dict[str, Any] | bool) -> dict[str, str]:
    return {"kind": "json_schema", "spec": json.dumps(schema)}


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of `choices` (every ASCII character but letters and digits
    written as a hex escape, so no choice can carry regex syntax)."""
    def literal(text: str) -> str:
        return "".join(c if c.isalnum() or not c.isascii() else f"\\x{{{ord(c):02x}}}" for c in text)

    return "(" + "|".join(literal(choice) for choice in choices) + ")"


def grammar_of(structured: dict[str, Any]) -> str:
    """The llguidance grammar of a constraint; raises InvalidStructure for a spec that is not
    even well-formed (the grammar's own errors show up when it is validated or compiled)."""
    from llguidance import LLMatcher

    check_shape(structured)
    kind, spec = structured["kind"], structured.get("spec", "")
    try:
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if kind == "json_schema":
            schema = json.loads(spec)
            if not isinstance(schema, (dict, bool)):
                raise InvalidStructure("a JSON schema must be an object (or a boolean)")
            return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            if (not isinstance(choices, list) or not choices
                    or not all(isinstance(c, str) and c for c in choices)):
                raise InvalidStructure("choices must be a non-empty list of non-empty strings")
            return LLMatcher.grammar_from_regex(choice_regex(choices))
        from llguidance.gbnf_to_lark import any_to_lark

        return LLMatcher.grammar_from_lark(any_to_lark(spec))
    except InvalidStructure:
        raise
    except Exception as exc:  # json.loads, the schema compiler, the GBNF converter
        raise InvalidStructure(str(exc)) from None


def validate(structured: dict[str, Any]) -> str:
    """Compile the constraint's grammar (without a tokenizer: cheap); its grammar text, or
    InvalidStructure naming the problem."""
    from llguidance import LLMatcher

    grammar = grammar_of(structured)
    try:
        error = LLMatcher.validate_grammar(grammar)
    except Exception as exc:  # it reports errors as text; anything it raises is one too
        error = str(exc) or type(exc).__name__
    if error:
        raise InvalidStructure(error.strip())
    return grammar


def compiled_grammar(kind: str, spec: str) -> str:
    """`validate`, remembered per spec, failures too: clients send one schema with request after
    request, and a client that repeats an invalid one must not make every request compile it."""
    grammar, error = _compile_outcome(kind, spec)
    if error is not None:
        raise InvalidStructure(error)
    assert grammar is not None
    return grammar


@lru_cache(maxsize=256)
def _compile_outcome(kind: str, spec: str) -> tuple[str | None, str | None]:
    """(grammar, None) or (None, why it is invalid)."""
    try:
        return validate({"kind": kind, "spec": spec}), None
    except InvalidStructure as exc:
        return None, str(exc)
