"""Anthropic's error shape under ``/v1/messages``: ``{"type": "error", "error": {"type",
"message"}}``.

Errors are raised as the native ``APIError`` everywhere and rendered here with Anthropic's types
and statuses: a native 422 (a bad field) is a 400 ``invalid_request_error``, 401
``authentication_error``, 404 ``not_found_error``, 413 ``request_too_large``, 429
``rate_limit_error``, 503 (loading, shutting down) the 529 ``overloaded_error``, any other 5xx a
500 ``api_error``; the rest keep their status as ``invalid_request_error``.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api.errors import APIError, as_api_error

MESSAGES_PATH = "/v1/messages"
OVERLOADED_STATUS = 529  # Anthropic's status for "overloaded"

_BY_STATUS: dict[int, tuple[str, int]] = {
    400: ("invalid_request_error", 400),
    401: ("authentication_error", 401),
    403: ("permission_error", 403),
    404: ("not_found_error", 404),
    413: ("request_too_large", 413),
    422: ("invalid_request_error", 400),
    429: ("rate_limit_error", 429),
    503: ("overloaded_error", OVERLOADED_STATUS),
}


def anthropic_error_type(error: APIError) -> tuple[str, int]:
    """The Anthropic error type and HTTP status of a native error (see the module doc)."""
    if error.status in _BY_STATUS:
        return _BY_STATUS[error.status]
    if error.status >= 500:
        return "api_error", 500
    return "invalid_request_error", error.status


def anthropic_error_body(error: APIError) -> dict[str, object]:
    """``{"type": "error", "error": {"type", "message"}}`` of a native error."""
    error_type, _ = anthropic_error_type(error)
    return {"type": "error", "error": {"type": error_type, "message": error.message}}


def anthropic_error_response(error: APIError) -> JSONResponse:
    _, status = anthropic_error_type(error)
    headers = dict(error.headers)
    headers.pop("WWW-Authenticate", None)  # Anthropic's 401 names no scheme
    return JSONResponse(anthropic_error_body(error), status_code=status, headers=headers)


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def install_error_handlers(app: FastAPI) -> None:
    """Errors under ``/v1/messages`` in Anthropic's shape; every other path keeps the handler
    installed before (call after ``app.api.openai.errors.install_error_handlers``)."""
    for exc_class in (APIError, RequestValidationError, StarletteHTTPException):
        app.add_exception_handler(exc_class, _under_messages_or(app.exception_handlers[exc_class]))


def _under_messages_or(previous: Callable) -> Callable:
    async def handle(request: Request, exc: Exception) -> Response:
        if not is_messages_path(request.url.path):
            return await previous(request, exc)
        return anthropic_error_response(as_api_error(request, exc))

    return handle
