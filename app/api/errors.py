"""The one error shape of the native API, and the handlers that produce it.

Every non-2xx body is ``{"error": {"type": ..., "message": ..., "param": ...}}`` (API.md,
"Errors"). No handler ever puts a stack trace in a body: unexpected exceptions are logged and
answered with a generic 500 ``internal``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client closed the connection first"

_TYPE_BY_STATUS = {
    400: "invalid_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    422: "invalid_request",
    429: "overloaded",
    500: "internal",
    503: "unavailable",
}


class APIError(Exception):
    """An error answer: raise it anywhere in a route.

    Args:
        status: HTTP status code.
        type: the public error type (API.md table), e.g. ``"context_length_exceeded"``.
        message: a client-safe sentence.
        param: the offending field, or None.
        headers: extra response headers (e.g. ``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        type: str,
        message: str,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.param = param
        self.headers = dict(headers or {})


def error_body(type: str, message: str, param: str | None = None) -> dict[str, object]:
    return {"error": {"type": type, "message": message, "param": param}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(error.type, error.message, error.param),
        status_code=error.status,
        headers=error.headers,
    )


def pydantic_message(error: Mapping[str, object]) -> str:
    """The text of one of pydantic's errors (an item of ``ValidationError.errors()``): its
    ``msg``, but for a ``ValueError`` raised by a validator the error's own text, without the
    "Value error, " pydantic puts before it (the CLI's lines and the API's messages read as the
    validator wrote them)."""
    context = error.get("ctx")
    cause = context.get("error") if isinstance(context, Mapping) else None
    if error.get("type") == "value_error" and isinstance(cause, ValueError):
        return str(cause)
    return str(error.get("msg", "invalid value"))


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """Turns pydantic's first complaint into a 422 naming the field (``stop.0`` style). A
    field of several types fails once per type: the complaint that reached deepest into
    the value is the one told (``prompt: [-5]`` is a token id below 0, not "not a string"),
    and the types' own names in pydantic's locations (``str``, ``list[int]``,
    ``literal['none','auto']``, a model's class name) are left out of ``param``."""
    errors = exc.errors()
    if not errors:
        return APIError(422, "invalid_request", "invalid request")
    field = _field_path(errors[0])[:1]
    same_field = [error for error in errors if _field_path(error)[:1] == field]
    first = max(same_field, key=lambda error: len(error.get("loc", ())))  # (ties: the first)
    param = ".".join(_field_path(first)) or None
    message = pydantic_message(first)
    if first.get("type") == "extra_forbidden":
        message = f"unknown field {param!r}"
    elif first.get("type") in ("json_invalid", "json_type"):
        message = "body is not valid JSON: " + message
        param = None
    elif param:
        message = f"{param}: {message}"
    return APIError(422, "invalid_request", message, param=param)


def _field_path(error: Mapping[str, object]) -> list[str]:
    """An error's location as the request's field names and list positions: without
    FastAPI's ``body`` and without the member tags pydantic adds inside a union (a type's
    name: ``str``, ``list[int]``, ``function-after[...]``, ``literal[...]``, a model class)."""
    location = error.get("loc", ())
    assert isinstance(location, tuple | list)
    return [str(part) for part in location if part != "body" and not _is_union_tag(part)]


def _is_union_tag(part: object) -> bool:
    if not isinstance(part, str):
        return False  # a list position
    return "[" in part or part in _TYPE_NAMES or part[:1].isupper()


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = _TYPE_BY_STATUS.get(exc.status_code, "invalid_request")
        message = "not found" if exc.status_code == 404 else str(exc.detail)
        return error_response(
            APIError(exc.status_code, error_type, message, headers=exc.headers or None)
        )

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # The client closed the connection before its body arrived: nobody reads an answer,
        # and it is not a server fault (nginx logs such requests as 499).
        logger.info("%s %s: client left before sending its body", request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, "internal", "internal server error"))


def as_api_error(request: Request, exc: Exception) -> APIError:
    """An exception FastAPI or Starlette raised for ``request`` (a validation error, an unknown
    path or method) as the ``APIError`` every wire format writes in its own shape."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return validation_error(exc)
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"unknown path {request.method} {request.url.path}"
        return APIError(404, "not_found", message, headers=exc.headers)
    code = "method_not_allowed" if exc.status_code == 405 else "invalid_request"
    return APIError(exc.status_code, code, str(exc.detail), headers=exc.headers)
