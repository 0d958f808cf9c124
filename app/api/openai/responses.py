"""Response bodies of the OpenAI-compatible API: whole answers, stream chunks, models, errors."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, field_serializer, model_serializer

from app.api.schemas import FinishReasonName


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Completion(BaseModel):
    """The head every completion object carries (``object`` is set by each kind)."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: per token its text, raw logprob, the top alternatives (text
    -> logprob) and the offset of its text in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonName | None


class CompletionResponse(_Completion):
    """Answer of ``/v1/completions``; also each streamed chunk (with ``usage`` null, except in
    the usage chunk, whose ``choices`` is empty)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCallOut(BaseModel):
    name: str | None = None
    arguments: str


class ToolCallOut(BaseModel):
    """One call in ``message.tool_calls``, or a piece of one in a stream's ``delta.tool_calls``
    (``index`` set; ``id``, ``type`` and ``function.name`` only in its first piece)."""

    index: int | None = None
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallOut


ChatFinishReasonName = Literal["stop", "length", "cancelled", "tool_calls"]


class ChatMessageOut(BaseModel):
    """The answer; ``content`` is null when it is only tool calls or reasoning; ``tool_calls``
    and ``reasoning_content`` are left out when there are none."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_calls(self, handler) -> dict[str, object]:
        value = handler(self)
        for absent in ("tool_calls", "reasoning_content"):
            if value.get(absent) is None:
                value.pop(absent, None)
        for call in value.get("tool_calls") or ():  # ``index`` is a stream's piece's only
            if isinstance(call, dict) and call.get("index") is None:
                call.pop("index", None)
        return value


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReasonName


class ChatCompletionResponse(_Completion):
    """Answer of ``/v1/chat/completions`` with ``stream`` false."""

    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """New text of a streamed answer: ``role`` only in the first chunk, empty in the last."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReasonName | None

    @field_serializer("delta")
    def _delta_without_nulls(self, delta: ChatDelta) -> dict[str, object]:
        return delta.model_dump(exclude_none=True)


class ChatCompletionChunk(_Completion):
    """One ``data:`` event of a streamed chat answer."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """The served model. ``chat_template`` says whose template renders chats: ``"model"`` (the
    model file's own) or ``"chatml-fallback"`` (the model has none)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "slotserve"
    max_model_len: int
    chat_template: Literal["model", "chatml-fallback"]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorResponse(BaseModel):
    error: OpenAIErrorDetail
