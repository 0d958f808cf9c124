"""Wire pieces the /v1 bodies share: the chat message (``ChatMessageBody``, with the tool
calls an assistant turn made), how a field refuses or documents what it takes, and the fields
outside a body that are tolerated at the values this server follows anyway."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

from app.engine.chat_template import ChatMessage, ToolCallTurn

# Fields of vLLM's and SGLang's request bodies that these routes do not take, each with the values
# that ask for what this server does anyway. vllm-router forwards every /v1 request re-serialised
# with some of them set: completions ``echo``, ``no_stop_trim``, ``skip_special_tokens``,
# ``return_hidden_states``; chat also ``continue_final_message``, ``separate_reasoning``,
# ``stream_reasoning``, ``include_reasoning`` (captured behind vllm-router 0.1.17). Such a field
# at another value, and any field outside the body and this table, is a 400 naming it
# (``extra_field_error``); null is accepted for every field (it asks for nothing).
TOLERATED_FIELDS: dict[str, tuple[Any, ...]] = {
    "echo": (False,),  # chat (completions takes it)
    "no_stop_trim": (False,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "return_hidden_states": (False,),
    "continue_final_message": (False,),
    "add_generation_prompt": (True,),
    "separate_reasoning": (True,),
    "stream_reasoning": (True,),
    "include_reasoning": (True,),
    "use_beam_search": (False,),
    "bad_words": ([],),
    "allowed_token_ids": ([],),
}


def extra_field_error(
    extra: dict[str, Any], tolerated: Mapping[str, tuple[Any, ...]]
) -> ValidationError | None:
    """The 400 of the first field of ``extra`` (a body's fields outside its schema) that asks
    for something: unknown (``extra_forbidden``, OpenAI's ``unknown_parameter``), or a field of
    ``tolerated`` at a value other than its own (``unsupported_value``); None when every one is
    null or tolerated at its value."""
    for name, value in extra.items():
        if value is None or (name in tolerated and value in tolerated[name]):
            continue
        if name in tolerated:
            kind: Any = unsupported(f"{name} other than {tolerated[name][0]!r} is not supported")
        else:
            kind = "extra_forbidden"
        detail: InitErrorDetails = {"type": kind, "loc": (name,), "input": value}
        return ValidationError.from_exception_data("request body", [detail])
    return None


def unsupported(message: str) -> PydanticCustomError:
    """The error of an OpenAI feature this server does not have (``unsupported_value``)."""
    return PydanticCustomError("unsupported_value", message)


def accepts(*alternatives: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    """A field's JSON schema, for fields whose ``before`` validator takes more shapes than the
    type they become (``stop``: a string or a list)."""

    def document(schema: dict[str, Any]) -> None:
        description = schema.get("description")
        schema.clear()
        schema["anyOf"] = list(alternatives)
        if description:
            schema["description"] = description

    return document


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str
    arguments: str


class AssistantToolCall(BaseModel):
    """A call an earlier assistant turn made (sent back with the tool's result)."""

    model_config = ConfigDict(extra="allow", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessageBody(BaseModel):
    """One message. ``content`` is a string or a list of text parts (joined with newlines);
    ``developer`` is OpenAI's newer name for ``system``."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str = Field(
        "",
        json_schema_extra=accepts(
            {"type": "string"},
            {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                    "required": ["type", "text"],
                },
            },
        ),
    )
    name: str | None = Field(None, description="accepted and ignored")
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields_where_they_belong(self) -> ChatMessageBody:
        if self.role != "assistant" and "content" not in self.model_fields_set:
            raise PydanticCustomError("missing", "content is required for this role")
        if self.role == "assistant" and "content" not in self.model_fields_set:
            if not self.tool_calls:
                raise PydanticCustomError("missing", "content or tool_calls is required")
        if self.role == "tool" and not self.tool_call_id:
            raise PydanticCustomError("missing", "a tool message needs its tool_call_id")
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("invalid_value", "only an assistant message has tool_calls")
        return self

    def turn(self) -> ChatMessage:
        """The turn as the chat template reads it (``developer`` rendered as ``system``)."""
        return ChatMessage(
            role="system" if self.role == "developer" else self.role,
            content=self.content,
            tool_calls=tuple(
                ToolCallTurn(call.id, call.function.name, call.function.arguments)
                for call in self.tool_calls or ()
            ),
            tool_call_id=self.tool_call_id,
        )

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_joined(cls, content: Any) -> Any:
        if content is None:
            return ""  # an assistant turn that only made tool calls
        if not isinstance(content, list):
            return content
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise unsupported("only text content parts are supported")
            texts.append(part.get("text"))
        if not all(isinstance(text, str) for text in texts):
            raise PydanticCustomError("invalid_value", "a text part needs a string 'text'")
        return "\n".join(texts)
