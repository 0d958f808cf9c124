"""OpenAI's error shape under ``/v1``: ``{"error": {"message", "type", "param", "code"}}``.

Errors are raised as the native ``APIError`` everywhere (admission, the request builder, the
routes) and rendered here, with the statuses of API.md except that a native 422 is a 400, as
OpenAI answers invalid parameters. ``code`` is the native error type (``context_length_exceeded``,
``unauthorized``, ``conflict``, ``overloaded``...) or, for a bad field, ``invalid_value``,
``missing_required_parameter``, ``unknown_parameter`` or ``unsupported_value``; ``type`` is
``authentication_error`` (401), ``rate_limit_error`` (429), ``server_error`` (5xx), else
``invalid_request_error``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api.errors import APIError, as_api_error, validation_error

logger = logging.getLogger(__name__)

V1_PREFIX = "/v1"

_ERROR_TYPE_BY_STATUS = {401: "authentication_error", 429: "rate_limit_error"}
_CODE_BY_NATIVE_TYPE = {"invalid_request": "invalid_value"}
_CODE_BY_PYDANTIC_TYPE = {
    "missing": "missing_required_parameter",
    "unsupported_value": "unsupported_value",
    "extra_forbidden": "unknown_parameter",  # OpenAI's code for a field it does not know
}


def openai_error_body(error: APIError) -> dict[str, object]:
    """The native error as OpenAI writes one (see the module doc for the mapping)."""
    if error.status >= 500:
        error_type = "server_error"
    else:
        error_type = _ERROR_TYPE_BY_STATUS.get(error.status, "invalid_request_error")
    return {
        "error": {
            "message": error.message,
            "type": error_type,
            "param": error.param,
            "code": _CODE_BY_NATIVE_TYPE.get(error.type, error.type),
        }
    }


def openai_status(error: APIError) -> int:
    """The HTTP status of the native error under ``/v1``: a 422 is a 400, the rest as they are."""
    return 400 if error.status == 422 else error.status


def openai_error_response(error: APIError) -> JSONResponse:
    return JSONResponse(
        openai_error_body(error), status_code=openai_status(error), headers=error.headers
    )


def invalid_field(exc: ValidationError) -> APIError:
    """pydantic's first complaint as a 400 naming the field (``messages.1.role`` style)."""
    native = validation_error(exc)
    errors = exc.errors()
    kind = str(errors[0].get("type", "")) if errors else ""
    code = _CODE_BY_PYDANTIC_TYPE.get(kind, "invalid_value")
    return APIError(400, code, native.message, param=native.param)


class OpenAIRoute(APIRoute):
    """An unexpected exception in a /v1 route becomes a logged 500 ``APIError``, so that it is
    answered in OpenAI's shape too (not by the request-id middleware's native fallback)."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except (APIError, StarletteHTTPException, RequestValidationError):
                raise
            except Exception:
                logger.exception("unhandled error on %s %s", request.method, request.url.path)
                raise APIError(500, "internal", "internal server error") from None

        return handle


def install_error_handlers(app: FastAPI) -> None:
    """Errors under ``/v1`` in OpenAI's shape; every other path keeps the native handler.

    Call after ``app.api.errors.install_error_handlers``: it wraps the handlers installed there.
    """
    for exc_class in (APIError, RequestValidationError, StarletteHTTPException):
        app.add_exception_handler(exc_class, _under_v1_or(app.exception_handlers[exc_class]))


def _under_v1_or(native: Callable) -> Callable:
    async def handle(request: Request, exc: Exception) -> Response:
        path = request.url.path
        if path != V1_PREFIX and not path.startswith(V1_PREFIX + "/"):
            return await native(request, exc)
        return openai_error_response(as_api_error(request, exc))

    return handle
