"""Every API's request bodies have one source (gateway.request_fields tables): the schema /openapi.json
serves for a route's body is its table's, field by field, and the validator enforces what the table
says: each scalar's bounds (a value just past one is a 4xx naming the field and the bound, the bound
itself is accepted), each boolean's type, and each not-implemented field's neutral value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from gateway.anthropic import fields as anthropic
from gateway.embeddings import fields as embeddings
from gateway.openai import fields as openai
from gateway.request_fields import Neutral, RequestFields, Scalar
from gateway.responses import fields as responses
from gateway.tgi import parameters as tgi
from gateway.validation import Fields

_USER = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class Body:
    """A route's body (or its `nested` object): the table behind it and a minimal valid body."""

    route: str
    table: RequestFields
    status: int
    valid: dict[str, Any]
    nested: str | None = None

    def with_field(self, name: str, value: Any) -> dict[str, Any]:
        if self.nested is None:
            return {**self.valid, name: value}
        return {**self.valid, self.nested: {**self.valid.get(self.nested, {}), name: value}}

    def __str__(self) -> str:
        return self.route + (f" {self.nested}" if self.nested else "")


BODIES = [
    Body("/v1/completions", openai.COMPLETION, 400, {"prompt": "hi", "max_tokens": 1}),
    Body("/v1/chat/completions", openai.CHAT, 400, {"messages": _USER, "max_tokens": 1}),
    Body("/v1/messages", anthropic.MESSAGES, 400, {"model": "", "messages": _USER, "max_tokens": 1}),
    Body("/v1/messages/count_tokens", anthropic.COUNT_TOKENS, 400, {"model": "", "messages": _USER}),
    Body("/v1/responses", responses.REQUEST, 400, {"input": "hi", "max_output_tokens": 1}),
    Body("/generate", tgi.REQUEST, 422, {"inputs": "hi", "parameters": {"max_new_tokens": 1}}),
    Body("/generate", tgi.PARAMETERS, 422, {"inputs": "hi", "parameters": {"max_new_tokens": 1}}, "parameters"),
    Body("/v1/embeddings", embeddings.OPENAI, 400, {"input": "hi"}),
    Body("/embed", embeddings.TEI, 422, {"inputs": "hi"}),
]
IDS = [str(b) for b in BODIES]


def _resolve(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """An object schema with its $ref followed and its allOf parts merged."""
    if "$ref" in schema:
        return _resolve(spec, spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]])
    if "allOf" in schema:
        merged: dict[str, Any] = {"properties": {}, "required": []}
        for part in schema["allOf"]:
            part = _resolve(spec, part)
            merged["properties"].update(part.get("properties", {}))
            merged["required"] += part.get("required", [])
        return merged
    return schema


@pytest.fixture(scope="module")
def served_spec(gw_server) -> dict[str, Any]:
    return httpx.get(gw_server.url + "/openapi.json").json()


@pytest.mark.parametrize("body", BODIES, ids=IDS)
def test_the_served_schema_is_the_tables(served_spec: dict[str, Any], body: Body):
    schema = served_spec["paths"][body.route]["post"]["requestBody"]["content"]["application/json"]["schema"]
    schema = _resolve(served_spec, schema)
    if body.nested:
        schema = _resolve(served_spec, schema["properties"][body.nested])
    assert set(schema["properties"]) == body.table.names
    for name, entry in body.table.fields.items():
        served = dict(schema["properties"][name])
        if name == "model":  # the gateway adds its served names (gateway.openapi._schemas)
            served.pop("enum", None)
        assert served == entry.schema(), name
    assert sorted(schema.get("required", [])) == sorted(body.table.required)


def _past_bounds(entry: Scalar) -> list[tuple[Any, str]]:
    """Values just outside the entry's bounds, each with the words its 4xx must contain."""
    step = 1 if entry.type == "integer" else 0.5
    out: list[tuple[Any, str]] = []
    if entry.minimum is not None:
        out.append((entry.minimum - step, f"must be >= {entry.minimum}"))
    if entry.exclusive_minimum is not None:
        out.append((entry.exclusive_minimum, f"must be > {entry.exclusive_minimum}"))
    if entry.maximum is not None:
        out.append((entry.maximum + step, f"must be <= {entry.maximum}"))
    if entry.type == "boolean":
        out.append((1, "must be a boolean"))
    else:
        out.append(("1", f"must be {'an integer' if entry.type == 'integer' else 'a number'}"))
    return out


@pytest.mark.parametrize("body", BODIES, ids=IDS)
def test_the_validator_enforces_the_tables_bounds_and_neutral_values(gw_server, body: Body):
    checked = 0
    for name, entry in body.table.fields.items():
        if isinstance(entry, Scalar):
            cases = _past_bounds(entry)
        elif isinstance(entry, Neutral):
            cases = [({"not": "neutral"}, "is not supported by this server")]
        else:
            continue
        where = f"`{body.nested}.{name}`" if body.nested else f"`{name}`"
        for value, words in cases:
            r = httpx.post(gw_server.url + body.route, json=body.with_field(name, value))
            assert r.status_code == body.status, (name, value, r.text)
            assert f"{where} {words}" in r.text, (name, value, r.text)
            checked += 1
    # the minimal body itself is valid: what failed above failed for the field
    assert httpx.post(gw_server.url + body.route, json=body.valid).status_code == 200, body
    assert checked or not body.table.scalars()


@pytest.mark.parametrize("body", BODIES, ids=IDS)
def test_the_tables_bounds_themselves_are_accepted(body: Body):
    for name, entry in body.table.scalars().items():
        for bound in (entry.minimum, entry.maximum):
            if bound is not None:
                assert body.table.read(Fields({name: bound}, body.status), name) == bound, name
        if entry.type == "boolean":
            assert body.table.read(Fields({}, body.status), name) is bool(entry.default), name
