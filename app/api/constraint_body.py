"""The ``constraint`` field (API.md, "Constrained output"), as the native API and the ``/v1``
extension (``extra_body``) take it: one JSON object whose ``type`` says which language.

Each body becomes a wire-neutral ``ConstraintSpec`` (``spec()``); whether it compiles is the
request builder's check (a 422 naming the reason).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.constraints import ConstraintSpec

MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 4096


class _ConstraintBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class JsonConstraint(_ConstraintBody):
    """Any one JSON object."""

    type: Literal["json"]

    def spec(self, param: str) -> ConstraintSpec:
        return ConstraintSpec.json_object(param=param)


class JsonSchemaConstraint(_ConstraintBody):
    """One JSON value valid against ``schema`` (a draft 2020-12 subset; an unsupported
    keyword is refused by name)."""

    type: Literal["json_schema"]
    json_schema: dict[str, Any] | bool = Field(alias="schema")

    def spec(self, param: str) -> ConstraintSpec:
        return ConstraintSpec.json_schema(self.json_schema, param=param)


class RegexConstraint(_ConstraintBody):
    """A full match of ``pattern`` (Rust ``regex`` syntax, as llguidance reads it)."""

    type: Literal["regex"]
    pattern: str = Field(min_length=1)

    def spec(self, param: str) -> ConstraintSpec:
        return ConstraintSpec.regex(self.pattern, param=param)


class ChoiceConstraint(_ConstraintBody):
    """Exactly one of ``choices``."""

    type: Literal["choice"]
    choices: list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]] = Field(
        min_length=1, max_length=MAX_CHOICES
    )

    def spec(self, param: str) -> ConstraintSpec:
        return ConstraintSpec.choice(self.choices, param=param)


class GrammarConstraint(_ConstraintBody):
    """A sentence of a Lark grammar (llguidance's syntax)."""

    type: Literal["grammar"]
    grammar: str = Field(min_length=1)

    def spec(self, param: str) -> ConstraintSpec:
        return ConstraintSpec.grammar(self.grammar, param=param)


ConstraintBody = Annotated[
    JsonConstraint | JsonSchemaConstraint | RegexConstraint | ChoiceConstraint | GrammarConstraint,
    Field(discriminator="type"),
]
