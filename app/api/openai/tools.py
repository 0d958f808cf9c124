"""Tools on ``/v1/chat/completions``: the wire fields (``tools``, ``tool_choice``,
``parallel_tool_calls``), what they ask of the generation, and the calls read back.

``ToolPlan`` is one request's decision, made once from its body:

* ``none``: the template is given the tools; free text, read back as content.
* ``auto`` (the default with tools): free text; ``<tool_call>{"name", "arguments"}</tool_call>``
  blocks (the Hermes/Qwen format) are read back as calls, the rest as content.
* ``required``: constrained to a JSON array of ``{"name", "arguments"}`` objects (one item
  unless ``parallel_tool_calls``), each one a call.
* a named function: constrained to that function's ``parameters``; one call whose arguments
  are the whole text.

``required`` and a named function are enforced by a JSON-schema constraint built from the
functions' parameter schemas (the approach vLLM takes for them), so they work with any model.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.constraints import ConstraintSpec

MAX_TOOLS = 128
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class FunctionBody(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def parameters_schema(self) -> dict[str, Any]:
        """Its parameters' JSON schema (no ``parameters``: a function without arguments)."""
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return self.parameters


class ToolBody(BaseModel):
    """One entry of ``tools``: a function the model may call."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function"]
    function: FunctionBody

    def template_value(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function: ``{"type": "function", "function": {"name"}}``."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function"]
    function: NamedFunction


ToolChoiceBody = Literal["none", "auto", "required"] | NamedToolChoice


class ToolMode(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call read from the output: ``arguments`` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def wire(self, index: int | None = None) -> dict[str, Any]:
        value: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return value if index is None else {"index": index, **value}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What one request's tools ask for (see the module doc).

    Attributes:
        mode: which row of the table.
        tools: the functions, as given.
        named: the function a NAMED plan calls.
        parallel: more than one call allowed (``parallel_tool_calls``, default true).
    """

    mode: ToolMode
    tools: tuple[ToolBody, ...]
    named: str | None = None
    parallel: bool = True

    def template_tools(self) -> tuple[dict[str, Any], ...]:
        return tuple(tool.template_value() for tool in self.tools)

    def constraint(self) -> ConstraintSpec | None:
        """The constraint of a REQUIRED or NAMED plan (None for NONE and AUTO)."""
        if self.mode is ToolMode.NAMED:
            (function,) = [t.function for t in self.tools if t.function.name == self.named]
            return ConstraintSpec.json_schema(function.parameters_schema(), param="tool_choice")
        if self.mode is ToolMode.REQUIRED:
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": tool.function.name},
                        "arguments": tool.function.parameters_schema(),
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for tool in self.tools
            ]
            array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
            if not self.parallel:
                array["maxItems"] = 1
            return ConstraintSpec.json_schema(array, param="tool_choice")
        return None

    def read_calls(self, text: str, call_id_prefix: str) -> tuple[list[ToolCall], str | None]:
        """The calls in a finished output and the content left beside them (None when the
        output is only calls). No calls found: ``([], text)``."""
        if self.mode is ToolMode.NAMED:
            return [ToolCall(f"{call_id_prefix}0", self.named or "", text)], None
        if self.mode is ToolMode.REQUIRED:
            try:
                calls = [
                    ToolCall(f"{call_id_prefix}{i}", item["name"], _compact(item["arguments"]))
                    for i, item in enumerate(json.loads(text))
                ]
            except (ValueError, TypeError, KeyError):  # cut short (a stop string): not calls
                return [], text
            return calls, None
        if self.mode is ToolMode.AUTO:
            return self._read_tagged(text, call_id_prefix)
        return [], text

    def _read_tagged(self, text: str, call_id_prefix: str) -> tuple[list[ToolCall], str | None]:
        known = {tool.function.name for tool in self.tools}
        calls: list[ToolCall] = []
        for block in _TOOL_CALL_BLOCK.findall(text):
            try:
                value = json.loads(block)
            except ValueError:
                continue
            if not isinstance(value, dict) or value.get("name") not in known:
                continue
            arguments = value.get("arguments", value.get("parameters", {}))
            calls.append(
                ToolCall(f"{call_id_prefix}{len(calls)}", value["name"], _compact(arguments))
            )
        if not calls:
            return [], text
        if not self.parallel:
            calls = calls[:1]
        rest = _TOOL_CALL_BLOCK.sub("", text).strip()
        return calls, rest or None


def tool_plan(
    tools: list[ToolBody] | None, choice: ToolChoiceBody | None, parallel: bool | None
) -> ToolPlan | None:
    """The plan of a body's tool fields (None without tools).

    Raises:
        ValueError: ``tool_choice`` names a function that is not in ``tools``, or asks for a
            call when there are no tools (the message says which).
    """
    if not tools:
        if choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return None
    parallel = True if parallel is None else parallel
    if isinstance(choice, NamedToolChoice):
        names = [tool.function.name for tool in tools]
        if choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        return ToolPlan(ToolMode.NAMED, tuple(tools), choice.function.name, parallel)
    mode = ToolMode(choice or "auto")
    return ToolPlan(mode, tuple(tools), None, parallel)


def _compact(arguments: Any) -> str:
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)
