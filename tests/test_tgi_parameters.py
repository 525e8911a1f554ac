"""TGI's scalar `parameters` have one source (gateway.tgi.parameters): the schema /openapi.json serves
for them is the table's, and the validator accepts each bound the table names and rejects, with a
422 naming the field and the bound, a value just past it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.tgi.parameters import PARAMETERS, Parameter
from gateway.validation import Fields


def _past_bounds(parameter: Parameter) -> list[tuple[Any, str]]:
    """Values just outside the entry's bounds, each with the words its 422 must contain."""
    step = 1 if parameter.type == "integer" else 0.5
    out: list[tuple[Any, str]] = []
    if parameter.minimum is not None:
        out.append((parameter.minimum - step, f"must be >= {parameter.minimum}"))
    if parameter.exclusive_minimum is not None:
        out.append((parameter.exclusive_minimum, f"must be > {parameter.exclusive_minimum}"))
    if parameter.maximum is not None:
        out.append((parameter.maximum + step, f"must be <= {parameter.maximum}"))
    if parameter.type == "boolean":
        out.append((1, "must be a boolean"))
    return out


def test_the_served_schema_is_the_tables(gw_server):
    spec = httpx.get(gw_server.url + "/openapi.json").json()
    served = spec["components"]["schemas"]["TgiParameters"]["properties"]
    for name, parameter in PARAMETERS.items():
        assert served[name] == parameter.schema(), name


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_the_validator_rejects_values_past_the_tables_bounds(gw_server, name: str):
    cases = _past_bounds(PARAMETERS[name])
    assert cases, name  # every entry bounds something
    for value, words in cases:
        r = httpx.post(gw_server.url + "/generate", json={"inputs": "x", "parameters": {name: value}})
        assert r.status_code == 422, (name, value, r.text)
        body = r.json()
        assert body["error_type"] == "validation"
        assert f"`parameters.{name}` {words}" in body["error"], (name, value, body)


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_the_tables_bounds_themselves_are_accepted(name: str):
    parameter = PARAMETERS[name]
    for bound in (parameter.minimum, parameter.maximum):
        if bound is not None:
            assert parameter.read(Fields({name: bound}, 422, prefix="parameters."), name) == bound
    if parameter.type == "boolean":
        assert parameter.read(Fields({}, 422, prefix="parameters."), name) is parameter.default
