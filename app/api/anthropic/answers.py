"""The answer of ``POST /v1/messages`` (``MessagesAnswer``, an ``app.api.answers.AnswerFormat``,
and its plan, ``messages_plan``): a ``message`` whose content blocks are the output read by
``app.api.output_reader`` (``thinking`` for reasoning, ``text``, ``tool_use`` for each call),
whole or as Anthropic's events::

    message_start, ping,
    per block: content_block_start, content_block_delta ... (text_delta / thinking_delta /
        input_json_delta), content_block_stop
    message_delta (stop_reason, stop_sequence, usage), message_stop

Text and reasoning blocks stream as they are decided; a ``tool_use`` block goes out whole (its
input in one ``input_json_delta``) once the call is complete, so a cut by ``max_tokens`` keeps
the calls completed before it and drops the partial one. A failure after the 200 is an
``error`` event. ``stop_reason``: ``end_turn``, ``stop_sequence`` (with the sequence),
``max_tokens``, ``tool_use`` (a complete answer that made calls), or ``cancelled`` for a request
cancelled by ``DELETE /generate/{id}`` or shutdown (Anthropic has no word for it; /v1 says
``cancelled`` too).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from app.api.answers import AnswerPlan
from app.api.anthropic.errors import anthropic_error_body
from app.api.anthropic.schemas import MessagesRequestBody
from app.api.errors import APIError
from app.api.openai.tools import ToolPlan
from app.api.output_reader import (
    CallPiece,
    OutputPiece,
    OutputReader,
    ReasoningPiece,
    TextPiece,
)
from app.api.reasoning import ReasoningSplitter
from app.api.request_builder import RequestOrigin
from app.api.resources import ServerResources
from app.api.sse_frames import SSEEvent, json_event
from app.engine.chat_template import CHATML_END_OF_TURN
from app.engine.request import FinalEvent, FinishReason, TokenEvent

SSE_LINE_END = "\n"


async def messages_plan(
    body: MessagesRequestBody, origin: RequestOrigin, resources: ServerResources
) -> AnswerPlan:
    """The request built from ``body`` (the conversation rendered with the chat template),
    answered in ``MessagesAnswer``.

    Raises:
        APIError: the builder's refusals (400 / 422).
    """
    generation = await resources.builder.build(body.generation_params(), origin)
    writer = MessagesAnswer(
        request_id=origin.request_id,
        model=resources.engine.capabilities.name,
        prompt_tokens=len(generation.prompt_token_ids),
        tools=body.tool_plan,
        reasoning=resources.reasoning_for(generation),
    )
    return AnswerPlan([generation], [writer], stream=bool(body.stream))


class MessagesAnswer:
    """Anthropic's answer to one request. Not shared between requests: it tracks the blocks of
    its one stream.

    Args:
        request_id: the native request id (the message's ``id``). model: the served model.
        prompt_tokens: the prompt's size (``message_start``'s usage).
        tools: the request's tool plan (None without tools).
        reasoning: the request's reasoning splitter (None: no thinking blocks).
    """

    sse_separator: str | None = SSE_LINE_END

    def __init__(
        self,
        *,
        request_id: str,
        model: str,
        prompt_tokens: int,
        tools: ToolPlan | None,
        reasoning: ReasoningSplitter | None,
    ) -> None:
        self._id = request_id
        self._model = model
        self._prompt_tokens = prompt_tokens
        self._reader = OutputReader(tools, reasoning, f"toolu_{request_id}_")
        self._block_index = -1
        self._open_kind: str | None = None  # the block a stream has open: text / thinking

    # ----------------------------------------------------------------- AnswerFormat

    def response(self, final: FinalEvent) -> dict[str, object]:
        pieces = self._reader.read_whole(final.text)
        made_calls = any(isinstance(piece, CallPiece) for piece in pieces)
        message = self._message([_block(piece) for piece in pieces])
        stop_reason, stop_sequence = _stop_reason(final, made_calls)
        message.update(
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage={"input_tokens": final.prompt_tokens, "output_tokens": final.completion_tokens},
        )
        return message

    def opening(self) -> Iterable[SSEEvent]:
        message = self._message([])
        message["usage"] = {"input_tokens": self._prompt_tokens, "output_tokens": 0}
        yield _event("message_start", message=message)
        yield _event("ping")

    def token(self, event: TokenEvent) -> Iterable[SSEEvent]:
        if event.text:
            for piece in self._reader.feed(event.text):
                yield from self._piece_events(piece)

    def final(self, final: FinalEvent) -> Iterable[SSEEvent]:
        for piece in self._reader.finish():
            yield from self._piece_events(piece)
        yield from self._close_block()
        stop_reason, stop_sequence = _stop_reason(final, self._reader.calls_made > 0)
        yield _event(
            "message_delta",
            delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            usage={"input_tokens": final.prompt_tokens, "output_tokens": final.completion_tokens},
        )
        yield _event("message_stop")

    def failure(self, error: APIError) -> Iterable[SSEEvent]:
        body = anthropic_error_body(error)
        yield _event("error", error=body["error"])

    def closing(self) -> Iterable[SSEEvent]:
        return ()

    # ----------------------------------------------------------------- the blocks

    def _message(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
        }

    def _piece_events(self, piece: OutputPiece) -> Iterator[SSEEvent]:
        if isinstance(piece, CallPiece):
            yield from self._close_block()
            block = _block(piece)
            yield from self._open_block({**block, "input": {}}, kind="tool_use")
            partial_json = json.dumps(block["input"], ensure_ascii=False)
            delta = {"type": "input_json_delta", "partial_json": partial_json}
            yield _event("content_block_delta", index=self._block_index, delta=delta)
            yield from self._close_block()
            return
        if not piece.text:
            return
        if isinstance(piece, ReasoningPiece):
            kind, delta = "thinking", {"type": "thinking_delta", "thinking": piece.text}
        else:
            kind, delta = "text", {"type": "text_delta", "text": piece.text}
        if self._open_kind != kind:
            yield from self._close_block()
            empty = {"type": kind, kind: ""}
            if kind == "thinking":
                empty["signature"] = ""
            yield from self._open_block(empty, kind=kind)
        yield _event("content_block_delta", index=self._block_index, delta=delta)

    def _open_block(self, block: dict[str, Any], *, kind: str) -> Iterator[SSEEvent]:
        self._block_index += 1
        self._open_kind = kind
        yield _event("content_block_start", index=self._block_index, content_block=block)

    def _close_block(self) -> Iterator[SSEEvent]:
        if self._open_kind is not None:
            self._open_kind = None
            yield _event("content_block_stop", index=self._block_index)


def _block(piece: OutputPiece) -> dict[str, Any]:
    if isinstance(piece, ReasoningPiece):
        return {"type": "thinking", "thinking": piece.text, "signature": ""}
    if isinstance(piece, TextPiece):
        return {"type": "text", "text": piece.text}
    call = piece.call
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call.arguments)}


def _input(arguments: str) -> dict[str, Any]:
    """A call's ``input`` object (a call whose arguments are not an object has none)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop_reason(final: FinalEvent, made_calls: bool) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence`` of a request that did not fail."""
    reason = final.finish_reason
    if reason is FinishReason.LENGTH:
        return "max_tokens", None
    if reason is FinishReason.CANCELLED:
        return "cancelled", None
    if made_calls:
        return "tool_use", None
    if isinstance(final.stop_reason, str) and final.stop_reason != CHATML_END_OF_TURN:
        return "stop_sequence", final.stop_reason
    return "end_turn", None  # (ChatML's end of turn: the fallback template's, not a client's)


def _event(kind: str, **fields: Any) -> bytes:
    """One Anthropic event (no floats in any of them: ``json_event``)."""
    return json_event({"type": kind, **fields}, event=kind, sep=SSE_LINE_END)
