"""From the engine to the client: one path for every generating route, one adapter per wire
format.

A route (or a batch line) plans its answer (``AnswerPlan``: one request, or the ``n`` choices of
one as a group, and an ``AnswerFormat`` for each) and ``answer`` submits it and writes what comes
back: the whole answer as JSON (``whole_answer``, which the batch runner calls without a client),
or a Server-Sent-Events stream (``streamed_answer``). What every route shares lives here once: a
client that leaves (stream or not) cancels its requests (``engine.abort``, the cancellation
re-raised, never swallowed), a non-streamed answer whose client left is a 499 nobody reads, a
model failure is a 500 before the answer began or the format's error event after, and a stream
always ends with the format's final event. What differs between wire formats is an
``AnswerFormat``: how a final event becomes a JSON body, how each event becomes SSE events. The
formats are pure (no HTTP request).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from sse_starlette import ServerSentEvent

from app.api.admission import refusal_error, submit
from app.api.errors import CLIENT_CLOSED_REQUEST, APIError
from app.api.resources import ServerResources
from app.api.sse_frames import SSEEvent, encoded
from app.api.sse_response import WatchedEventSourceResponse
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

    def opening(self) -> Iterable[SSEEvent]:
        """Events sent before the first token."""
        ...

    def token(self, event: TokenEvent) -> Iterable[SSEEvent]:
        """Events for new output (``event.text`` may be empty: text held back)."""
        ...

    def final(self, final: FinalEvent) -> Iterable[SSEEvent]:
        """Events that end a stream that did not fail."""
        ...

    def failure(self, error: APIError) -> Iterable[SSEEvent]:
        """The events of a failure after the 200 was sent."""
        ...

    def closing(self) -> Iterable[SSEEvent]:
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


@dataclass(frozen=True, slots=True)
class AnswerPlan:
    """What one request is answered with: what is submitted, and how each part is written.

    Attributes:
        generations: one request, or the ``n`` choices of one (a group: submitted all or none).
        formats: one per generation (choice ``i`` written by ``formats[i]``).
        stream: SSE events (True) or one JSON body.
        group_body: a group's JSON body from every final event; None: ``formats[0]``'s body of
            the one final event.
        trailer: events sent after every choice's final event, before the closing ones (a
            group's usage chunk), or None.
    """

    generations: Sequence[GenerationRequest]
    formats: Sequence[AnswerFormat]
    stream: bool
    group_body: Callable[[Sequence[FinalEvent]], dict[str, object]] | None = None
    trailer: Callable[[Sequence[FinalEvent]], Iterable[SSEEvent]] | None = None

    def body(self, finals: Sequence[FinalEvent]) -> dict[str, object]:
        """The JSON body of every generation's final event (none of them a failure)."""
        if self.group_body is not None:
            return self.group_body(finals)
        return self.formats[0].response(finals[0])


@dataclass(frozen=True, slots=True)
class WholeAnswer:
    """A non-streamed answer: its JSON body and the final events it was written from.

    Attributes:
        body: the JSON body, as the route writes it.
        finals: one final event per generation, in the plan's order (none a failure).
    """

    body: dict[str, object]
    finals: Sequence[FinalEvent]

    @property
    def prompt_tokens(self) -> int:
        """The prompt's tokens, counted once (a group's choices share one prompt)."""
        return self.finals[0].prompt_tokens

    @property
    def completion_tokens(self) -> int:
        """The tokens generated, over every choice."""
        return sum(final.completion_tokens for final in self.finals)


async def answer(request: Request, resources: ServerResources, plan: AnswerPlan) -> Response:
    """Submits the plan's generations and answers them to the HTTP client, streamed or not:
    every route's one answer path.

    Raises:
        APIError: 409 / 429 / 503 from the submission (before anything is sent); 500 when the
            model failed a non-streamed request.
    """
    if plan.stream:
        return streamed_answer(resources, plan)
    whole = await whole_answer(resources, plan, client_left=partial(client_disconnected, request))
    if whole is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody is left to read it
    return JSONResponse(whole.body)


def streamed_answer(resources: ServerResources, plan: AnswerPlan) -> WatchedEventSourceResponse:
    """Submits the plan's generations and answers them as SSE (``sse_events``), pinging while
    it waits.

    Raises:
        APIError: 409 / 429 / 503 from the submission (before anything is sent).
    """
    handles = submit_all(resources, plan.generations)
    separator = plan.formats[0].sse_separator
    return WatchedEventSourceResponse(
        sse_events(handles, resources.engine, plan.formats, plan.trailer),
        ping=resources.config.sse_ping_interval,
        sep=separator,
        send_timeout=resources.config.sse_send_timeout,
        ping_message_factory=lambda: ServerSentEvent(comment="ping", sep=separator),
        headers={"Cache-Control": "no-cache"},
    )


async def whole_answer(
    resources: ServerResources,
    plan: AnswerPlan,
    *,
    client_left: Callable[[], Awaitable[None]] | None = None,
) -> WholeAnswer | None:
    """Submits the plan's generations and waits for every final event: the one group-aware
    answer of a JSON route, of ``n`` choices and of a batch line (which has no client).

    Args:
        client_left: returns once the client has gone (HTTP: ``http.disconnect``); None when
            nobody can leave.

    Returns:
        The answer; None when the client left first (its requests are then cancelled).

    Raises:
        APIError: as ``submit_all``; 500 when the model failed one of the generations.
    """
    engine = resources.engine
    handles = submit_all(resources, plan.generations)
    try:
        finals = await finals_unless_left(handles, client_left)
    except asyncio.CancelledError:
        abort_unfinished(engine, handles)
        raise
    if finals is None:
        abort_unfinished(engine, handles)
        return None
    raise_failure(finals)
    return WholeAnswer(plan.body(finals), finals)


async def finals_unless_left(
    handles: Sequence[RequestHandle], client_left: Callable[[], Awaitable[None]] | None
) -> list[FinalEvent] | None:
    """Every handle's final event, in order; None when ``client_left`` returned first (the
    requests are left running: the caller cancels them)."""
    results = asyncio.gather(*(handle.result() for handle in handles))
    if client_left is None:
        return list(await results)
    leaving = asyncio.ensure_future(client_left())
    try:
        done, _ = await asyncio.wait({results, leaving}, return_when=asyncio.FIRST_COMPLETED)
        return list(results.result()) if results in done else None
    finally:
        if results.cancel():
            # a cancelled gather ends holding a CancelledError as its exception (Python
            # 3.11), which asyncio logs with a traceback unless someone reads it
            results.add_done_callback(_read_outcome)
        leaving.cancel()


def _read_outcome(future: asyncio.Future[object]) -> None:
    """Marks a finished future's exception as read (a done callback)."""
    if not future.cancelled():
        future.exception()


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
    trailer: Callable[[Sequence[FinalEvent]], Iterable[SSEEvent]] | None = None,
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
        events: list[SSEEvent] = []
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
