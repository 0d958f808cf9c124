"""``POST /generate`` (JSON or SSE) and ``DELETE /generate/{id}``: the native API (API.md).

The route reads and validates the body once (``GenerateRequestBody``), refuses early when the
engine would (429/503), builds the frozen request (``RequestBuilder``) and answers it through
``app.api.answers`` in the native format, ``NativeAnswer``: a ``GenerateResponse`` body, or SSE
``token`` events (``TokenEventData``) ending with one ``done`` (``DoneEventData``) or ``error``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError
from sse_starlette import ServerSentEvent

from app.api.admission import read_body, refuse_if_overloaded
from app.api.answers import answer, finish_reason_name
from app.api.errors import APIError, error_body, validation_error
from app.api.request_builder import RequestOrigin
from app.api.resources import resources_of
from app.api.schemas import (
    CancelResponse,
    DoneEventData,
    ErrorResponse,
    GenerateRequestBody,
    GenerateResponse,
    TimingsBody,
    TokenEventData,
    Usage,
    logprob_bodies,
    request_body_openapi,
)
from app.engine.request import FinalEvent, TokenEvent

logger = logging.getLogger(__name__)

router = APIRouter()

_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 409, 413, 422, 429, 500, 503)
}


@router.post(
    "/generate",
    response_model=GenerateResponse,
    responses={
        **_ERROR_RESPONSES,
        200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE if stream"},
    },
    openapi_extra=request_body_openapi(GenerateRequestBody),
)
async def generate(request: Request) -> Response:
    """Generates text for one prompt; see API.md. The body is JSON whatever its Content-Type."""
    arrived_at = time.perf_counter()
    resources = resources_of(request)
    origin = RequestOrigin(request.state.request_id, resources.guard.owner_of(request), arrived_at)
    body = parse_body(await read_body(request, resources.config.max_body_bytes))
    refuse_if_overloaded(resources, max_tokens=body.max_tokens)
    generation = await resources.builder.build(body.generation_params(), origin)
    answer_format = NativeAnswer(
        origin.request_id,
        logprobs=body.logprobs is not None,
        prompt_logprobs=body.prompt_logprobs is not None,
    )
    return await answer(request, resources, [generation], [answer_format], stream=body.stream)


@router.delete("/generate/{request_id}", response_model=CancelResponse, responses=_ERROR_RESPONSES)
async def cancel_generation(request_id: str, request: Request) -> CancelResponse:
    """Cancels a waiting or running request; 404 if unknown, finished or already cancelled."""
    resources = resources_of(request)
    owner = resources.guard.owner_of(request)
    if not resources.engine.cancel(request_id, owner=owner):
        raise APIError(404, "not_found", f"no request {request_id!r} in flight", param="id")
    return CancelResponse(id=request_id, status="cancelled")


def parse_body(raw: bytes) -> GenerateRequestBody:
    """The validated body (JSON whatever the Content-Type); raises APIError 422 otherwise."""
    try:
        return GenerateRequestBody.model_validate_json(raw or b"null")
    except ValidationError as exc:
        raise validation_error(exc) from None


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

    def token(self, event: TokenEvent) -> Iterable[ServerSentEvent]:
        """A ``TokenEventData`` body; built as a plain dict in its field order (the same
        JSON) unless it carries logprobs: this runs once per streamed event."""
        if self.logprobs:
            data = TokenEventData(
                id=self.request_id,
                text=event.text,
                token_ids=list(event.token_ids),
                logprobs=logprob_bodies(event.logprobs),  # type: ignore[arg-type]
            ).model_dump()
        else:
            data = {"id": self.request_id, "text": event.text, "token_ids": list(event.token_ids)}
        yield ServerSentEvent(data=json.dumps(data, ensure_ascii=False), event="token")

    def final(self, final: FinalEvent) -> Iterable[ServerSentEvent]:
        done = DoneEventData(id=self.request_id, **self._ending(final)).model_dump(
            exclude=self._unasked(("prompt_logprobs",))
        )
        yield ServerSentEvent(data=json.dumps(done, ensure_ascii=False), event="done")

    def failure(self, error: APIError) -> Iterable[ServerSentEvent]:
        body = error_body(error.type, error.message, error.param)
        yield ServerSentEvent(data=json.dumps(body), event="error")

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
