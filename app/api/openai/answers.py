"""The OpenAI wire formats of an answer (``app.api.answers.AnswerFormat``): ``/v1/completions``
and ``/v1/chat/completions``, whole or as ``data: {chunk}`` events ended by ``data: [DONE]``.

A stream is the chunks of new text (text held back by the engine waits for the next chunk), a
final chunk with the finish reason and an empty text or delta, the usage chunk when the request
asked for it (``stream_options.include_usage``; ``choices`` empty), then ``[DONE]``. A failure
after the stream began is an error chunk, then ``[DONE]``. Ids are the native request ids, so
``DELETE /generate/{id}`` cancels an OpenAI request too; ``cancelled`` is the native finish
reason, since OpenAI has none for it and ``stop`` would pass a cut answer off as a complete one.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from sse_starlette import ServerSentEvent

from app.api.answers import finish_reason_name
from app.api.errors import APIError
from app.api.openai.errors import openai_error_body
from app.api.openai.logprobs import LogprobsWriter
from app.api.openai.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    FunctionCallOut,
    ToolCallOut,
    Usage,
)
from app.api.openai.tools import ToolCall, ToolMode, ToolPlan
from app.api.output_reader import (
    ArgumentsPiece,
    CallHead,
    CallPiece,
    OutputPiece,
    OutputReader,
    ReasoningPiece,
    RequiredCallStream,
    TextPiece,
)
from app.api.reasoning import ReasoningSplitter
from app.api.sse_frames import SSEEvent, compact_json, json_event
from app.engine.request import FinalEvent, TokenEvent
from app.models.base import TokenLogprobs

SSE_LINE_END = "\n"  # chunks are written "data: {json}\n\n", as OpenAI writes them


def usage(final: FinalEvent) -> Usage:
    return Usage(
        prompt_tokens=final.prompt_tokens,
        completion_tokens=final.completion_tokens,
        total_tokens=final.prompt_tokens + final.completion_tokens,
    )


def data_event(payload: dict[str, object] | str) -> ServerSentEvent:
    """One ``data:`` event: compact JSON (or the literal ``[DONE]``)."""
    if not isinstance(payload, str):
        payload = compact_json(payload)
    return ServerSentEvent(data=payload, sep=SSE_LINE_END)


@dataclass(frozen=True, slots=True)
class _OpenAIAnswer(ABC):
    """What both endpoints' answers share: the identity of every chunk, the end of a stream
    (the finish reason's chunk, the usage chunk when asked, ``[DONE]``) and the error chunk.

    Attributes:
        id: the request id. created: Unix seconds. model: the served model's name.
        include_usage: a stream ends with the usage chunk.
        index: the choice's index (``n`` > 1: one format per choice).
        logprobs: writes the choice's logprobs, when the request asked for them.
    """

    id: str
    created: int
    model: str
    include_usage: bool = False
    sse_separator: str | None = SSE_LINE_END
    index: int = 0
    logprobs: LogprobsWriter | None = None
    _object: ClassVar[str]  # the chunks' ``object``

    def usage_event(self, usage: Usage) -> ServerSentEvent:
        """The usage chunk (``choices`` empty) of a stream that asked for it."""
        return data_event(self._chunk([], usage))

    def _plain_chunk(self, choice: dict[str, object]) -> bytes:
        """The event of a chunk of one choice without logprobs, as a dict framed by
        ``json_event`` (the common chunk of a stream, written without building its pydantic
        model; the same JSON as ``_chunk``, which ``tests/http/test_openai_chunks.py``
        checks)."""
        chunk = {
            "id": self.id,
            "object": self._object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [choice],
            "usage": None,
        }
        return json_event(chunk, sep=SSE_LINE_END)

    @abstractmethod
    def _chunk(self, choices: list, usage: Usage | None = None) -> dict[str, object]:
        """One chunk (or whole answer) of this endpoint with these choices."""

    @abstractmethod
    def _last_choice(self, finish_reason: str) -> object:
        """The choice of the chunk that carries the finish reason."""

    def final(self, final: FinalEvent) -> Iterable[ServerSentEvent]:
        yield data_event(self._chunk([self._last_choice(finish_reason_name(final.finish_reason))]))
        if self.include_usage:
            yield data_event(self._chunk([], usage(final)))

    def failure(self, error: APIError) -> Iterable[ServerSentEvent]:
        yield data_event(openai_error_body(error))

    def closing(self) -> Iterable[ServerSentEvent]:
        yield data_event("[DONE]")


@dataclass(frozen=True, slots=True)
class CompletionAnswer(_OpenAIAnswer):
    """``/v1/completions``: ``text_completion`` objects, whole and as chunks.

    Attributes:
        echo: the prompt's text, returned before the completion (``echo``); "" otherwise.
        echo_first_token: the prompt's first token id, which has no logprob (``echo`` with
            ``logprobs``: the prompt's logprobs come first).
    """

    echo: str = ""
    echo_first_token: int | None = None
    _object: ClassVar[str] = "text_completion"

    def response(self, final: FinalEvent) -> dict[str, object]:
        reason = finish_reason_name(final.finish_reason)
        logprobs = None
        if self.logprobs is not None:
            prompt = final.prompt_logprobs if self.echo else ()
            logprobs = self.logprobs.completion(final.logprobs, prompt, self.echo_first_token)
        choice = CompletionChoice(
            index=self.index, text=self.echo + final.text, logprobs=logprobs, finish_reason=reason
        )
        return self._chunk([choice], usage(final))

    def opening(self) -> Iterable[ServerSentEvent]:
        if self.echo:
            choice = CompletionChoice(index=self.index, text=self.echo, finish_reason=None)
            yield data_event(self._chunk([choice]))

    def token(self, event: TokenEvent) -> Iterable[SSEEvent]:
        if event.text and self.logprobs is None:
            choice = {"index": self.index, "text": event.text, "logprobs": None}
            yield self._plain_chunk(choice | {"finish_reason": None})
        elif event.text:  # text held back (a partial character or stop string) waits
            logprobs = self.logprobs.completion(event.logprobs) if self.logprobs else None
            choice = CompletionChoice(
                index=self.index, text=event.text, logprobs=logprobs, finish_reason=None
            )
            yield data_event(self._chunk([choice]))

    def _last_choice(self, finish_reason: str) -> CompletionChoice:
        return CompletionChoice(index=self.index, text="", finish_reason=finish_reason)

    def _chunk(self, choices: list, usage: Usage | None = None) -> dict[str, object]:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        ).model_dump()


@dataclass(frozen=True, slots=True)
class ChatAnswer(_OpenAIAnswer):
    """``/v1/chat/completions``: a ``chat.completion``, or ``chat.completion.chunk`` events whose
    first delta carries the role and whose last is empty.

    The output is read by an ``OutputReader`` (``app.api.output_reader``): reasoning (when the
    server's parser is on: ``reasoning``) is ``reasoning_content``, tool calls (``tools``, a
    ``ToolPlan``) are ``tool_calls``, the rest ``content``; a stream sends each as it is
    decided. A named function's arguments stream as ``delta.tool_calls`` pieces as they are
    generated (its id and name in a chunk of their own after the role's); a ``required``
    answer's calls stream the same way, each call's id and name as soon as the name is
    generated, then its arguments in pieces (``RequiredCallStream``). A whole answer cut by
    ``max_tokens`` keeps the calls completed before the cut and drops the partial one (a
    stream has sent the partial one's pieces, with ``finish_reason: "length"``); never as
    content.
    """

    tools: ToolPlan | None = None
    reasoning: ReasoningSplitter | None = None
    _object: ClassVar[str] = "chat.completion.chunk"
    _reader: OutputReader = field(init=False)
    _calls: RequiredCallStream = field(init=False)
    _unsent_logprobs: list[TokenLogprobs] = field(init=False)  # of text not yet decided

    def __post_init__(self) -> None:
        reader = OutputReader(self.tools, self.reasoning, self._call_id_prefix)
        object.__setattr__(self, "_reader", reader)
        object.__setattr__(self, "_calls", RequiredCallStream(self._call_id_prefix))
        object.__setattr__(self, "_unsent_logprobs", [])

    def response(self, final: FinalEvent) -> dict[str, object]:
        pieces = self._reader.read_whole(final.text)
        calls = [piece.call for piece in pieces if isinstance(piece, CallPiece)]
        reasoning = "".join(p.text for p in pieces if isinstance(p, ReasoningPiece)) or None
        content: str | None = "".join(p.text for p in pieces if isinstance(p, TextPiece))
        if not content and (calls or reasoning or self._constrained_to_calls):
            content = None
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[
                ChatChoice(
                    index=self.index,
                    message=ChatMessageOut(
                        content=content,
                        reasoning_content=reasoning,
                        tool_calls=[_call(call) for call in calls] or None,
                    ),
                    logprobs=self.logprobs.chat(final.logprobs) if self.logprobs else None,
                    finish_reason=_chat_finish_reason(final, bool(calls)),
                )
            ],
            usage=usage(final),
        ).model_dump()

    def opening(self) -> Iterable[ServerSentEvent]:
        delta = ChatDelta(role="assistant", content="")
        yield data_event(self._chunk([self._choice(delta)]))
        if self._streams_arguments:
            head = ToolCallOut(
                index=0,
                id=self._call_id_prefix + "0",
                type="function",
                function=FunctionCallOut(name=self.tools.named, arguments=""),
            )
            yield data_event(self._chunk([self._choice(ChatDelta(tool_calls=[head]))]))

    def token(self, event: TokenEvent) -> Iterable[SSEEvent]:
        if not event.text:  # text held back (a partial character or stop string) waits
            return
        logprobs = list(event.logprobs)
        if self._streams_arguments:
            piece = ToolCallOut(index=0, function=FunctionCallOut(arguments=event.text))
            yield self._delta_event(ChatDelta(tool_calls=[piece]), logprobs)
            return
        if self._streams_required_calls:
            self._reader.feed(event.text)  # counts the completed calls (finish_reason)
            for call_piece in self._calls.feed(event.text):
                yield self._delta_event(ChatDelta(tool_calls=[_streamed(call_piece)]), logprobs)
                logprobs = []
            self._unsent_logprobs.extend(logprobs)
            return
        for piece in self._reader.feed(event.text):
            yield self._piece_event(piece, logprobs)
            logprobs = []
        self._unsent_logprobs.extend(logprobs)  # nothing decided yet: with the next chunk

    def final(self, final: FinalEvent) -> Iterable[ServerSentEvent]:
        if self._streams_arguments:
            made_calls = _parses(final.text)
        else:
            for piece in self._reader.finish():
                if not self._streams_required_calls:
                    yield self._delta_event(_delta(piece), [])
            made_calls = self._reader.calls_made > 0
        last = ChatChunkChoice(
            index=self.index,
            delta=ChatDelta(),
            finish_reason=_chat_finish_reason(final, made_calls),
        )
        yield data_event(self._chunk([last]))
        if self.include_usage:
            yield data_event(self._chunk([], usage(final)))

    @property
    def _streams_arguments(self) -> bool:
        return self.tools is not None and self.tools.mode is ToolMode.NAMED

    @property
    def _streams_required_calls(self) -> bool:
        return self.tools is not None and self.tools.mode is ToolMode.REQUIRED

    @property
    def _constrained_to_calls(self) -> bool:
        return self.tools is not None and self.tools.mode in (ToolMode.NAMED, ToolMode.REQUIRED)

    @property
    def _call_id_prefix(self) -> str:
        return f"call_{self.id}_{self.index}_"

    def _piece_event(self, piece: OutputPiece, logprobs: list[TokenLogprobs]) -> SSEEvent:
        """The chunk of one piece of the output: text or reasoning without logprobs as a
        plain dict, anything else through its pydantic delta (``_delta_event``)."""
        if self.logprobs is None and type(piece) in (TextPiece, ReasoningPiece):
            key = "content" if type(piece) is TextPiece else "reasoning_content"
            delta = {key: piece.text}
            return self._plain_chunk(
                {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}
            )
        return self._delta_event(_delta(piece), logprobs)

    def _delta_event(self, delta: ChatDelta, logprobs: list[TokenLogprobs]) -> ServerSentEvent:
        """One chunk of ``delta``, with the logprobs of the tokens it is the first news of."""
        pending = self._unsent_logprobs + logprobs
        self._unsent_logprobs.clear()
        chat_logprobs = self.logprobs.chat(tuple(pending)) if self.logprobs else None
        return data_event(self._chunk([self._choice(delta, chat_logprobs)]))

    def _choice(self, delta: ChatDelta, logprobs: object = None) -> ChatChunkChoice:
        return ChatChunkChoice(index=self.index, delta=delta, logprobs=logprobs, finish_reason=None)

    def _last_choice(self, finish_reason: str) -> ChatChunkChoice:
        return ChatChunkChoice(index=self.index, delta=ChatDelta(), finish_reason=finish_reason)

    def _chunk(self, choices: list, usage: Usage | None = None) -> dict[str, object]:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        ).model_dump()


def _delta(piece: OutputPiece) -> ChatDelta:
    if isinstance(piece, ReasoningPiece):
        return ChatDelta(reasoning_content=piece.text)
    if isinstance(piece, TextPiece):
        return ChatDelta(content=piece.text)
    return ChatDelta(tool_calls=[_call(piece.call, piece.index)])


def _streamed(piece: CallHead | ArgumentsPiece) -> ToolCallOut:
    """A ``required`` call's head (index, id, name, no arguments yet) or its next piece."""
    if isinstance(piece, CallHead):
        head = FunctionCallOut(name=piece.name, arguments="")
        return ToolCallOut(index=piece.index, id=piece.id, type="function", function=head)
    return ToolCallOut(index=piece.index, function=FunctionCallOut(arguments=piece.text))


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _call(call: ToolCall, index: int | None = None) -> ToolCallOut:
    return ToolCallOut(
        index=index,
        id=call.id,
        type="function",
        function=FunctionCallOut(name=call.name, arguments=call.arguments),
    )


def _chat_finish_reason(final: FinalEvent, made_calls: bool) -> str:
    """``tool_calls`` for a complete answer that made calls, else the native reason."""
    reason = finish_reason_name(final.finish_reason)
    return "tool_calls" if made_calls and reason == "stop" else reason
