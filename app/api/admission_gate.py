"""The admission gate: a generating request the engine would refuse is answered in front of
FastAPI (pure ASGI), so that an overload burst's 429s stay cheap.

Through FastAPI a refusal costs its routing, its request objects and its exception handlers,
about 0.4 ms of event loop each; under a burst of many times the capacity that queueing is what
made 429s slow. The gate answers exactly what the route would: it runs the route's own checks
(``ApiKeyGuard``, ``read_body``, ``generate.parse_body``, ``admission_refusal``: the engine's
``check_admission``) in the route's order, and words the refusal with the route family's error
renderer, the native shape, OpenAI's under ``/v1``, Anthropic's under ``/v1/messages``:

- ``POST /generate``: key (401), body (413), fields (422), then refusal: its ``max_tokens`` is
  read first, since a request with ``max_tokens`` 0 is never refused as overloaded;
- ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/messages``: key (401),
  then refusal, before the body is read.

When an earlier check fails, or the request would be taken, the gate passes it on, replaying
the body messages it read, and the route gives its answer. The gate looks at nothing while the
engine takes requests. Refusals count in ``slotserve_requests_rejected_total`` as the route's do;
the gate sits inside ``RequestIdMiddleware``, so they carry ``X-Request-Id``. The routes keep
their own check, for a queue that fills between the gate and the route.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from starlette.datastructures import State
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api import generate
from app.api.admission import admission_refusal, read_body, refusal_error
from app.api.anthropic.errors import MESSAGES_PATH, anthropic_error_response
from app.api.errors import APIError, error_response
from app.api.openai.errors import V1_PREFIX, openai_error_response
from app.api.resources import ServerResources, loaded_resources
from app.engine.engine import EngineUnavailable, Overloaded


@dataclass(frozen=True, slots=True)
class GatedRoute:
    """How one generating route refuses.

    Attributes:
        render: the route family's error response (native, or OpenAI's shape).
        max_tokens_of: for a route that checks admission after validating its body, the body's
            ``max_tokens`` (raises ``APIError`` for a body the route refuses); None for one
            that checks before reading the body.
    """

    render: Callable[[APIError], Response]
    max_tokens_of: Callable[[bytes], int] | None = None


def _generate_max_tokens(raw: bytes) -> int:
    return generate.parse_body(raw).max_tokens


GATED_ROUTES: dict[str, GatedRoute] = {
    "/generate": GatedRoute(error_response, max_tokens_of=_generate_max_tokens),
    V1_PREFIX + "/completions": GatedRoute(openai_error_response),
    V1_PREFIX + "/chat/completions": GatedRoute(openai_error_response),
    MESSAGES_PATH: GatedRoute(anthropic_error_response),
}


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
        refusal = await _route_refusal(route, resources, Request(scope, recording))
        if refusal is None:
            await self.app(scope, recording.replay(), send)
            return
        response = route.render(refusal_error(resources, refusal))
        await response(scope, receive, send)


def _gated_route(scope: Scope) -> GatedRoute | None:
    if scope["type"] != "http" or scope["method"] != "POST":
        return None
    return GATED_ROUTES.get(scope["path"])


async def _route_refusal(
    route: GatedRoute, resources: ServerResources, request: Request
) -> Overloaded | EngineUnavailable | None:
    """The refusal the route would answer, or None when the route would answer something else
    first (401, 413, 422, a client gone) or take the request. Reads the body when the route
    reads it before deciding."""
    try:
        resources.guard.owner_of(request)
        max_tokens = None
        if route.max_tokens_of is not None:
            max_tokens = route.max_tokens_of(
                await read_body(request, resources.config.max_body_bytes)
            )
    except (APIError, ClientDisconnect):
        return None
    return admission_refusal(resources, max_tokens=max_tokens)


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
