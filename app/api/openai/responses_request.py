"""``POST /v1/responses``' request body: OpenAI's Responses API, stateless, on the native
request path (the answer is :mod:`app.api.openai.responses_answer`'s).

The body (``ResponsesRequestBody``) becomes ``GenerationParams`` like a chat's: ``instructions``
as a system turn, ``input`` (a string or message / ``function_call`` / ``function_call_output``
items) as the conversation, ``text.format`` as a constraint (``json_schema`` / ``json_object``),
function ``tools`` and ``tool_choice`` as ``app.api.openai.tools``' plan; ``reasoning`` items
(an earlier answer's output sent back) are accepted and not rendered again. Nothing is stored:
``store: true``, ``previous_response_id`` and ``background: true`` are 400s naming the field, as
are the fields asking for what the answer does not hold (``top_logprobs``, ``include``,
``truncation: auto``). The /v1 extensions are taken here too (``seed``, ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``constraint``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from app.api.constraint_body import ConstraintBody
from app.api.openai.tools import (
    MAX_TOOLS,
    FunctionBody,
    NamedFunction,
    NamedToolChoice,
    ToolBody,
    ToolPlan,
    tool_plan,
)
from app.api.request_builder import ChatPrompt, GenerationParams, TokenBudget
from app.api.schemas import SEED_LIMIT
from app.constraints import ConstraintSpec
from app.engine.chat_template import ChatMessage, ToolCallTurn

# Fields of OpenAI's this server cannot honour -> why; each is a 400 naming it unless it asks
# for nothing (None, False, 0 or [], or its value in _OFF).
_REFUSED = {
    "store": "this server is stateless: store must be false",
    "previous_response_id": "this server is stateless: send the whole conversation as input",
    "background": "this server is stateless: background must be false",
    "top_logprobs": "logprobs are not answered on /v1/responses: use /v1/chat/completions",
    "include": "no extra output can be included",
    "truncation": "input is never truncated: truncation must be disabled (a longer input is a 400)",
}
_OFF: dict[str, tuple[Any, ...]] = {"truncation": ("disabled",)}


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", message)


class InputText(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(BaseModel):
    """A turn of ``input``: ``content`` a string or text parts."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    """A call the model made earlier, sent back with its output."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(BaseModel):
    """An earlier turn's reasoning, as this server's answers return it (``type: reasoning``):
    accepted so that an answer's ``output`` can be sent back as the next turn's input, and not
    rendered again (a model's chat template drops earlier turns' reasoning too)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["reasoning"]


InputItem = FunctionCallItem | FunctionCallOutputItem | ReasoningItem | MessageItem


class FunctionTool(BaseModel):
    """A function tool in the Responses shape (flat: ``name``, ``parameters`` at the top)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_tool(self) -> ToolBody:
        function = FunctionBody(
            name=self.name, description=self.description, parameters=self.parameters
        )
        return ToolBody(type="function", function=function)


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("missing", "schema is required for json_schema")
        return self

    def spec(self) -> ConstraintSpec | None:
        if self.type == "json_object":
            return ConstraintSpec.json_object(param="text.format")
        if self.type == "json_schema":
            return ConstraintSpec.json_schema(self.json_schema, param="text.format")
        return None

    def wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    format: TextFormat | None = None


class ResponsesRequestBody(BaseModel):
    """Body of ``POST /v1/responses`` (see the module doc); an unknown field is a 400 naming it,
    as on the other /v1 routes."""

    model_config = ConfigDict(extra="allow", strict=True)
    tolerated_fields: ClassVar[dict[str, tuple[Any, ...]]] = {}  # none: every other is a 400

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None  # accepted and ignored, as the next three
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # more fields of OpenAI's this server cannot honour (_REFUSED)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # extensions, as on the other /v1 routes (API.md)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0, allow_inf_nan=False)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    constraint: ConstraintBody | None = None

    @field_validator(*_REFUSED)
    @classmethod
    def _refused_when_asked_for(cls, value: Any, info: ValidationInfo) -> Any:
        """Each field of ``_REFUSED`` is a 400 naming it when it asks for what this server
        does not do (a value other than its off value)."""
        if value not in (None, False, [], *_OFF.get(info.field_name or "", ())):
            raise PydanticCustomError("unsupported_value", _REFUSED[info.field_name or ""])
        return value

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list[InputItem]) -> str | list[InputItem]:
        if not value:
            raise _invalid("input must not be empty")
        return value

    @model_validator(mode="after")
    def _tools_consistent(self) -> ResponsesRequestBody:
        try:
            plan = self.tool_plan
        except ValueError as exc:
            raise _invalid(str(exc)) from None
        forced = plan is not None and plan.constraint() is not None
        if forced and self._format_spec():
            raise _invalid("tool_choice required or named cannot be combined with text.format")
        if self.constraint is not None and (forced or self._format_spec()):
            raise _invalid("give either constraint or text.format / a required tool, not both")
        return self

    @property
    def streamed(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return True

    @property
    def tool_plan(self) -> ToolPlan | None:
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        tools = None if self.tools is None else [tool.as_tool() for tool in self.tools]
        return tool_plan(tools, choice, self.parallel_tool_calls)

    def _format_spec(self) -> ConstraintSpec | None:
        if self.text is None or self.text.format is None:
            return None
        return self.text.format.spec()

    def generation_params(self) -> GenerationParams:
        plan = self.tool_plan
        constraint = self._format_spec() or (None if plan is None else plan.constraint())
        if self.constraint is not None:
            constraint = self.constraint.spec("constraint")
        prompt = ChatPrompt(
            self._turns(),
            param="input",
            tools=() if plan is None else plan.template_tools(),
        )
        return GenerationParams(
            prompt=prompt,
            budget=TokenBudget(self.max_output_tokens, "max_output_tokens"),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_tokens=self.min_tokens or 0,
            ignore_eos=bool(self.ignore_eos),
            seed=self.seed,
            constraint=constraint,
        )

    def _turns(self) -> tuple[ChatMessage, ...]:
        turns: list[ChatMessage] = []
        if self.instructions:
            turns.append(ChatMessage("system", self.instructions))
        if isinstance(self.input, str):
            return (*turns, ChatMessage("user", self.input))
        for item in self.input:
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                turns.append(ChatMessage(role, item.text()))
            elif isinstance(item, ReasoningItem):
                continue  # an earlier turn's reasoning is not rendered again
            elif isinstance(item, FunctionCallItem):
                call = ToolCallTurn(item.call_id, item.name, item.arguments)
                previous = turns[-1] if turns else None
                if previous is not None and previous.role == "assistant":
                    turns[-1] = ChatMessage(
                        "assistant", previous.content, (*previous.tool_calls, call)
                    )
                else:
                    turns.append(ChatMessage("assistant", "", (call,)))
            else:
                turns.append(ChatMessage("tool", item.output, tool_call_id=item.call_id))
        return tuple(turns)
