"""A request body's fields as one table: what the validator accepts and checks, and what
/openapi.json documents, both read from the same entries.

Each API declares its request bodies as `RequestFields` tables (gateway.<api>.fields). The validator
takes its set of known fields (`unknown`), its not-implemented fields' neutral values
(`check_neutral`) and every scalar's type and bounds (`read`) from the table; the OpenAPI part
writes each body's schema with `schema()`. So a field cannot be accepted without being documented,
and a documented bound is the checked one (tests/test_request_fields.py walks every table). Fields
with a structure of their own (messages, tools, stop, ...) keep their checks in the API's code and
their documented shape here (`Shaped`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.validation import Fields

MAX_INT = 2**31 - 1  # an integer without a bound of its own still gets one (gateway.validation.Fields)


@dataclass(frozen=True)
class Scalar:
    """An integer, number or boolean field. Bounds are inclusive but `exclusive_minimum`; a number's
    bounds are floats (the 4xx prints them as given). `maximum` None: no bound here (a token count is
    checked against the context once the prompt is tokenized). `default` is documented; a boolean's is
    also what `read` answers when the field is absent (the others read None)."""

    type: Literal["integer", "number", "boolean"]
    minimum: float | None = None
    exclusive_minimum: float | None = None
    maximum: float | None = None
    default: Any = None
    description: str | None = None

    def read(self, fields: Fields, name: str, maximum: float | None = None) -> Any:
        """The field's value (None when absent; a boolean's default), or the 4xx naming it.
        `maximum`: a tighter bound known only at run time (a setting)."""
        if self.type == "boolean":
            return fields.boolean(name, bool(self.default))
        hi = self.maximum if maximum is None else maximum
        if self.type == "integer":
            lo = None if self.minimum is None else int(self.minimum)
            return fields.integer(name, lo=lo, hi=math.inf if hi is None else hi)
        return fields.number(name, gt=self.exclusive_minimum, ge=self.minimum, le=hi)

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        for key, value in (("minimum", self.minimum), ("exclusiveMinimum", self.exclusive_minimum),
                           ("maximum", self.maximum), ("default", self.default),
                           ("description", self.description)):
            if value is not None:
                out[key] = value
        return out


@dataclass(frozen=True)
class Shaped:
    """A field with a structure of its own: the API's code checks it, `doc` is its documented schema."""

    doc: dict[str, Any]

    def schema(self) -> dict[str, Any]:
        return self.doc


@dataclass(frozen=True)
class Neutral:
    """A field the API defines that this server does not implement: accepted only at a value that
    means "off" (or null), any other is a 4xx naming it, since ignoring it would answer something
    the client did not ask for. No values: only null is accepted."""

    values: tuple[Any, ...]
    doc: dict[str, Any] = field(default_factory=dict)

    def schema(self) -> dict[str, Any]:
        shown = " or ".join(json.dumps(v) for v in self.values) or "null"
        return {**self.doc, "description": f"Not implemented: accepted only as {shown} (else a 4xx)."}


FieldEntry = Scalar | Shaped | Neutral


@dataclass(frozen=True)
class RequestFields:
    """One request body's (or nested object's) fields; `|` joins two tables (a shared part and an
    endpoint's own), the right one's entries winning."""

    fields: Mapping[str, FieldEntry]
    required: tuple[str, ...] = ()
    description: str | None = None

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.fields)

    def __or__(self, other: RequestFields) -> RequestFields:
        required = tuple(dict.fromkeys(self.required + other.required))
        return RequestFields({**self.fields, **other.fields}, required, other.description or self.description)

    def unknown(self, f: Fields, what: str, strict: bool) -> list[str]:
        """The body's fields this table does not know (gateway.validation.Fields.unknown's policy)."""
        return f.unknown(set(self.fields), what, strict)

    def check_neutral(self, f: Fields) -> None:
        """Every not-implemented field is absent or at a neutral value."""
        for name, entry in self.fields.items():
            if isinstance(entry, Neutral):
                f.unsupported_unless(name, entry.values)

    def read(self, f: Fields, name: str, maximum: float | None = None) -> Any:
        """A scalar field, checked by its entry."""
        entry = self.fields[name]
        assert isinstance(entry, Scalar), f"{name} is not a scalar field"
        return entry.read(f, name, maximum)

    def scalars(self) -> dict[str, Scalar]:
        return {name: entry for name, entry in self.fields.items() if isinstance(entry, Scalar)}

    def schema(self) -> dict[str, Any]:
        """The JSON Schema of the object, as /openapi.json serves it."""
        out: dict[str, Any] = {"type": "object"}
        if self.required:
            out["required"] = list(self.required)
        if self.description:
            out["description"] = self.description
        out["properties"] = {name: entry.schema() for name, entry in self.fields.items()}
        return out
