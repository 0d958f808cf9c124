"""From the engine to the client: one path for every generating route, one adapter per wire
format.

``answer`` submits the frozen request (or the ``n`` choices of one, as one group) and writes
what comes back: the whole answer as JSON, or
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
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Protocol

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from app.api.admission import refusal_error, submit
from app.api.errors import CLIENT_CLOSED_REQUEST, APIError
from app.api.resources import ServerResources
from app.engine.engine import AsyncEngine, Overloaded
from app.engine.handle import RequestHandle
from app.engine.request import FinalEvent, FinishReason, GenerationRequest, StreamEvent, TokenEvent


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
    generations: Sequence[GenerationRequest],
    formats: Sequence[AnswerFormat],
    *,
    stream: bool,
    body: Callable[[Sequence[FinalEvent]], dict[str, object]] | None = None,
    trailer: Callable[[Sequence[FinalEvent]], Iterable[ServerSentEvent]] | None = None,
) -> Response:
    """Submits ``generations`` (one request, or the ``n`` choices of one: all or none) and
    answers them, streamed or not: every route's one answer path.

    Args:
        formats: one per generation (choice ``i`` written by ``formats[i]``).
        body: the JSON body from every final (default: ``formats[0].response`` of the one).
        trailer: events sent after every choice's final event, before the closing ones (the
            usage chunk of a group), or None.

    Raises:
        APIError: 409 / 429 / 503 from the submission (before anything is sent); 500 when the
            model failed a non-streamed request.
    """
    handles = submit_all(resources, generations)
    engine = resources.engine
    if stream:
        separator = formats[0].sse_separator
        return EventSourceResponse(
            sse_events(handles, engine, formats, trailer),
            ping=resources.config.sse_ping_interval,
            sep=separator,
            send_timeout=resources.config.sse_send_timeout,
            ping_message_factory=lambda: ServerSentEvent(comment="ping", sep=separator),
            headers={"Cache-Control": "no-cache"},
        )
    finals = await finals_unless_disconnected(request, handles, engine)
    if finals is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody is left to read it
    raise_failure(finals)
    return JSONResponse(body(finals) if body else formats[0].response(finals[0]))


async def finals_of(
    resources: ServerResources, generations: Sequence[GenerationRequest]
) -> list[FinalEvent]:
    """The final events of ``generations`` without an HTTP request (the batch runner).

    Raises:
        APIError: as ``submit_all``; 500 when the model failed one of them.
    """
    handles = submit_all(resources, generations)
    finals = list(await asyncio.gather(*(handle.result() for handle in handles)))
    raise_failure(finals)
    return finals


def submit_all(
    resources: ServerResources, generations: Sequence[GenerationRequest]
) -> list[RequestHandle]:
    """Submits every generation, or none (a group is checked against the queue as a whole).

    Raises:
        APIError: 429 when the queue cannot hold them all, or any refusal of ``submit``; the
            ones already submitted are then cancelled.
    """
    engine = resources.engine
    if len(generations) > 1 and generations[0].max_tokens > 0:
        try:
            engine.check_admission(
                len(generations[0].prompt_token_ids) * len(generations), count=len(generations)
            )
        except Overloaded as exc:
            raise refusal_error(resources, exc) from None
    handles: list[RequestHandle] = []
    try:
        for generation in generations:
            handles.append(submit(resources, generation))
    except APIError:
        abort_unfinished(engine, handles)
        raise
    return handles


def raise_failure(finals: Sequence[FinalEvent]) -> None:
    """Raises the 500 of the first final event that is a failure, if any."""
    for final in finals:
        if final.finish_reason is FinishReason.ERROR:
            raise failure_error(final)


async def sse_events(
    handles: Sequence[RequestHandle],
    engine: AsyncEngine,
    formats: Sequence[AnswerFormat],
    trailer: Callable[[Sequence[FinalEvent]], Iterable[ServerSentEvent]] | None = None,
) -> AsyncIterator[bytes]:
    """The SSE body: each request's format's events as its engine events come (choices
    interleaved), exactly one final event per request (or, at the first failure, its failure
    events and no more), the trailer, then the closing events. Every request still running is
    cancelled if the stream ends early.

    Yields encoded chunks, each one write (one ASGI ``http.response.body``): the opening
    events, then at each wake-up the events of every engine event queued since the last one
    (a step's token event, and its final event, trailer and closing events when it ended
    the answer), so a step costs one write per answer rather than one per SSE event."""
    queue: asyncio.Queue[tuple[int, StreamEvent]] = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        async for event in handle.events():
            queue.put_nowait((index, event))

    async def group_batches() -> AsyncIterator[list[tuple[int, StreamEvent]]]:
        while True:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            yield batch

    async def single_batches() -> AsyncIterator[list[tuple[int, StreamEvent]]]:
        async for batch in handles[0].event_batches():
            yield [(0, event) for event in batch]

    # one request reads its events directly; a group merges them through a queue
    single = len(handles) == 1
    batches = single_batches() if single else group_batches()
    pumps = [] if single else [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    finals: list[FinalEvent | None] = [None] * len(handles)
    failed = False
    try:
        opening = encoded(event for answer_format in formats for event in answer_format.opening())
        if opening:
            yield opening
        events: list[ServerSentEvent] = []
        while not failed and any(final is None for final in finals):
            if events:
                yield encoded(events)
                events = []
            try:
                batch = await anext(batches)
            except StopAsyncIteration:  # no final event: the handle's stream ended
                break
            for index, item in batch:
                answer_format = formats[index]
                if isinstance(item, TokenEvent):
                    events.extend(answer_format.token(item))
                    continue
                finals[index] = item
                failed = item.finish_reason is FinishReason.ERROR
                if failed:
                    events.extend(answer_format.failure(failure_error(item)))
                    break
                events.extend(answer_format.final(item))
        # the last step's events, the trailer and the closing events: one write
        if not failed and trailer is not None:
            events.extend(trailer([final for final in finals if final is not None]))
        events.extend(formats[0].closing())
        if events:
            yield encoded(events)
    finally:
        abort_unfinished(engine, handles)
        for task in pumps:
            task.cancel()
        await batches.aclose()


def encoded(events: Iterable[ServerSentEvent]) -> bytes:
    """SSE events as one chunk, each framed as sse-starlette frames it (its own separator)."""
    return b"".join(event.encode() for event in events)


async def finals_unless_disconnected(
    request: Request, handles: Sequence[RequestHandle], engine: AsyncEngine
) -> list[FinalEvent] | None:
    """Waits for every final event while listening for the client leaving (body already read).

    Returns None when the client disconnected first; the requests are then cancelled.
    """
    results = asyncio.ensure_future(asyncio.gather(*(handle.result() for handle in handles)))
    disconnect = asyncio.ensure_future(client_disconnected(request))
    try:
        done, _ = await asyncio.wait({results, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if results in done:
            return list(results.result())
        abort_unfinished(engine, handles)
        return None
    except asyncio.CancelledError:
        abort_unfinished(engine, handles)
        raise
    finally:
        results.cancel()
        disconnect.cancel()


def abort_unfinished(engine: AsyncEngine, handles: Sequence[RequestHandle]) -> None:
    for handle in handles:
        if not handle.is_finished:
            engine.abort(handle)


async def client_disconnected(request: Request) -> None:
    """Returns once the ASGI server reports ``http.disconnect`` (body already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
