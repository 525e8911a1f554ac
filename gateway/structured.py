"""Structured-output fields of both APIs -> one constraint (`baton.common.structured`), compiled here.

OpenAI: `response_format` ({"type": "text" | "json_object" | "json_schema", "json_schema":
{"name", "schema", "strict"}}); vLLM's `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar` and `structured_outputs` ({"json" | "regex" | "choice" | "grammar" |
"json_object": ...}). TGI: `parameters.grammar` ({"type": "json" | "regex" | "json_schema",
"value": ...}). A request may set one of them; each is compiled here (llguidance, no tokenizer:
about a millisecond) so that an invalid schema, regex or grammar is a 4xx naming the field, never
a worker's error.
"""

from __future__ import annotations

import json
from typing import Any

from baton.common.structured import InvalidStructure, compiled_grammar, json_schema
from gateway.validation import Fields

OPENAI_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs")
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def compiled(f: Fields, key: str, structured: dict[str, str]) -> dict[str, str]:
    """`structured` if it compiles, else a 4xx naming `key`."""
    try:
        compiled_grammar(structured["kind"], structured["spec"])
    except InvalidStructure as exc:
        raise f.fail(key, f"is not a valid {_WHAT[structured['kind']]}: {str(exc)[:500]}") from None
    return structured


_WHAT = {"json_schema": "JSON schema", "json_object": "JSON object request", "regex": "regular expression",
         "choice": "list of choices", "grammar": "grammar (Lark or GBNF)"}


def openai_structured(f: Fields) -> dict[str, str] | None:
    """The constraint an OpenAI (or vLLM) request asks for, or None."""
    present = [key for key in OPENAI_FIELDS if f.get(key) is not None
               and not (key == "response_format" and _is_text(f.get(key)))]
    if not present:
        if f.get("response_format") is not None:
            _response_format(f)  # {"type": "text"}: still checked
        return None
    if len(present) > 1:
        raise f.fail(present[1], f"cannot be combined with `{f.prefix}{present[0]}`: ask for one constraint")
    key = present[0]
    value = f.get(key)
    if key == "response_format":
        return _response_format(f)
    if key == "structured_outputs":
        return _structured_outputs(f, key, value)
    return _constraint(f, key, key.removeprefix("guided_"), value)


def _constraint(f: Fields, key: str, kind: str, value: Any) -> dict[str, str]:
    """vLLM's json / regex / choice / grammar value of field `key`, checked and compiled."""
    if kind == "json":
        return compiled(f, key, _schema(f, key, value))
    if kind == "choice":
        return compiled(f, key, _choice(f, key, value))
    return compiled(f, key, {"kind": kind, "spec": _string(f, key, value)})


def _is_text(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") == "text"


def _response_format(f: Fields) -> dict[str, str] | None:
    value = f.get("response_format")
    key = "response_format"
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise f.fail(key, 'must be {"type": "text"}, {"type": "json_object"} or '
                          '{"type": "json_schema", "json_schema": {"name": ..., "schema": ...}}')
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return compiled(f, key, {"kind": "json_object", "spec": ""})
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise f.fail(key + ".json_schema", "must be an object with `name` and `schema`")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise f.fail(key + ".json_schema.name", "must be a string")
    if spec.get("strict") not in (None, True, False):
        raise f.fail(key + ".json_schema.strict", "must be a boolean")
    schema = spec.get("schema", {"type": "object"})  # OpenAI: no schema means any object
    return compiled(f, key + ".json_schema.schema", _schema(f, key + ".json_schema.schema", schema))


def _schema(f: Fields, key: str, value: Any) -> dict[str, str]:
    if isinstance(value, str):  # vLLM takes the schema as JSON text too
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise f.fail(key, f"is not valid JSON: {exc}") from None
    if not isinstance(value, (dict, bool)):
        raise f.fail(key, "must be a JSON schema (an object)")
    return json_schema(value)


def _string(f: Fields, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise f.fail(key, "must be a non-empty string")
    return value


def _choice(f: Fields, key: str, value: Any) -> dict[str, str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise f.fail(key, "must be a non-empty list of non-empty strings")
    return {"kind": "choice", "spec": json.dumps(value)}


def _structured_outputs(f: Fields, key: str, value: Any) -> dict[str, str]:
    """vLLM's `structured_outputs`: exactly one of its constraint keys (others null or false)."""
    if not isinstance(value, dict):
        raise f.fail(key, f"must be an object with one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}")
    so = Fields(value, f.status, prefix=f"{f.prefix}{key}.")
    present = [k for k in STRUCTURED_OUTPUTS_KEYS if value.get(k) not in (None, False)]
    unknown = sorted(k for k in value if k not in STRUCTURED_OUTPUTS_KEYS and value[k] is not None)
    if unknown:
        raise so.fail(unknown[0], "is not supported by this server")
    if len(present) != 1:
        raise f.fail(key, f"must set exactly one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}")
    inner = present[0]
    if inner != "json_object":
        return _constraint(so, inner, inner, value[inner])
    if value[inner] is not True:
        raise so.fail(inner, "must be true")
    return compiled(so, inner, {"kind": "json_object", "spec": ""})


def tgi_structured(p: Fields) -> dict[str, str] | None:
    """TGI's `parameters.grammar`: {"type": "json", "value": schema (object or JSON text)},
    {"type": "regex", "value": pattern} or {"type": "json_schema", "value": {"name", "schema"}}."""
    value = p.get("grammar")
    if value is None:
        return None
    key = "grammar"
    if not isinstance(value, dict) or value.get("type") not in ("json", "regex", "json_schema"):
        raise p.fail(key, 'must be {"type": "json" | "regex" | "json_schema", "value": ...}')
    inner = value.get("value")
    if value["type"] == "regex":
        return compiled(p, key + ".value", {"kind": "regex", "spec": _string(p, key + ".value", inner)})
    if value["type"] == "json_schema":
        if not isinstance(inner, dict) or "schema" not in inner:
            raise p.fail(key + ".value", "must be an object with `schema` (and `name`)")
        return compiled(p, key + ".value.schema", _schema(p, key + ".value.schema", inner["schema"]))
    return compiled(p, key + ".value", _schema(p, key + ".value", inner))
