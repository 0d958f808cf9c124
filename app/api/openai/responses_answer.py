"""The answer of ``POST /v1/responses`` (OpenAI's Responses API, stateless) and its plan
(``responses_plan``). The body is :mod:`app.api.openai.responses_request`'s
``ResponsesRequestBody``.

The answer (``ResponsesAnswer``, an ``app.api.answers.AnswerFormat``) is a ``response`` object;
streamed, OpenAI's typed events with increasing ``sequence_number``::

    response.created, response.in_progress,
    a text answer: response.output_item.added (message), response.content_part.added,
        response.output_text.delta ..., response.output_text.done, response.content_part.done,
        response.output_item.done
    with the reasoning parser on, the reasoning first, as one item once the text begins:
        response.output_item.added (reasoning), response.output_item.done, then the message
    tool calls (read whole, at the end): per call response.output_item.added (function_call),
        response.function_call_arguments.delta, response.function_call_arguments.done,
        response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut it)

A failure after the stream began is an ``error`` event. Ids: ``resp_<request id>`` (the native
request id, so ``DELETE /generate/{id}`` cancels it), ``msg_...``, ``fc_...``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from sse_starlette import ServerSentEvent

from app.api.answers import AnswerPlan, finish_reason_name
from app.api.errors import APIError
from app.api.openai.answers import SSE_LINE_END
from app.api.openai.responses_request import FunctionChoice, ResponsesRequestBody
from app.api.openai.tools import ToolCall, ToolMode
from app.api.output_reader import (
    CallPiece,
    OutputPiece,
    OutputReader,
    ReasoningPiece,
    TextPiece,
)
from app.api.reasoning import THINK_CLOSE, ReasoningSplitter
from app.api.request_builder import RequestOrigin
from app.api.resources import ServerResources
from app.api.sse_frames import compact_json
from app.engine.request import FinalEvent, FinishReason, TokenEvent


async def responses_plan(
    body: ResponsesRequestBody, origin: RequestOrigin, resources: ServerResources
) -> AnswerPlan:
    """The request built from ``body`` (``RequestBuilder.build``), answered in
    ``ResponsesAnswer``.

    Raises:
        APIError: the builder's refusals (400 / 422).
    """
    generation = await resources.builder.build(body.generation_params(), origin)
    writer = ResponsesAnswer(
        request_id=origin.request_id,
        created=int(time.time()),
        model=resources.engine.capabilities.name,
        body=body,
        reasoning=resources.reasoning_for(generation),
        token_bytes=resources.engine.token_bytes,
    )
    return AnswerPlan([generation], [writer], stream=body.streamed)


class ResponsesAnswer:
    """The Responses API's answer to one request (an ``AnswerFormat``). Not shared between
    requests: it numbers the events of its one stream (``sequence_number``).

    Args:
        request_id: the native request id. created: Unix seconds. model: the served model.
        body: the request (echoed: instructions, tools, sampling, text format).
        token_bytes: each token's own bytes (the engine's), to count the reasoning's tokens in
            ``usage``; None: counted as 0.
    """

    sse_separator: str | None = SSE_LINE_END

    def __init__(
        self,
        *,
        request_id: str,
        created: int,
        model: str,
        body: ResponsesRequestBody,
        reasoning: ReasoningSplitter | None = None,
        token_bytes: Callable[[tuple[int, ...]], list[bytes]] | None = None,
    ) -> None:
        self._token_bytes = token_bytes
        self.id = f"resp_{request_id}"
        self._request_id = request_id
        self._created = created
        self._model = model
        self._body = body
        self._plan = body.tool_plan
        self._reader = OutputReader(self._plan, reasoning, f"call_{request_id}_")
        self._streams_text = self._plan is None or self._plan.mode is ToolMode.NONE
        self._splits_reasoning = reasoning is not None
        # a stream's reasoning so far (sent as one item when the text begins) and the output
        # index of its message once it is open
        self._streamed_reasoning = ""
        self._message_index: int | None = None
        self._sequence = itertools.count()

    # ----------------------------------------------------------------- AnswerFormat

    def response(self, final: FinalEvent) -> dict[str, object]:
        return self._response(final)

    def opening(self) -> Iterable[ServerSentEvent]:
        yield self._event("response.created", response=self._response(None))
        yield self._event("response.in_progress", response=self._response(None))
        if self._streams_text and not self._splits_reasoning:
            yield from self._open_message()

    def token(self, event: TokenEvent) -> Iterable[ServerSentEvent]:
        if event.text and self._streams_text:
            for piece in self._reader.feed(event.text):
                yield from self._streamed_piece(piece)

    def final(self, final: FinalEvent) -> Iterable[ServerSentEvent]:
        items, calls, text = self._output(final)
        if self._streams_text:
            for piece in self._reader.finish():
                yield from self._streamed_piece(piece)
            yield from self._open_message(reasoning_status=self._item_status(final))
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
    def _message_id(self) -> str:
        return f"msg_{self._request_id}"

    def _streamed_piece(self, piece: OutputPiece) -> Iterator[ServerSentEvent]:
        """A streamed answer's piece: reasoning is kept until the text begins, text is a
        delta of the message (opened first)."""
        if isinstance(piece, ReasoningPiece):
            self._streamed_reasoning += piece.text
        elif isinstance(piece, TextPiece) and piece.text:
            yield from self._open_message()
            yield self._event(
                "response.output_text.delta",
                item_id=self._message_id,
                output_index=self._message_index,
                content_index=0,
                delta=piece.text,
                logprobs=[],
            )

    def _open_message(self, reasoning_status: str = "completed") -> Iterator[ServerSentEvent]:
        """A stream's message item opened (once), after the reasoning item when there is one."""
        if self._message_index is not None:
            return
        index = 0
        if self._streamed_reasoning:
            reasoning = self._reasoning_item(self._streamed_reasoning, reasoning_status)
            yield from self._item_whole(0, reasoning)
            index = 1
        self._message_index = index
        yield self._event(
            "response.output_item.added", output_index=index, item=self._message("", "in_progress")
        )
        yield self._event(
            "response.content_part.added",
            item_id=self._message_id,
            output_index=index,
            content_index=0,
            part=_output_text(""),
        )

    def _text_done(self, final: FinalEvent, text: str) -> Iterator[ServerSentEvent]:
        status = self._item_status(final)
        index = self._message_index
        common = {"item_id": self._message_id, "output_index": index, "content_index": 0}
        yield self._event("response.output_text.done", **common, text=text, logprobs=[])
        yield self._event("response.content_part.done", **common, part=_output_text(text))
        yield self._event(
            "response.output_item.done", output_index=index, item=self._message(text, status)
        )

    def _item_whole(self, index: int, item: dict[str, Any]) -> Iterator[ServerSentEvent]:
        if item["type"] == "reasoning":
            yield self._event(
                "response.output_item.added",
                output_index=index,
                item={**item, "content": [], "status": "in_progress"},
            )
        elif item["type"] == "message":
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
        """The output items of a finished request (its reasoning, its message, its calls),
        its calls and its text."""
        pieces = self._reader.read_whole(final.text)
        calls = [piece.call for piece in pieces if isinstance(piece, CallPiece)]
        reasoning = "".join(p.text for p in pieces if isinstance(p, ReasoningPiece))
        text = "".join(p.text for p in pieces if isinstance(p, TextPiece))
        status = self._item_status(final)
        items: list[dict[str, Any]] = []
        if reasoning:  # a block closed before text or calls is complete, whatever the end
            items.append(self._reasoning_item(reasoning, "completed" if text or calls else status))
        if text or not calls:
            items.append(self._message(text, status))
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
        return items, calls, text

    def _reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        return {
            "id": f"rs_{self._request_id}",
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "status": status,
        }

    def _item_status(self, final: FinalEvent) -> str:
        return "completed" if self._status(final) == "completed" else "incomplete"

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
            "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(final, items)},
            "total_tokens": final.prompt_tokens + final.completion_tokens,
        }
        finish_reason_name(final.finish_reason)  # an ERROR never reaches here (a 500 instead)
        return value

    def _reasoning_tokens(self, final: FinalEvent, items: list[dict[str, Any]]) -> int:
        """The output's tokens up to the end of its reasoning block (the whole output when the
        block was not closed), by their bytes (found by a helper: always 0)."""
        if self._token_bytes is None or not any(item["type"] == "reasoning" for item in items):
            return 0
        text = final.text.encode("utf-8")
        close = text.find(THINK_CLOSE.encode())
        end = len(text) if close < 0 else close + len(THINK_CLOSE)
        count = at = 0
        for piece in self._token_bytes(final.token_ids):
            if at >= end:
                break
            at, count = at + len(piece), count + 1
        return count

    def _event(self, kind: str, **fields: Any) -> ServerSentEvent:
        payload = {"type": kind, "sequence_number": next(self._sequence), **fields}
        return ServerSentEvent(data=compact_json(payload), event=kind, sep=SSE_LINE_END)


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
