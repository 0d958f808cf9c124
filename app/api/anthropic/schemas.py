"""Request bodies of Anthropic's Messages API: validation happens here, once, and a body
becomes the wire-neutral ``GenerationParams`` (``generation_params()``), as /v1's do.

A conversation becomes chat-template turns: ``system`` a system turn; a user message's
``tool_result`` blocks ``tool`` turns (answering their ``tool_use_id``) before its text; an
assistant message's ``tool_use`` blocks the calls of its turn (``thinking`` blocks of earlier
turns are not sent back to the model). ``tools`` (``name``, ``description``, ``input_schema``)
and ``tool_choice`` become /v1's ``ToolPlan``: ``auto``, ``any`` (a required call), ``tool``
(a named one), ``none``; ``any`` and ``tool`` are enforced by constrained decoding.
``thinking`` is passed to the template as ``enable_thinking``. A last assistant message with
text is a prefill: the model continues it, and the answer holds only what follows (as
Anthropic's API answers it). Unknown fields are accepted and ignored (agents send fields of
newer API versions); a content block this server cannot read (an image, a document) is a 400.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

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
from app.api.schemas import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from app.engine.chat_template import ChatMessage, ToolCallTurn

StopSequence = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


class _Block(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    """A call an earlier assistant turn made."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    """The result of a call, sent in the next user turn."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(block.text for block in self.content)


class ThinkingBlock(_Block):
    """An earlier turn's reasoning (not rendered again)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def turns(self) -> list[ChatMessage]:
        """The chat-template turns of this message (see the module doc)."""
        if isinstance(self.content, str):
            return [ChatMessage(self.role, self.content)]
        texts = [block.text for block in self.content if isinstance(block, TextBlock)]
        if self.role == "assistant":
            calls = tuple(
                ToolCallTurn(block.id, block.name, json.dumps(block.input, ensure_ascii=False))
                for block in self.content
                if isinstance(block, ToolUseBlock)
            )
            return [ChatMessage("assistant", "\n".join(texts), calls)]
        turns = [
            ChatMessage("tool", block.text(), tool_call_id=block.tool_use_id)
            for block in self.content
            if isinstance(block, ToolResultBlock)
        ]
        if texts or not turns:
            turns.append(ChatMessage("user", "\n".join(texts)))
        return turns

    @model_validator(mode="after")
    def _blocks_where_they_belong(self) -> MessageParam:
        blocks = [] if isinstance(self.content, str) else self.content
        if self.role == "user" and any(isinstance(b, ToolUseBlock) for b in blocks):
            raise PydanticCustomError("invalid_value", "tool_use blocks belong to assistant turns")
        if self.role == "assistant" and any(isinstance(b, ToolResultBlock) for b in blocks):
            raise PydanticCustomError("invalid_value", "tool_result blocks belong to user turns")
        return self


class ToolParam(BaseModel):
    """A client tool: ``input_schema`` is the JSON schema of its input."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    description: str | None = None
    input_schema: dict[str, Any]

    def as_tool(self) -> ToolBody:
        function = FunctionBody(
            name=self.name, description=self.description, parameters=self.input_schema
        )
        return ToolBody(type="function", function=function)


class ToolChoiceParam(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _tool_names_one(self) -> ToolChoiceParam:
        if self.type == "tool" and not self.name:
            raise PydanticCustomError("missing", "tool_choice of type tool needs a name")
        return self


class ThinkingParam(BaseModel):
    """``{"type": "enabled", "budget_tokens": N}`` or ``{"type": "disabled"}``."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class MessagesBase(BaseModel):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` both take: the conversation. An
    unknown field is a 400 naming it, as Anthropic's API answers one ("Extra inputs are not
    permitted"), not ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="ignored: the server has one model")
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None

    @model_validator(mode="after")
    def _choice_among_tools(self) -> MessagesBase:
        names = [tool.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise PydanticCustomError("invalid_value", "tools: Tool names must be unique.")
        try:
            self.tool_plan  # noqa: B018 (checks the choice against the tools)
        except ValueError as exc:
            raise PydanticCustomError("invalid_value", str(exc)) from None
        return self

    @model_validator(mode="after")
    def _results_answer_calls(self) -> MessagesBase:
        """Every message but a final assistant one has content, and each ``tool_result``
        answers a ``tool_use`` of the message before it (Anthropic's rules and wording)."""
        last = len(self.messages) - 1
        for index, message in enumerate(self.messages):
            if not message.content and not (index == last and message.role == "assistant"):
                raise PydanticCustomError(
                    "invalid_value",
                    f"messages.{index}: all messages must have non-empty content except for "
                    "the optional final assistant message",
                )
            previous = self.messages[index - 1].content if index else ""
            calls = (
                set()
                if isinstance(previous, str)
                else {block.id for block in previous if isinstance(block, ToolUseBlock)}
            )
            blocks = () if isinstance(message.content, str) else message.content
            for at, block in enumerate(blocks):
                if isinstance(block, ToolResultBlock) and block.tool_use_id not in calls:
                    raise PydanticCustomError(
                        "invalid_value",
                        f"messages.{index}.content.{at}: unexpected `tool_use_id` found in "
                        f"`tool_result` blocks: {block.tool_use_id}. Each `tool_result` block "
                        "must have a corresponding `tool_use` block in the previous message.",
                    )
        return self

    @property
    def tool_plan(self) -> ToolPlan | None:
        """/v1's plan of the tool fields (None without tools).

        Raises:
            ValueError: ``tool_choice`` asks for a call without tools, or names an unknown one.
        """
        choice = self.tool_choice
        tools = None if self.tools is None else [tool.as_tool() for tool in self.tools]
        if choice is None:
            return tool_plan(tools, None, None)
        parallel = not choice.disable_parallel_tool_use
        if choice.type == "tool":
            named = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
            return tool_plan(tools, named, parallel)
        return tool_plan(tools, "required" if choice.type == "any" else choice.type, parallel)

    def chat_prompt(self) -> ChatPrompt:
        """The conversation as the chat template's turns, the tools, ``enable_thinking``."""
        turns: list[ChatMessage] = []
        if self.system:
            system = self.system
            if not isinstance(system, str):
                system = "\n".join(block.text for block in system)
            turns.append(ChatMessage("system", system))
        for message in self.messages:
            turns.extend(message.turns())
        plan = self.tool_plan
        template_kwargs = None
        if self.thinking is not None:
            template_kwargs = {"enable_thinking": self.thinking.type != "disabled"}
        final = turns[-1] if turns else None
        return ChatPrompt(
            tuple(turns),
            tools=() if plan is None else plan.template_tools(),
            template_kwargs=template_kwargs,
            continue_final_message=final is not None and _prefill(final),
        )


def _prefill(turn: ChatMessage) -> bool:
    """Whether the conversation's last turn is an assistant prefill, which Anthropic's API
    continues rather than answers (the answer's content starts where it stops): an assistant
    turn with text and no tool calls."""
    return turn.role == "assistant" and not turn.tool_calls and bool(turn.content.strip())


class MessagesRequestBody(MessagesBase):
    """Body of ``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[StopSequence] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = Field(None, description="accepted and ignored")
    service_tier: str | None = Field(None, description="accepted and ignored")
    stream: bool | None = None

    def generation_params(self) -> GenerationParams:
        plan = self.tool_plan
        return GenerationParams(
            prompt=self.chat_prompt(),
            budget=TokenBudget(self.max_tokens, "max_tokens"),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            stop=tuple(self.stop_sequences),
            constraint=None if plan is None else plan.constraint(),
        )


class CountTokensRequestBody(MessagesBase):
    """Body of ``POST /v1/messages/count_tokens``: the conversation alone."""

    def generation_params(self) -> GenerationParams:
        """The prompt, with no tokens to generate."""
        return GenerationParams(prompt=self.chat_prompt(), budget=TokenBudget(0, "max_tokens"))
