"""``X-Request-Id`` on every request and every response (pure ASGI, so streams pass untouched).

A client-sent id must be 1..128 characters of ``A-Za-z0-9._-`` (API.md); anything else is a 422.
Without one the server makes an unguessable id (128 random bits), prefixed with the replica id
when one is configured so that a load balancer can route a later DELETE to the right replica.

This middleware also answers an exception that escaped every handler with the generic 500 body,
so that even that response carries the id and never a stack trace.
"""

from __future__ import annotations

import logging
import re
import secrets

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import error_body

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}")


def make_request_id(replica_id: str | None = None) -> str:
    """A fresh id: 32 hex digits, ``"<replica_id>-"`` in front when given."""
    token = secrets.token_hex(16)
    return f"{replica_id}-{token}" if replica_id else token


class RequestIdMiddleware:
    """Puts the request id in ``request.state.request_id`` and in the response headers."""

    def __init__(self, app: ASGIApp, *, replica_id: str | None = None) -> None:
        self.app = app
        self.replica_id = replica_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client_id = Headers(scope=scope).get(REQUEST_ID_HEADER)
        if client_id is not None and not REQUEST_ID_PATTERN.fullmatch(client_id):
            response = JSONResponse(
                error_body(
                    "invalid_request",
                    "X-Request-Id must be 1..128 characters of A-Za-z0-9._-",
                    REQUEST_ID_HEADER,
                ),
                status_code=422,
                headers={REQUEST_ID_HEADER: make_request_id(self.replica_id)},
            )
            await response(scope, receive, send)
            return
        request_id = client_id or make_request_id(self.replica_id)
        scope.setdefault("state", {})["request_id"] = request_id
        response_started = False

        async def send_with_id(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            if response_started:
                raise
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            response = JSONResponse(
                error_body("internal", "internal server error"),
                status_code=500,
                headers={REQUEST_ID_HEADER: request_id},
            )
            await response(scope, receive, send)
