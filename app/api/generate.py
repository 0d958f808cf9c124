"""``POST /generate`` (JSON or SSE) and ``DELETE /generate/{id}``: the native API (API.md).

``POST /generate`` is ``app.api.request_path.GENERATE`` on the one request path: the body
validated once (``GenerateRequestBody``), then the early refusal (429/503; never for
``max_tokens`` 0), the frozen request built (``RequestBuilder``), and the answer in the native
format (``app.api.native_answer.NativeAnswer``).
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request

from app.api.errors import APIError
from app.api.request_path import GENERATE, add_generating_route
from app.api.resources import resources_of
from app.api.schemas import CancelResponse, ErrorResponse, GenerateResponse

logger = logging.getLogger(__name__)

router = APIRouter()

_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 409, 413, 422, 429, 500, 503)
}

add_generating_route(
    router,
    GENERATE,
    name="generate",
    description="Generates text for one prompt; see API.md. The body is JSON whatever its "
    "Content-Type.",
    responses={
        **_ERROR_RESPONSES,
        200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE if stream"},
    },
    response_model=GenerateResponse,
)


@router.delete("/generate/{request_id}", response_model=CancelResponse, responses=_ERROR_RESPONSES)
async def cancel_generation(request_id: str, request: Request) -> CancelResponse:
    """Cancels a waiting or running request; 404 if unknown, finished or already cancelled."""
    resources = resources_of(request)
    owner = resources.guard.owner_of(request)
    if not resources.engine.cancel(request_id, owner=owner):
        raise APIError(404, "not_found", f"no request {request_id!r} in flight", param="id")
    return CancelResponse(id=request_id, status="cancelled")
