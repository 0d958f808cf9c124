"""The JSON-schema corpus of structured output: 32 schemas a client might send, each with a prompt
that asks for it. Used by tests/constraints (every answer validates) and by
``scripts/bench_structured.py`` (compile time, constrained vs free tok/s).

Covers nested objects, arrays with min/max items, enums and consts, numbers with bounds,
optional and required properties, ``anyOf``/``oneOf``, ``$ref``/``$defs``, string lengths,
patterns and formats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class SchemaCase:
    name: str
    prompt: str
    schema: dict[str, Any]


def _obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


_NAME = {"type": "string", "minLength": 1, "maxLength": 24}

SCHEMA_CORPUS: tuple[SchemaCase, ...] = (
    SchemaCase(
        "person",
        "Describe a person as JSON.",
        _obj({"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    ),
    SchemaCase("boolean", "Is water wet? Answer in JSON.", _obj({"answer": {"type": "boolean"}})),
    SchemaCase(
        "enum-color", "Pick a color, as JSON.", _obj({"color": {"enum": ["red", "green", "blue"]}})
    ),
    SchemaCase("const", "Say hello in JSON.", _obj({"greeting": {"const": "hello"}, "to": _NAME})),
    SchemaCase(
        "number-bounds",
        "Give a temperature reading as JSON.",
        _obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}}),
    ),
    SchemaCase(
        "exclusive-bounds",
        "Give a probability as JSON.",
        _obj({"p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}),
    ),
    SchemaCase(
        "integer-range",
        "Roll a die, as JSON.",
        _obj({"roll": {"type": "integer", "minimum": 1, "maximum": 6}}),
    ),
    SchemaCase(
        "array-min-max",
        "List two or three fruits as JSON.",
        _obj(
            {
                "fruits": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 12},
                    "minItems": 2,
                    "maxItems": 3,
                }
            }
        ),
    ),
    SchemaCase(
        "array-of-ints",
        "List a few small prime numbers in JSON.",
        _obj(
            {
                "primes": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 2, "maximum": 99},
                    "minItems": 1,
                    "maxItems": 5,
                }
            }
        ),
    ),
    SchemaCase(
        "top-level-array",
        "Give a JSON array of two city names.",
        {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "minItems": 2,
            "maxItems": 2,
        },
    ),
    SchemaCase(
        "nested-object",
        "Describe a book with its author, as JSON.",
        _obj({"title": _NAME, "author": _obj({"first": _NAME, "last": _NAME})}),
    ),
    SchemaCase(
        "deeply-nested",
        "Describe a company's address as JSON.",
        _obj(
            {
                "company": _obj(
                    {
                        "address": _obj(
                            {"city": _NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}
                        )
                    }
                )
            }
        ),
    ),
    SchemaCase(
        "optional-property",
        "Describe a pet as JSON.",
        _obj(
            {
                "species": _NAME,
                "name": _NAME,
                "age": {"type": "integer", "minimum": 0, "maximum": 30},
            },
            required=["species"],
        ),
    ),
    SchemaCase(
        "all-optional",
        "Give some settings as JSON.",
        _obj(
            {
                "dark_mode": {"type": "boolean"},
                "font_size": {"type": "integer", "minimum": 8, "maximum": 32},
            },
            required=[],
        ),
    ),
    SchemaCase(
        "any-of",
        "Give an id, either a number or a string, as JSON.",
        _obj(
            {
                "id": {
                    "anyOf": [
                        {"type": "integer", "minimum": 0, "maximum": 9999},
                        {"type": "string", "maxLength": 8},
                    ]
                }
            }
        ),
    ),
    SchemaCase(
        "one-of-objects",
        "Describe a shape as JSON.",
        _obj(
            {
                "shape": {
                    "oneOf": [
                        _obj(
                            {
                                "kind": {"const": "circle"},
                                "radius": {"type": "number", "minimum": 0, "maximum": 100},
                            }
                        ),
                        _obj(
                            {
                                "kind": {"const": "square"},
                                "side": {"type": "number", "minimum": 0, "maximum": 100},
                            }
                        ),
                    ]
                }
            }
        ),
    ),
    SchemaCase(
        "nullable",
        "Give a middle name or null, as JSON.",
        _obj({"middle_name": {"type": ["string", "null"], "maxLength": 16}}),
    ),
    SchemaCase(
        "string-pattern",
        "Give a product code like AB-123 as JSON.",
        _obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
    ),
    SchemaCase(
        "phone-pattern",
        "Give a phone number as JSON.",
        _obj({"phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}}),
    ),
    SchemaCase(
        "format-date",
        "When is the next holiday? JSON with a date.",
        _obj({"date": {"type": "string", "format": "date"}}),
    ),
    SchemaCase(
        "format-email",
        "Give a contact email as JSON.",
        _obj({"email": {"type": "string", "format": "email"}}),
    ),
    SchemaCase(
        "format-uuid",
        "Make up a request id as JSON.",
        _obj({"request_id": {"type": "string", "format": "uuid"}}),
    ),
    SchemaCase(
        "format-time",
        "What time is lunch? JSON please.",
        _obj({"time": {"type": "string", "format": "time"}}),
    ),
    SchemaCase(
        "format-ipv4",
        "Give a server address as JSON.",
        _obj({"ip": {"type": "string", "format": "ipv4"}}),
    ),
    SchemaCase(
        "string-length",
        "Give a three-letter code as JSON.",
        _obj({"code": {"type": "string", "minLength": 3, "maxLength": 3}}),
    ),
    SchemaCase(
        "array-of-objects",
        "List one or two users as JSON.",
        _obj(
            {
                "users": {
                    "type": "array",
                    "items": _obj({"name": _NAME, "admin": {"type": "boolean"}}),
                    "minItems": 1,
                    "maxItems": 2,
                }
            }
        ),
    ),
    SchemaCase(
        "refs",
        "Give two points as JSON.",
        {
            "$defs": {
                "point": _obj(
                    {
                        "x": {"type": "integer", "minimum": -9, "maximum": 9},
                        "y": {"type": "integer", "minimum": -9, "maximum": 9},
                    }
                )
            },
            **_obj({"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}),
        },
    ),
    SchemaCase(
        "enum-integers", "Pick a priority as JSON.", _obj({"priority": {"enum": [1, 2, 3]}})
    ),
    SchemaCase(
        "mixed-enum", "Give a status as JSON.", _obj({"status": {"enum": ["ok", "error", None, 0]}})
    ),
    SchemaCase(
        "all-of", "Describe an employee as JSON.", {"allOf": [_obj({"name": _NAME, "team": _NAME})]}
    ),
    SchemaCase(
        "unique-small-array",
        "Give tags for a photo, as JSON.",
        _obj({"tags": {"type": "array", "items": {"enum": ["sun", "sea", "sand"]}, "maxItems": 3}}),
    ),
    SchemaCase(
        "weather",
        "Report the weather in Paris as JSON.",
        _obj(
            {
                "city": _NAME,
                "forecast": {"enum": ["sunny", "rainy", "cloudy"]},
                "high": {"type": "integer", "minimum": -30, "maximum": 50},
                "wind_kmh": {"type": "number", "minimum": 0, "maximum": 200},
            }
        ),
    ),
)
