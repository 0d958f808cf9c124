"""From the engine to the client: one path for every generating route, one adapter per wire
format.

``answer`` submits the frozen request and writes what comes back: the whole answer as JSON, or
a Server-Sent-Events stream. What every route shares lives here once: a client that leaves
(stream or not) cancels its request (``engine.abort``, the cancellation re-raised, never
swallowed), a non-streamed answer whose client left is a 499 nobody reads, a model failure is a
500 before the answer began or the format's error event after, and a stream always ends with
the format's final event. What differs between wire formats is an ``AnswerFormat``: how a final
event becomes a JSON body, how each event becomes SSE events. The formats are pure (no HTTP
request), so a caller without one (a batch runner) writes bodies with ``AnswerFormat.response``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Protocol

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from app.api.admission import submit
from app.api.errors import CLIENT_CLOSED_REQUEST, APIError
from app.api.resources import ServerResources
from app.engine.engine import AsyncEngine
from app.engine.handle import RequestHandle
from app.engine.request import FinalEvent, FinishReason, GenerationRequest, TokenEvent


class AnswerFormat(Protocol):
    """How one wire format writes a request's answer.

    Attributes:
        sse_separator: the line end of its SSE events; None for sse-starlette's ``\\r\\n``.
    """

    sse_separator: str | None

    def response(self, final: FinalEvent) -> dict[str, object]:
        """The JSON body of a non-streamed answer (``final`` is not an error)."""
        ...

    def opening(self) -> Iterable[ServerSentEvent]:
        """Events sent before the first token."""
        ...

    def token(self, event: TokenEvent) -> Iterable[ServerSentEvent]:
        """Events for new output (``event.text`` may be empty: text held back)."""
        ...

    def final(self, final: FinalEvent) -> Iterable[ServerSentEvent]:
        """Events that end a stream that did not fail."""
        ...

    def failure(self, error: APIError) -> Iterable[ServerSentEvent]:
        """The events of a failure after the 200 was sent."""
        ...

    def closing(self) -> Iterable[ServerSentEvent]:
        """Events after the last one (OpenAI's ``data: [DONE]``)."""
        ...


def failure_error(final: FinalEvent) -> APIError:
    """The 500 of a request the model (or the server) failed; the message is client-safe."""
    return APIError(500, "internal", final.error or "the model failed on this request")


def finish_reason_name(reason: FinishReason) -> str:
    """The public ``finish_reason`` of a request that did not fail (``stop``, ``length``,
    ``cancelled``). Raises ValueError for ``ERROR``, which is answered as an error instead."""
    if reason is FinishReason.ERROR:
        raise ValueError("a failed request has no finish_reason: it is answered as an error")
    return reason.value


async def answer(
    request: Request,
    resources: ServerResources,
    generation: GenerationRequest,
    answer_format: AnswerFormat,
    *,
    stream: bool,
) -> Response:
    """Submits ``generation`` and answers it in ``answer_format``, streamed or not.

    Raises:
        APIError: 409 / 429 / 503 from the submission (before anything is sent); 500 when the
            model failed a non-streamed request.
    """
    handle = submit(resources, generation)
    if stream:
        separator = answer_format.sse_separator
        return EventSourceResponse(
            sse_events(handle, resources.engine, answer_format),
            ping=resources.config.sse_ping_interval,
            sep=separator,
            send_timeout=resources.config.sse_send_timeout,
            ping_message_factory=lambda: ServerSentEvent(comment="ping", sep=separator),
            headers={"Cache-Control": "no-cache"},
        )
    final = await final_unless_disconnected(request, handle, resources.engine)
    if final is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody is left to read it
    if final.finish_reason is FinishReason.ERROR:
        raise failure_error(final)
    return JSONResponse(answer_format.response(final))


async def sse_events(
    handle: RequestHandle, engine: AsyncEngine, answer_format: AnswerFormat
) -> AsyncIterator[ServerSentEvent]:
    """The SSE body: the format's events for each engine event, exactly one final event (or the
    failure's), then its closing events. The request is cancelled if the stream ends early."""
    try:
        for event in answer_format.opening():
            yield event
        async for item in handle.events():
            if isinstance(item, TokenEvent):
                events = answer_format.token(item)
            elif item.finish_reason is FinishReason.ERROR:
                events = answer_format.failure(failure_error(item))
            else:
                events = answer_format.final(item)
            for event in events:
                yield event
        for event in answer_format.closing():
            yield event
    finally:
        if not handle.is_finished:
            engine.abort(handle)


async def final_unless_disconnected(
    request: Request, handle: RequestHandle, engine: AsyncEngine
) -> FinalEvent | None:
    """Waits for the final event while listening for the client leaving (body already read).

    Returns None when the client disconnected first; the request is then cancelled.
    """
    result = asyncio.ensure_future(handle.result())
    disconnect = asyncio.ensure_future(client_disconnected(request))
    try:
        done, _ = await asyncio.wait({result, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if result in done:
            return result.result()
        engine.abort(handle)
        return None
    except asyncio.CancelledError:
        engine.abort(handle)
        raise
    finally:
        result.cancel()
        disconnect.cancel()


async def client_disconnected(request: Request) -> None:
    """Returns once the ASGI server reports ``http.disconnect`` (body already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
