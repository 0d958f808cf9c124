"""``POST /generate`` (JSON or SSE) and ``DELETE /generate/{id}``.

The route validates once (pydantic, then the model-dependent checks: vocabulary, context
length), turns the body into a frozen ``GenerationRequest``, submits it, and then only waits on
the request's handle. A client that leaves (stream or not) cancels its request: the disconnect
becomes ``engine.abort(handle)`` and the cancellation is re-raised, never swallowed.
"""

from __future__ import annotations

import json
import logging
import secrets
import time

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent

from app.api.errors import CLIENT_CLOSED_REQUEST, APIError, error_body, validation_error
from app.api.resources import ServerResources, resources_of
from app.api.schemas import (
    CancelResponse,
    ErrorResponse,
    GenerateRequestBody,
    GenerateResponse,
)
from app.api.submission import (
    check_context_length,
    check_max_tokens,
    encode_prompt,
    final_unless_disconnected,
    read_body,
    refuse_if_overloaded,
    submit,
)
from app.engine.handle import RequestHandle
from app.engine.request import (
    FinalEvent,
    FinishReason,
    GenerationRequest,
    StopCriteria,
    TokenEvent,
)
from app.models.base import SamplingParams

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
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": GenerateRequestBody.model_json_schema()}},
        }
    },
)
async def generate(request: Request) -> Response:
    """Generates text for one prompt; see API.md. The body is JSON whatever its Content-Type."""
    arrived_at = time.perf_counter()
    resources = resources_of(request)
    owner = resources.guard.owner_of(request)
    body = parse_body(await read_body(request, resources.config.max_body_bytes))
    refuse_if_overloaded(resources, max_tokens=body.max_tokens)
    generation = await _to_generation_request(
        body, resources, request_id=request.state.request_id, owner=owner, arrived_at=arrived_at
    )
    handle = submit(resources, generation)
    if body.stream:
        return EventSourceResponse(
            _sse_events(handle, resources),
            ping=resources.config.sse_ping_interval,
            send_timeout=resources.config.sse_send_timeout,
            ping_message_factory=lambda: ServerSentEvent(comment="ping"),
            headers={"Cache-Control": "no-cache"},
        )
    final = await final_unless_disconnected(request, handle, resources)
    if final is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody is left to read it
    if final.finish_reason is FinishReason.ERROR:
        raise APIError(500, "internal", final.error or "the model failed on this request")
    return JSONResponse(_response_body(handle.request_id, final).model_dump())


@router.delete("/generate/{request_id}", response_model=CancelResponse, responses=_ERROR_RESPONSES)
async def cancel_generation(request_id: str, request: Request) -> CancelResponse:
    """Cancels a waiting or running request; 404 if unknown, finished or already cancelled."""
    resources = resources_of(request)
    owner = resources.guard.owner_of(request)
    if not resources.engine.cancel(request_id, owner=owner):
        raise APIError(404, "not_found", f"no request {request_id!r} in flight", param="id")
    return CancelResponse(id=request_id, status="cancelled")


# --------------------------------------------------------------------------- validation


def parse_body(raw: bytes) -> GenerateRequestBody:
    """The validated body (JSON whatever the Content-Type); raises APIError 422 otherwise."""
    try:
        return GenerateRequestBody.model_validate_json(raw or b"null")
    except ValidationError as exc:
        raise validation_error(exc) from None


async def _to_generation_request(
    body: GenerateRequestBody,
    resources: ServerResources,
    *,
    request_id: str,
    owner: str | None,
    arrived_at: float,
) -> GenerationRequest:
    caps = resources.engine.model.capabilities
    check_max_tokens(resources, body.max_tokens, param="max_tokens")
    bad_ids = [token for token in body.stop_token_ids if token >= caps.vocab_size]
    if bad_ids:
        raise APIError(
            422,
            "invalid_request",
            f"stop_token_ids: {bad_ids[0]} is outside the vocabulary (size {caps.vocab_size})",
            param="stop_token_ids",
        )
    prompt_ids = await encode_prompt(resources, body.prompt, request_id=request_id, param="prompt")
    check_context_length(
        resources,
        prompt_tokens=len(prompt_ids),
        max_tokens=body.max_tokens,
        prompt_param="prompt",
        max_tokens_param="max_tokens",
    )
    return GenerationRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        max_tokens=body.max_tokens,
        sampling=SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed if body.seed is not None else secrets.randbits(63),
            batch_invariant=body.seed is not None,
        ),
        stop=StopCriteria(
            stop_strings=tuple(body.stop),
            stop_token_ids=frozenset(body.stop_token_ids),
            ignore_eos=body.ignore_eos,
        ),
        owner=owner,
        arrived_at=arrived_at,
    )


# --------------------------------------------------------------------------- answers


def _response_body(request_id: str, final: FinalEvent) -> GenerateResponse:
    return GenerateResponse(
        id=request_id,
        text=final.text,
        token_ids=list(final.token_ids),
        finish_reason=final.finish_reason.value,  # type: ignore[arg-type]
        stop_reason=final.stop_reason,
        usage={"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens},
        timings={
            "queued_ms": round(final.timings.queued_ms, 3),
            "ttft_ms": None if final.timings.ttft_ms is None else round(final.timings.ttft_ms, 3),
            "total_ms": round(final.timings.total_ms, 3),
        },
    )


async def _sse_events(handle: RequestHandle, resources: ServerResources):  # noqa: ANN202
    """The SSE body: ``token`` events, then exactly one ``done`` or ``error`` event."""
    try:
        async for event in handle.events():
            if isinstance(event, TokenEvent):
                data = {
                    "id": handle.request_id,
                    "text": event.text,
                    "token_ids": list(event.token_ids),
                }
                yield ServerSentEvent(data=json.dumps(data, ensure_ascii=False), event="token")
            elif event.finish_reason is FinishReason.ERROR:
                body = error_body("internal", event.error or "the model failed on this request")
                yield ServerSentEvent(data=json.dumps(body), event="error")
            else:
                done = _response_body(handle.request_id, event).model_dump(
                    exclude={"text", "token_ids"}
                )
                yield ServerSentEvent(data=json.dumps(done, ensure_ascii=False), event="done")
    finally:
        if not handle.is_finished:
            resources.engine.abort(handle)
