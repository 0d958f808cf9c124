"""The one request path of every generating route, and the table of those routes.

A generating route is a ``WireFormat``: its path, its body's schema, the order of its checks,
its error shape, and how the answer to a body is planned (built and given its answer format,
``app.api.answers.AnswerPlan``). The steps in their order live here once, for every route:

    key (401) -> [REFUSAL_FIRST: the refusal, 429 / 503] -> body (413) -> schema (422, or
    400 under /v1) -> [BODY_FIRST: the refusal, never for max_tokens 0] -> plan (the
    builder's checks; n against the slots) -> app.api.answers.answer

``answer_request`` runs them for a route (``add_generating_route`` registers it on a router,
at the table's path); ``early_refusal`` is the refusal they would reach first, which the
admission gate (``app.api.admission_gate``) answers in front of FastAPI; the batch runner
parses and plans a line's body with the route's ``WireFormat``. No route owns this module: the
routes, the gate and the batch runner import it, and it imports no route.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from app.api.admission import admission_refusal, read_body, refuse_if_overloaded
from app.api.answers import AnswerPlan, answer
from app.api.anthropic.answers import messages_plan
from app.api.anthropic.errors import MESSAGES_PATH, anthropic_error_response
from app.api.anthropic.schemas import MessagesRequestBody
from app.api.errors import APIError, error_response, validation_error
from app.api.native_answer import native_plan
from app.api.openai.choices import chat_plan, completion_plan
from app.api.openai.errors import V1_PREFIX, invalid_field, openai_error_response
from app.api.openai.responses_answer import responses_plan
from app.api.openai.responses_request import ResponsesRequestBody
from app.api.openai.schemas import ChatCompletionRequestBody, CompletionRequestBody
from app.api.openai.wire_fields import extra_field_error
from app.api.request_builder import RequestOrigin
from app.api.resources import ServerResources, resources_of
from app.api.schemas import GenerateRequestBody, request_body_openapi
from app.engine.engine import EngineUnavailable, Overloaded

_Body = TypeVar("_Body", bound=BaseModel)


class CheckOrder(Enum):
    """Where a route checks admission (the engine full or not serving) among its checks."""

    REFUSAL_FIRST = "refusal_first"  # before the body is read (the /v1 routes)
    BODY_FIRST = "body_first"  # after the body is validated: max_tokens 0 is never refused


@dataclass(frozen=True, slots=True)
class WireFormat:
    """One generating route: what differs between wire formats on the one request path.

    Attributes:
        path: the route's path (``POST``).
        body_schema: the pydantic model of its body.
        check_order: where its admission check stands.
        invalid_body: the ``APIError`` of a body the schema refuses (native 422, OpenAI's 400).
        error_response: its family's error shape (native, OpenAI's, Anthropic's).
        plan: the request built from a valid body and how its answer is written; raises the
            builder's ``APIError``.
    """

    path: str
    body_schema: type[BaseModel]
    check_order: CheckOrder
    invalid_body: Callable[[ValidationError], APIError]
    error_response: Callable[[APIError], Response]
    plan: Callable[[Any, RequestOrigin, ServerResources], Awaitable[AnswerPlan]]

    def parse(self, raw: bytes) -> Any:
        """The validated body (``parse_body`` with this route's schema and error)."""
        return parse_body(self.body_schema, raw, self.invalid_body)


GENERATE = WireFormat(
    "/generate",
    GenerateRequestBody,
    CheckOrder.BODY_FIRST,
    validation_error,
    error_response,
    native_plan,
)
COMPLETIONS = WireFormat(
    V1_PREFIX + "/completions",
    CompletionRequestBody,
    CheckOrder.REFUSAL_FIRST,
    invalid_field,
    openai_error_response,
    completion_plan,
)
CHAT_COMPLETIONS = WireFormat(
    V1_PREFIX + "/chat/completions",
    ChatCompletionRequestBody,
    CheckOrder.REFUSAL_FIRST,
    invalid_field,
    openai_error_response,
    chat_plan,
)
RESPONSES = WireFormat(
    V1_PREFIX + "/responses",
    ResponsesRequestBody,
    CheckOrder.REFUSAL_FIRST,
    invalid_field,
    openai_error_response,
    responses_plan,
)
MESSAGES = WireFormat(
    MESSAGES_PATH,
    MessagesRequestBody,
    CheckOrder.REFUSAL_FIRST,
    validation_error,  # written as Anthropic's 400
    anthropic_error_response,
    messages_plan,
)

# Every generating route by its path: the routes answer through these, the gate guards them.
WIRE_FORMATS: Mapping[str, WireFormat] = MappingProxyType(
    {wire.path: wire for wire in (GENERATE, COMPLETIONS, CHAT_COMPLETIONS, RESPONSES, MESSAGES)}
)


def add_generating_route(
    router: APIRouter,
    wire: WireFormat,
    *,
    name: str,
    description: str,
    responses: dict[int | str, dict[str, Any]],
    response_model: type[BaseModel] | None = None,
) -> None:
    """Registers ``wire``'s ``POST`` route on ``router`` (at ``wire.path``, less the router's
    prefix): ``answer_request`` with this wire format, its body's schema in the OpenAPI
    document.

    Args:
        name: the endpoint's name (its OpenAPI summary and operation id derive from it).
        description: the operation's description.
        responses: its documented answers by status.
        response_model: the JSON answer's model (documentation only), or None.
    """

    async def endpoint(request: Request) -> Response:
        return await answer_request(request, wire)

    router.add_api_route(
        wire.path.removeprefix(router.prefix),
        endpoint,
        methods=["POST"],
        name=name,
        description=description,
        responses=responses,
        response_model=response_model,
        openapi_extra=request_body_openapi(wire.body_schema),
    )


async def answer_request(request: Request, wire: WireFormat) -> Response:
    """A generating route's answer to ``request``: its checks in its order, then its plan
    answered (``app.api.answers.answer``).

    Raises:
        APIError: the first check that fails (401, 429 / 503, 413, 422 / 400, 409...).
    """
    arrived_at = time.perf_counter()
    resources = resources_of(request)
    origin = RequestOrigin(request.state.request_id, resources.guard.owner_of(request), arrived_at)
    if wire.check_order is CheckOrder.REFUSAL_FIRST:
        refuse_if_overloaded(resources)
    body = wire.parse(await read_body(request, resources.config.max_body_bytes))
    if wire.check_order is CheckOrder.BODY_FIRST:
        refuse_if_overloaded(resources, max_tokens=body.max_tokens)
    return await answer(request, resources, await wire.plan(body, origin, resources))


async def early_refusal(
    wire: WireFormat, request: Request, resources: ServerResources
) -> Overloaded | EngineUnavailable | None:
    """The refusal ``answer_request`` would reach for ``request`` now, or None when it would
    answer something else first (401, 413, 422, a client gone) or take the request. Reads the
    body when the route validates it before its admission check. Counts nothing."""
    try:
        resources.guard.owner_of(request)
        max_tokens = None
        if wire.check_order is CheckOrder.BODY_FIRST:
            raw = await read_body(request, resources.config.max_body_bytes)
            max_tokens = wire.parse(raw).max_tokens
    except (APIError, ClientDisconnect):
        return None
    return admission_refusal(resources, max_tokens=max_tokens)


def parse_body(
    schema: type[_Body], raw: bytes, invalid_body: Callable[[ValidationError], APIError]
) -> _Body:
    """Validates a body (JSON whatever the Content-Type). A field outside the schema is refused
    (``extra="forbid"``), or, where the schema keeps such fields, refused by
    ``extra_field_error`` unless its ``tolerated_fields`` allow its value.

    Raises:
        APIError: ``invalid_body`` of the validation error.
    """
    try:
        body = schema.model_validate_json(raw or b"null")
    except ValidationError as exc:
        raise invalid_body(exc) from None
    if body.model_extra:
        tolerated = getattr(schema, "tolerated_fields", {})
        error = extra_field_error(body.model_extra, tolerated)
        if error is not None:
            raise invalid_body(error)
    return body
