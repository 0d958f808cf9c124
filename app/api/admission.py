"""Admission, for every generating route (``app.api.request_path``'s table).

Reading the body under the size limit, refusing early (429 overloaded, 503 not serving) before
any expensive work, and handing the frozen request to the engine. Every refusal raises the native
``APIError``; each family of routes renders it in its own error shape.
"""

from __future__ import annotations

from fastapi import Request

from app.api.errors import APIError
from app.api.resources import ServerResources
from app.engine.engine import DuplicateRequestId, EngineUnavailable, Overloaded
from app.engine.handle import RequestHandle
from app.engine.request import GenerationRequest


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The whole body, refusing more than ``limit_bytes`` before reading it all.

    Raises:
        APIError: 413 ``payload_too_large`` (by Content-Length, or while streaming it in).
    """
    too_large = body_too_large(limit_bytes)
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


def body_too_large(limit_bytes: int) -> APIError:
    """The 413 of a body over ``--max-body-bytes`` (``limit_bytes``)."""
    return APIError(413, "payload_too_large", f"request body is larger than {limit_bytes} bytes")


def admission_refusal(
    resources: ServerResources, *, max_tokens: int | None = None
) -> Overloaded | EngineUnavailable | None:
    """Why a generating request would be refused now, before any expensive work (tokenizing,
    the engine), or None when it would be taken; ``submit`` checks again with the real prompt
    size. A request with ``max_tokens == 0`` never waits for a slot, so it is never refused as
    overloaded. Counts nothing: ``refusal_error`` does, once the refusal is answered.
    """
    if not resources.engine.is_alive:
        return EngineUnavailable(resources.engine.state.value)
    if max_tokens == 0:
        return None
    try:
        resources.engine.check_admission(prompt_tokens=0)
    except Overloaded as exc:
        return exc
    return None


def refuse_if_overloaded(resources: ServerResources, *, max_tokens: int | None = None) -> None:
    """Raises the refusal of ``admission_refusal``, if any.

    Raises:
        APIError: 429 (queue full, ``Retry-After`` set), 503 (not serving).
    """
    refusal = admission_refusal(resources, max_tokens=max_tokens)
    if refusal is not None:
        raise refusal_error(resources, refusal)


def submit(resources: ServerResources, generation: GenerationRequest) -> RequestHandle:
    """Hands the request to the engine.

    Raises:
        APIError: 409 (id in flight), 429 (queue full, ``Retry-After`` set), 503 (not serving).
    """
    try:
        return resources.engine.submit(generation)
    except DuplicateRequestId:
        raise APIError(
            409,
            "conflict",
            f"a request with id {generation.request_id!r} is already in flight",
            param="X-Request-Id",
        ) from None
    except (Overloaded, EngineUnavailable) as exc:
        raise refusal_error(resources, exc) from None


def refusal_error(resources: ServerResources, exc: Overloaded | EngineUnavailable) -> APIError:
    """The answer to a refusal (429 with ``Retry-After``, or 503), counted in the rejected
    requests metric."""
    if isinstance(exc, Overloaded):
        resources.engine.metrics.requests_rejected.labels(type="overloaded").inc()
        return APIError(
            429,
            "overloaded",
            f"the server is overloaded: {exc}; retry later",
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    resources.engine.metrics.requests_rejected.labels(type="unavailable").inc()
    return APIError(503, "unavailable", "the server is not accepting requests")
