"""The native wire format (``POST /generate``, API.md): a ``GenerateResponse`` body, or SSE
``token`` events (``TokenEventData``) ending with one ``done`` (``DoneEventData``) or ``error``;
and the plan of a native request's answer (``native_plan``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sse_starlette import ServerSentEvent

from app.api.answers import AnswerPlan, finish_reason_name
from app.api.errors import APIError, error_body
from app.api.request_builder import RequestOrigin
from app.api.resources import ServerResources
from app.api.schemas import (
    DoneEventData,
    GenerateRequestBody,
    GenerateResponse,
    TimingsBody,
    TokenEventData,
    Usage,
    logprob_bodies,
)
from app.api.sse_frames import SSEEvent, compact_json, json_event
from app.engine.request import FinalEvent, TokenEvent


async def native_plan(
    body: GenerateRequestBody, origin: RequestOrigin, resources: ServerResources
) -> AnswerPlan:
    """The request built from ``body`` (``RequestBuilder.build``), answered in ``NativeAnswer``.

    Raises:
        APIError: the builder's refusals (400 / 422).
    """
    generation = await resources.builder.build(body.generation_params(), origin)
    answer_format = NativeAnswer(
        origin.request_id,
        logprobs=body.logprobs is not None,
        prompt_logprobs=body.prompt_logprobs is not None,
    )
    return AnswerPlan([generation], [answer_format], stream=body.stream)


@dataclass(frozen=True, slots=True)
class NativeAnswer:
    """The native wire format of one request's answer (``app.api.answers.AnswerFormat``)."""

    request_id: str
    logprobs: bool = False  # the request asked for logprobs: the answer carries them
    prompt_logprobs: bool = False  # and for prompt logprobs (the JSON answer, the done event)
    sse_separator: str | None = None  # sse-starlette's default, "\r\n"

    def response(self, final: FinalEvent) -> dict[str, object]:
        return GenerateResponse(
            id=self.request_id,
            text=final.text,
            token_ids=list(final.token_ids),
            logprobs=logprob_bodies(final.logprobs) if self.logprobs else None,
            **self._ending(final),
        ).model_dump(exclude=self._unasked(("logprobs", "prompt_logprobs")))

    def opening(self) -> Iterable[ServerSentEvent]:
        return ()

    def token(self, event: TokenEvent) -> Iterable[SSEEvent]:
        """A ``TokenEventData`` body. Without logprobs (floats) it is built as a plain dict in
        the model's field order and framed by ``json_event``: this runs once per streamed
        event."""
        if not self.logprobs:
            data = {"id": self.request_id, "text": event.text, "token_ids": list(event.token_ids)}
            yield json_event(data, event="token")
            return
        data = TokenEventData(
            id=self.request_id,
            text=event.text,
            token_ids=list(event.token_ids),
            logprobs=logprob_bodies(event.logprobs),  # type: ignore[arg-type]
        ).model_dump()
        yield ServerSentEvent(data=compact_json(data), event="token")

    def final(self, final: FinalEvent) -> Iterable[ServerSentEvent]:
        done = DoneEventData(id=self.request_id, **self._ending(final)).model_dump(
            exclude=self._unasked(("prompt_logprobs",))
        )
        yield ServerSentEvent(data=compact_json(done), event="done")

    def failure(self, error: APIError) -> Iterable[ServerSentEvent]:
        body = error_body(error.type, error.message, error.param)
        yield ServerSentEvent(data=compact_json(body), event="error")

    def closing(self) -> Iterable[ServerSentEvent]:
        return ()

    def _unasked(self, names: tuple[str, ...]) -> set[str]:
        """Of these optional fields, those the request did not ask for (left out)."""
        asked = {"logprobs": self.logprobs, "prompt_logprobs": self.prompt_logprobs}
        return {name for name in names if not asked[name]}

    def _ending(self, final: FinalEvent) -> dict[str, object]:
        """The fields a ``GenerateResponse`` and the ``done`` event share."""
        ttft_ms = final.timings.ttft_ms
        return {
            "prompt_logprobs": (
                logprob_bodies(final.prompt_logprobs) if self.prompt_logprobs else None
            ),
            "finish_reason": finish_reason_name(final.finish_reason),
            "stop_reason": final.stop_reason,
            "usage": Usage(
                prompt_tokens=final.prompt_tokens, completion_tokens=final.completion_tokens
            ),
            "timings": TimingsBody(
                queued_ms=round(final.timings.queued_ms, 3),
                ttft_ms=None if ttft_ms is None else round(ttft_ms, 3),
                total_ms=round(final.timings.total_ms, 3),
            ),
        }
