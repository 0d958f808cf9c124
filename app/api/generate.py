"""``POST /generate`` (JSON or SSE) and ``DELETE /generate/{id}``.

The route validates once (pydantic, then the model-dependent checks: vocabulary, context
length), turns the body into a frozen ``GenerationRequest``, submits it, and then only waits on
the request's handle. A client that leaves (stream or not) cancels its request: the disconnect
becomes ``engine.abort(handle)`` and the cancellation is re-raised, never swallowed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent

from app.api.errors import APIError, error_body, validation_error
from app.api.resources import ServerResources, resources_of
from app.api.schemas import (
    CancelResponse,
    ErrorResponse,
    GenerateRequestBody,
    GenerateResponse,
)
from app.engine.engine import DuplicateRequestId, EngineUnavailable, Overloaded
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

SSE_PING_INTERVAL_S = 15.0
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client closed the connection first"

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
            "content": {
                "application/json": {"schema": GenerateRequestBody.model_json_schema()}
            },
        }
    },
)
async def generate(request: Request) -> Response:
    """Generates text for one prompt; see API.md. The body is JSON whatever its Content-Type."""
    arrived_at = time.perf_counter()
    resources = resources_of(request)
    owner = resources.guard.owner_of(request)
    body = _parse_body(await read_body(request, resources.config.max_body_bytes))
    generation = _to_generation_request(
        body, resources, request_id=request.state.request_id, owner=owner, arrived_at=arrived_at
    )
    handle = _submit(resources, generation)
    if body.stream:
        return EventSourceResponse(
            _sse_events(handle, resources),
            ping=SSE_PING_INTERVAL_S,
            send_timeout=resources.config.sse_send_timeout,
            ping_message_factory=lambda: ServerSentEvent(comment="ping"),
            headers={"Cache-Control": "no-cache"},
        )
    final = await _final_unless_disconnected(request, handle, resources)
    if final is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody is left to read it
    if final.finish_reason is FinishReason.ERROR:
        raise APIError(500, "internal", final.error or "the model failed on this request")
    return JSONResponse(_response_body(handle.request_id, final).model_dump())


@router.delete(
    "/generate/{request_id}", response_model=CancelResponse, responses=_ERROR_RESPONSES
)
async def cancel_generation(request_id: str, request: Request) -> CancelResponse:
    """Cancels a waiting or running request; 404 if unknown, finished or already cancelled."""
    resources = resources_of(request)
    owner = resources.guard.owner_of(request)
    if not resources.engine.cancel(request_id, owner=owner):
        raise APIError(404, "not_found", f"no request {request_id!r} in flight", param="id")
    return CancelResponse(id=request_id, status="cancelled")


# --------------------------------------------------------------------------- validation


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The whole body, refusing more than ``limit_bytes`` before reading it all.

    Raises:
        APIError: 413 ``payload_too_large`` (by Content-Length, or while streaming it in).
    """
    too_large = APIError(
        413, "payload_too_large", f"request body is larger than {limit_bytes} bytes"
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_body(raw: bytes) -> GenerateRequestBody:
    try:
        return GenerateRequestBody.model_validate_json(raw or b"null")
    except ValidationError as exc:
        raise validation_error(exc) from None


def _to_generation_request(
    body: GenerateRequestBody,
    resources: ServerResources,
    *,
    request_id: str,
    owner: str | None,
    arrived_at: float,
) -> GenerationRequest:
    caps = resources.engine.model.capabilities
    if body.max_tokens > resources.max_tokens_cap:
        raise APIError(
            422,
            "invalid_request",
            f"max_tokens: must be <= {resources.max_tokens_cap}",
            param="max_tokens",
        )
    bad_ids = [token for token in body.stop_token_ids if token >= caps.vocab_size]
    if bad_ids:
        raise APIError(
            422,
            "invalid_request",
            f"stop_token_ids: {bad_ids[0]} is outside the vocabulary (size {caps.vocab_size})",
            param="stop_token_ids",
        )
    try:
        prompt_ids = tuple(resources.engine.model.tokenizer.encode(body.prompt))
    except Exception:
        logger.exception("request %s: tokenizing the prompt failed", request_id)
        raise APIError(500, "internal", "failed to tokenize the prompt") from None
    if not prompt_ids:
        raise APIError(422, "invalid_request", "prompt: encodes to no tokens", param="prompt")
    if len(prompt_ids) > resources.max_prompt_tokens:
        raise APIError(
            422,
            "invalid_request",
            f"prompt: {len(prompt_ids)} tokens, the limit is {resources.max_prompt_tokens}",
            param="prompt",
        )
    if len(prompt_ids) + body.max_tokens > caps.context_length:
        raise APIError(
            400,
            "context_length_exceeded",
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({body.max_tokens}) exceeds the "
            f"context length of {caps.context_length} tokens",
            param="prompt",
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
        ),
        stop=StopCriteria(
            stop_strings=tuple(body.stop),
            stop_token_ids=frozenset(body.stop_token_ids),
            ignore_eos=body.ignore_eos,
        ),
        owner=owner,
        arrived_at=arrived_at,
    )


def _submit(resources: ServerResources, generation: GenerationRequest) -> RequestHandle:
    try:
        return resources.engine.submit(generation)
    except DuplicateRequestId:
        raise APIError(
            409,
            "conflict",
            f"a request with id {generation.request_id!r} is already in flight",
            param="X-Request-Id",
        ) from None
    except Overloaded as exc:
        resources.engine.metrics.requests_rejected.labels(type="overloaded").inc()
        raise APIError(
            429,
            "overloaded",
            f"the server is overloaded: {exc}; retry later",
            headers={"Retry-After": str(exc.retry_after_s)},
        ) from None
    except EngineUnavailable:
        resources.engine.metrics.requests_rejected.labels(type="unavailable").inc()
        raise APIError(503, "unavailable", "the server is not accepting requests") from None


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


async def _final_unless_disconnected(
    request: Request, handle: RequestHandle, resources: ServerResources
) -> FinalEvent | None:
    """Waits for the final event while listening for the client leaving.

    Returns None when the client disconnected first; the request is then cancelled.
    """
    result = asyncio.ensure_future(handle.result())
    disconnect = asyncio.ensure_future(_client_disconnected(request))
    try:
        done, _ = await asyncio.wait({result, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if result in done:
            return result.result()
        resources.engine.abort(handle)
        return None
    except asyncio.CancelledError:
        resources.engine.abort(handle)
        raise
    finally:
        result.cancel()
        disconnect.cancel()


async def _client_disconnected(request: Request) -> None:
    """Returns once the ASGI server reports ``http.disconnect`` (body already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _sse_events(handle: RequestHandle, resources: ServerResources):  # noqa: ANN202
    """The SSE body: ``token`` events, then exactly one ``done`` or ``error`` event."""
    try:
        async for event in handle.events():
            if isinstance(event, TokenEvent):
                data = {"id": handle.request_id, "text": event.text, "token_ids": list(event.token_ids)}
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
