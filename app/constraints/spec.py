"""What a client asked the output to be, in no wire format's terms.

A ``ConstraintSpec`` is a kind and one source text (a schema as compact JSON in the client's key
order, a regex, the choices as a JSON list, a Lark grammar): equal constraints are equal keys of
the compile cache. A schema's keys keep their order because ``properties``' order is the order
the object's keys are generated in (as OpenAI's structured outputs write them: a "reasoning"
property before an "answer" one is written first; sorted keys wrote "answer" first, found by a
helper). ``grammar()`` turns it into the grammar
text llguidance compiles (https://github.com/guidance-ai/llguidance, docs/json_schema.md and
docs/syntax.md for what each kind accepts).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance

# JSON is written compactly but readably, and only so: a small model left free to add
# whitespace tends to write newlines forever (llguidance's default allows any amount).
JSON_FORMAT_OPTIONS: llguidance.JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class ConstraintError(ValueError):
    """A constraint that cannot be compiled; the message names the reason (one line where the
    compiler gives one: an unsupported keyword, a regex or grammar error)."""


class ConstraintKind(enum.Enum):
    JSON = "json"  # any one JSON object
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"  # Lark, as llguidance reads it


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """One constraint. Build it with the constructors (``json_schema``, ``regex``...).

    Attributes:
        kind: which language.
        source: its text (see the module doc).
        param: the request field it came from, for error messages (not part of equality).
    """

    kind: ConstraintKind
    source: str
    param: str = field(default="constraint", compare=False)

    @classmethod
    def json_object(cls, *, param: str = "constraint") -> ConstraintSpec:
        return cls(ConstraintKind.JSON, "", param)

    @classmethod
    def json_schema(
        cls, schema: dict[str, Any] | bool, *, param: str = "constraint"
    ) -> ConstraintSpec:
        return cls(ConstraintKind.JSON_SCHEMA, json.dumps(schema), param)

    @classmethod
    def regex(cls, pattern: str, *, param: str = "constraint") -> ConstraintSpec:
        return cls(ConstraintKind.REGEX, pattern, param)

    @classmethod
    def choice(cls, choices: Sequence[str], *, param: str = "constraint") -> ConstraintSpec:
        return cls(ConstraintKind.CHOICE, json.dumps(list(choices)), param)

    @classmethod
    def grammar(cls, lark: str, *, param: str = "constraint") -> ConstraintSpec:
        return cls(ConstraintKind.GRAMMAR, lark, param)

    def grammar_text(self) -> str:
        """The llguidance grammar of this constraint (not yet checked: the compiler does).

        Raises:
            ConstraintError: a schema that is not a JSON object or boolean.
        """
        kind = self.kind
        if kind is ConstraintKind.JSON:
            return _from_schema({"type": "object"})
        if kind is ConstraintKind.JSON_SCHEMA:
            return _from_schema(json.loads(self.source))
        if kind is ConstraintKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if kind is ConstraintKind.CHOICE:
            # JSON string literals are Lark string literals in llguidance's syntax.
            choices = json.loads(self.source)
            alternatives = " | ".join(json.dumps(choice) for choice in choices)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
        return llguidance.LLMatcher.grammar_from_lark(self.source)


def _from_schema(schema: Any) -> str:
    if schema is False:
        raise ConstraintError("the schema false allows no value")
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise ConstraintError("a JSON schema must be an object or a boolean")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT_OPTIONS)
    except ValueError as exc:
        raise ConstraintError(f"invalid JSON schema: {exc}") from None
