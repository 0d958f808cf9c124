"""The admission gate: a generating request the engine would refuse is answered in front of
FastAPI (pure ASGI), so that an overload burst's 429s stay cheap.

Through FastAPI a refusal costs its routing, its request objects and its exception handlers,
about 0.4 ms of event loop each; under a burst of many times the capacity that queueing is what
made 429s slow. The gate guards every generating route of ``app.api.request_path``'s table
(``WIRE_FORMATS``) and answers exactly what the route would: it runs the route's own checks in
the route's order (``request_path.early_refusal``: ``ApiKeyGuard``, then, for a route whose
check order is ``BODY_FIRST``, ``read_body`` and the route's schema, then
``admission_refusal``: the engine's ``check_admission``), and words the refusal with the
route's error renderer, the native shape, OpenAI's under ``/v1``, Anthropic's under
``/v1/messages``:

- ``POST /generate``: key (401), body (413), fields (422), then refusal: its ``max_tokens`` is
  read first, since a request with ``max_tokens`` 0 is never refused as overloaded;
- ``POST /v1/completions``, ``/v1/chat/completions``, ``/v1/responses``, ``/v1/messages``: key
  (401), then refusal, before the body is read.

When an earlier check fails, or the request would be taken, the gate passes it on, replaying
the body messages it read, and the route gives its answer. The gate looks at nothing while the
engine takes requests. Refusals count in ``slotserve_requests_rejected_total`` as the route's do;
the gate sits inside ``RequestIdMiddleware``, so they carry ``X-Request-Id``. The routes keep
their own check, for a queue that fills between the gate and the route.
"""

from __future__ import annotations

from collections import deque

from starlette.datastructures import State
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.admission import admission_refusal, refusal_error
from app.api.request_path import WIRE_FORMATS, WireFormat, early_refusal
from app.api.resources import loaded_resources


class AdmissionGate:
    """Answers the refusal (429, or 503 while not serving) of a generating ``POST`` before
    FastAPI's routing; every other request passes untouched.

    Args:
        app: the app behind the gate.
        state: the FastAPI app's ``state``, which holds the resources once the model is loaded.
    """

    def __init__(self, app: ASGIApp, *, state: State) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = _gated_route(scope)
        resources = loaded_resources(self.state) if route is not None else None
        if route is None or resources is None or admission_refusal(resources) is None:
            await self.app(scope, receive, send)
            return
        recording = _RecordingReceive(receive)
        refusal = await early_refusal(route, Request(scope, recording), resources)
        if refusal is None:
            await self.app(scope, recording.replay(), send)
            return
        response = route.error_response(refusal_error(resources, refusal))
        await response(scope, receive, send)


def _gated_route(scope: Scope) -> WireFormat | None:
    if scope["type"] != "http" or scope["method"] != "POST":
        return None
    return WIRE_FORMATS.get(scope["path"])


class _RecordingReceive:
    """The server's ``receive``, keeping every message read, so that the app behind the gate
    can be handed the same messages in the same order (``replay``) and then the rest."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._messages: list[Message] = []

    async def __call__(self) -> Message:
        message = await self._receive()
        self._messages.append(message)
        return message

    def replay(self) -> Receive:
        pending = deque(self._messages)
        receive = self._receive

        async def replaying() -> Message:
            if pending:
                return pending.popleft()
            return await receive()

        return replaying
