"""``n`` > 1 on the /v1 endpoints: one prompt, ``n`` sequences, one answer with choices
``0..n-1``.

The group lives at the edge: choice ``i`` is its own ``GenerationRequest`` (id
``<id>`` for choice 0, ``<id>-<i>`` after it; seed ``seed + i`` when the client chose one, else
a random seed each), submitted together and all or none (the queue must hold all ``n``, and
the scheduler admits a group's sequences into slots together: ``GenerationRequest.group_id``).
Sequences with one prompt share its prefill where the model caches prefixes. Each choice is
written by its own answer format (its index, its logprobs' text offsets); the answer's usage
counts the prompt once and the tokens of every choice, as OpenAI's does.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from app.api.admission import refusal_error, submit
from app.api.answers import client_disconnected, failure_error
from app.api.errors import CLIENT_CLOSED_REQUEST, APIError
from app.api.openai.answers import ChatAnswer, CompletionAnswer
from app.api.openai.responses import Usage
from app.api.request_builder import SEED_BITS
from app.api.resources import ServerResources
from app.engine.engine import AsyncEngine, Overloaded
from app.engine.handle import RequestHandle
from app.engine.request import FinalEvent, FinishReason, GenerationRequest, TokenEvent

ChoiceFormat = CompletionAnswer | ChatAnswer


def choice_requests(generation: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The ``n`` requests of a group: choice 0 is ``generation`` itself (group-tagged)."""
    sampling = generation.sampling
    requests = []
    for index in range(n):
        if index == 0:
            seed = sampling.seed
        elif sampling.batch_invariant:  # the client's seed: seed + i (API.md)
            seed = (sampling.seed + index) % (1 << SEED_BITS)
        else:
            seed = secrets.randbits(SEED_BITS)
        requests.append(
            replace(
                generation,
                request_id=generation.request_id
                if index == 0
                else f"{generation.request_id}-{index}",
                sampling=replace(sampling, seed=seed),
                group_id=generation.request_id,
            )
        )
    return requests


def submit_group(
    resources: ServerResources, generations: Sequence[GenerationRequest]
) -> list[RequestHandle]:
    """Submits every choice, or none.

    Raises:
        APIError: 429 when the queue cannot hold them all, or any refusal of ``submit``; the
            choices already submitted are then cancelled.
    """
    engine = resources.engine
    if generations[0].max_tokens > 0:
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
        for handle in handles:
            engine.abort(handle)
        raise
    return handles


def merged_body(formats: Sequence[ChoiceFormat], finals: Sequence[FinalEvent]) -> dict[str, object]:
    """One answer whose choices are every choice's, in index order; usage over all."""
    bodies = [fmt.response(final) for fmt, final in zip(formats, finals, strict=True)]
    merged = dict(bodies[0])
    merged["choices"] = [choice for body in bodies for choice in body["choices"]]  # type: ignore[union-attr]
    merged["usage"] = group_usage(finals).model_dump()
    return merged


def group_usage(finals: Sequence[FinalEvent]) -> Usage:
    prompt = finals[0].prompt_tokens
    completion = sum(final.completion_tokens for final in finals)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


async def answer_choices(
    request: Request,
    resources: ServerResources,
    generations: Sequence[GenerationRequest],
    formats: Sequence[ChoiceFormat],
    *,
    stream: bool,
    include_usage: bool,
) -> Response:
    """``app.api.answers.answer`` for a group: the JSON answer once every choice ended, or
    one SSE stream with every choice's chunks (by index), the usage chunk when asked, one
    ``[DONE]``. A client that leaves cancels every choice.

    Raises:
        APIError: as ``submit_group``; 500 when the model failed a choice (non-streamed).
    """
    handles = submit_group(resources, generations)
    engine = resources.engine
    if stream:
        separator = formats[0].sse_separator
        return EventSourceResponse(
            _group_events(handles, engine, formats, include_usage),
            ping=resources.config.sse_ping_interval,
            sep=separator,
            send_timeout=resources.config.sse_send_timeout,
            ping_message_factory=lambda: ServerSentEvent(comment="ping", sep=separator),
            headers={"Cache-Control": "no-cache"},
        )
    results = asyncio.ensure_future(asyncio.gather(*(h.result() for h in handles)))
    disconnect = asyncio.ensure_future(client_disconnected(request))
    try:
        done, _ = await asyncio.wait({results, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if results not in done:
            _abort_all(engine, handles)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finals = results.result()
    except asyncio.CancelledError:
        _abort_all(engine, handles)
        raise
    finally:
        results.cancel()
        disconnect.cancel()
    for final in finals:
        if final.finish_reason is FinishReason.ERROR:
            raise failure_error(final)
    return JSONResponse(merged_body(formats, finals))


async def whole_group_answer(
    resources: ServerResources,
    generations: Sequence[GenerationRequest],
    formats: Sequence[ChoiceFormat],
) -> tuple[dict[str, object], list[FinalEvent]]:
    """The JSON answer of a group without an HTTP request (the batch runner).

    Raises:
        APIError: as ``submit_group``; 500 when the model failed a choice.
    """
    handles = submit_group(resources, generations)
    finals = list(await asyncio.gather(*(handle.result() for handle in handles)))
    for final in finals:
        if final.finish_reason is FinishReason.ERROR:
            raise failure_error(final)
    return merged_body(formats, finals), finals


async def _group_events(
    handles: Sequence[RequestHandle],
    engine: AsyncEngine,
    formats: Sequence[ChoiceFormat],
    include_usage: bool,
) -> AsyncIterator[ServerSentEvent]:
    queue: asyncio.Queue[tuple[int, TokenEvent | FinalEvent]] = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        async for event in handle.events():
            queue.put_nowait((index, event))

    pumps = [asyncio.ensure_future(pump(i, handle)) for i, handle in enumerate(handles)]
    finals: list[FinalEvent | None] = [None] * len(handles)
    failed = False
    try:
        for fmt in formats:
            for event in fmt.opening():
                yield event
        while any(final is None for final in finals):
            index, item = await queue.get()
            fmt = formats[index]
            if isinstance(item, TokenEvent):
                events = list(fmt.token(item))
            else:
                finals[index] = item
                if item.finish_reason is FinishReason.ERROR:
                    events = list(fmt.failure(failure_error(item)))
                    failed = True
                else:
                    events = list(fmt.final(item))
            for event in events:
                yield event
            if failed:
                break
        if not failed and include_usage:
            yield formats[0].usage_event(group_usage([f for f in finals if f is not None]))
        for event in formats[0].closing():
            yield event
    finally:
        _abort_all(engine, handles)
        for task in pumps:
            task.cancel()


def _abort_all(engine: AsyncEngine, handles: Sequence[RequestHandle]) -> None:
    for handle in handles:
        if not handle.is_finished:
            engine.abort(handle)
