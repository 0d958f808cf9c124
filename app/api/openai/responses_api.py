"""``POST /v1/responses``: OpenAI's Responses API, stateless, on the native request path.

The body (``ResponsesRequestBody``) becomes ``GenerationParams`` like a chat's: ``instructions``
as a system turn, ``input`` (a string or message / ``function_call`` / ``function_call_output``
items) as the conversation, ``text.format`` as a constraint (``json_schema`` / ``json_object``),
function ``tools`` and ``tool_choice`` as ``app.api.openai.tools``' plan. Nothing is stored:
``store: true`` and ``previous_response_id`` are 400s naming the field.

The answer (``ResponsesAnswer``) is a ``response`` object; streamed, OpenAI's typed events with
increasing ``sequence_number``::

    response.created, response.in_progress,
    a text answer: response.output_item.added (message), response.content_part.added,
        response.output_text.delta ..., response.output_text.done, response.content_part.done,
        response.output_item.done
    tool calls (read whole, at the end): per call response.output_item.added (function_call),
        response.function_call_arguments.delta, response.function_call_arguments.done,
        response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut it)

A failure after the stream began is an ``error`` event. Ids: ``resp_<request id>`` (the native
request id, so ``DELETE /generate/{id}`` cancels it), ``msg_...``, ``fc_...``.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError
from sse_starlette import ServerSentEvent

from app.api.answers import finish_reason_name
from app.api.errors import APIError
from app.api.openai.answers import SSE_LINE_END
from app.api.openai.tools import (
    MAX_TOOLS,
    FunctionBody,
    NamedFunction,
    NamedToolChoice,
    ToolBody,
    ToolCall,
    ToolMode,
    ToolPlan,
    tool_plan,
)
from app.api.request_builder import ChatPrompt, GenerationParams, TokenBudget
from app.api.schemas import SEED_LIMIT
from app.constraints import ConstraintSpec
from app.engine.chat_template import ChatMessage, ToolCallTurn
from app.engine.request import FinalEvent, FinishReason, TokenEvent


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


InputItem = FunctionCallItem | FunctionCallOutputItem | MessageItem


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
    """Body of ``POST /v1/responses`` (see the module doc)."""

    model_config = ConfigDict(extra="allow", strict=True)

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
    metadata: dict[str, str] | None = None
    user: str | None = None
    # extensions, as on the other /v1 routes
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    top_k: int | None = Field(None, ge=0)

    @field_validator("store")
    @classmethod
    def _nothing_stored(cls, store: bool | None) -> bool | None:
        if store:
            raise PydanticCustomError(
                "unsupported_value", "this server is stateless: store must be false"
            )
        return store

    @field_validator("previous_response_id")
    @classmethod
    def _no_previous(cls, previous: str | None) -> str | None:
        if previous is not None:
            raise PydanticCustomError(
                "unsupported_value",
                "this server is stateless: send the whole conversation as input",
            )
        return previous

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
        if plan is not None and plan.constraint() is not None and self._format_spec():
            raise _invalid("tool_choice required or named cannot be combined with text.format")
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


class ResponsesAnswer:
    """The Responses API's answer to one request (an ``AnswerFormat``). Not shared between
    requests: it numbers the events of its one stream (``sequence_number``).

    Args:
        request_id: the native request id. created: Unix seconds. model: the served model.
        body: the request (echoed: instructions, tools, sampling, text format).
    """

    sse_separator: str | None = SSE_LINE_END

    def __init__(
        self, *, request_id: str, created: int, model: str, body: ResponsesRequestBody
    ) -> None:
        self.id = f"resp_{request_id}"
        self._request_id = request_id
        self._created = created
        self._model = model
        self._body = body
        self._plan = body.tool_plan
        self._sequence = itertools.count()

    # ----------------------------------------------------------------- AnswerFormat

    def response(self, final: FinalEvent) -> dict[str, object]:
        return self._response(final)

    def opening(self) -> Iterable[ServerSentEvent]:
        yield self._event("response.created", response=self._response(None))
        yield self._event("response.in_progress", response=self._response(None))
        if self._streams_text:
            yield self._event(
                "response.output_item.added", output_index=0, item=self._message("", "in_progress")
            )
            yield self._event(
                "response.content_part.added",
                item_id=self._message_id,
                output_index=0,
                content_index=0,
                part=_output_text(""),
            )

    def token(self, event: TokenEvent) -> Iterable[ServerSentEvent]:
        if event.text and self._streams_text:
            yield self._event(
                "response.output_text.delta",
                item_id=self._message_id,
                output_index=0,
                content_index=0,
                delta=event.text,
                logprobs=[],
            )

    def final(self, final: FinalEvent) -> Iterable[ServerSentEvent]:
        items, calls, text = self._output(final)
        if self._streams_text:
            yield from self._text_done(final, text)
        else:
            for index, item in enumerate(items):
                yield from self._item_whole(index, item)
        kind = "response.completed" if self._status(final) == "completed" else "response.incomplete"
        yield self._event(kind, response=self._response(final))

    def failure(self, error: APIError) -> Iterable[ServerSentEvent]:
        yield self._event("error", code=error.type, message=error.message, param=error.param)

    def closing(self) -> Iterable[ServerSentEvent]:
        return ()

    # ----------------------------------------------------------------- the pieces

    @property
    def _streams_text(self) -> bool:
        """Text goes out as it is made; tool answers are read whole at the end."""
        return self._plan is None or self._plan.mode is ToolMode.NONE

    @property
    def _message_id(self) -> str:
        return f"msg_{self._request_id}"

    def _text_done(self, final: FinalEvent, text: str) -> Iterator[ServerSentEvent]:
        status = "completed" if self._status(final) == "completed" else "incomplete"
        common = {"item_id": self._message_id, "output_index": 0, "content_index": 0}
        yield self._event("response.output_text.done", **common, text=text, logprobs=[])
        yield self._event("response.content_part.done", **common, part=_output_text(text))
        yield self._event(
            "response.output_item.done", output_index=0, item=self._message(text, status)
        )

    def _item_whole(self, index: int, item: dict[str, Any]) -> Iterator[ServerSentEvent]:
        if item["type"] == "message":
            text = item["content"][0]["text"]
            yield self._event(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "content": []},
            )
            common = {"item_id": item["id"], "output_index": index, "content_index": 0}
            yield self._event("response.content_part.added", **common, part=_output_text(""))
            yield self._event("response.output_text.delta", **common, delta=text, logprobs=[])
            yield self._event("response.output_text.done", **common, text=text, logprobs=[])
            yield self._event("response.content_part.done", **common, part=_output_text(text))
        else:
            yield self._event(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            )
            common = {"item_id": item["id"], "output_index": index}
            yield self._event(
                "response.function_call_arguments.delta", **common, delta=item["arguments"]
            )
            yield self._event(
                "response.function_call_arguments.done",
                **common,
                name=item["name"],
                arguments=item["arguments"],
            )
        yield self._event("response.output_item.done", output_index=index, item=item)

    def _output(self, final: FinalEvent) -> tuple[list[dict[str, Any]], list[ToolCall], str]:
        """The output items of a finished request, its calls and its text."""
        calls: list[ToolCall] = []
        text: str | None = final.text
        cut = final.finish_reason is not FinishReason.STOP
        if self._plan is not None and not (cut and self._plan.mode is ToolMode.REQUIRED):
            calls, text = self._plan.read_calls(final.text, f"call_{self._request_id}_")
        status = "completed" if self._status(final) == "completed" else "incomplete"
        items: list[dict[str, Any]] = []
        if text or not calls:
            items.append(self._message(text or "", status))
        for index, call in enumerate(calls):
            items.append(
                {
                    "id": f"fc_{self._request_id}_{index}",
                    "type": "function_call",
                    "call_id": call.id,
                    "name": call.name,
                    "arguments": call.arguments,
                    "status": "completed",
                }
            )
        return items, calls, text or ""

    def _message(self, text: str, status: str) -> dict[str, Any]:
        return {
            "id": self._message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [_output_text(text)] if text or status != "in_progress" else [],
        }

    def _status(self, final: FinalEvent) -> str:
        return "completed" if final.finish_reason is FinishReason.STOP else "incomplete"

    def _response(self, final: FinalEvent | None) -> dict[str, Any]:
        body = self._body
        fmt = body.text.format if body.text is not None and body.text.format else None
        tool_choice: Any = body.tool_choice or ("auto" if body.tools else "none")
        if isinstance(tool_choice, FunctionChoice):
            tool_choice = tool_choice.model_dump()
        value: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self._created,
            "model": self._model,
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "store": False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "text": {"format": fmt.wire() if fmt is not None else {"type": "text"}},
            "tool_choice": tool_choice,
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "truncation": "disabled",
            "usage": None,
            "user": body.user,
        }
        if final is None:
            return value
        items, _, _ = self._output(final)
        status = self._status(final)
        value["status"] = status
        if final.finish_reason is FinishReason.LENGTH:
            value["incomplete_details"] = {"reason": "max_output_tokens"}
        elif final.finish_reason is FinishReason.CANCELLED:
            value["status"] = "cancelled"
        value["output"] = items
        value["usage"] = {
            "input_tokens": final.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": final.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": final.prompt_tokens + final.completion_tokens,
        }
        finish_reason_name(final.finish_reason)  # an ERROR never reaches here (a 500 instead)
        return value

    def _event(self, kind: str, **fields: Any) -> ServerSentEvent:
        payload = {"type": kind, "sequence_number": next(self._sequence), **fields}
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return ServerSentEvent(data=data, event=kind, sep=SSE_LINE_END)


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
