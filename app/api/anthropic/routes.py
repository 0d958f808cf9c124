"""Anthropic's Messages API: ``POST /v1/messages`` (JSON, or Anthropic's SSE events with
``stream: true``) and ``POST /v1/messages/count_tokens``, on the native request path.

``/v1/messages``: the key (``Authorization: Bearer`` or ``x-api-key``), the early refusal
(429 / 529, before the body is read), the body validated once (``schemas``),
``RequestBuilder.build`` (the conversation rendered with the chat template), then
``app.api.answers.answer`` in ``MessagesAnswer``'s format. ``count_tokens`` builds the same
prompt through the same builder and answers its size, ``{"input_tokens": N}``: the
``usage.input_tokens`` a message with that body reports. Errors are in Anthropic's shape
(``errors``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TypeVar

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ValidationError

from app.api.admission import read_body, refuse_if_overloaded
from app.api.answers import answer
from app.api.anthropic.answers import MessagesAnswer
from app.api.anthropic.schemas import CountTokensRequestBody, MessagesRequestBody
from app.api.errors import validation_error
from app.api.openai.errors import OpenAIRoute
from app.api.request_builder import RequestOrigin
from app.api.resources import resources_of
from app.api.schemas import request_body_openapi

logger = logging.getLogger(__name__)

# OpenAIRoute turns an unexpected exception into a logged 500 APIError, which the handlers of
# app.api.anthropic.errors then write in Anthropic's shape.
router = APIRouter(prefix="/v1", route_class=OpenAIRoute, tags=["anthropic"])


class CountTokensResponse(BaseModel):
    input_tokens: int


@router.post(
    "/messages",
    responses={200: {"content": {"text/event-stream": {}}}},
    openapi_extra=request_body_openapi(MessagesRequestBody),
)
async def create_message(request: Request) -> Response:
    """Answers a conversation as Anthropic's Messages API does (see the module doc)."""
    arrived_at = time.perf_counter()
    resources = resources_of(request)
    origin = RequestOrigin(request.state.request_id, resources.guard.owner_of(request), arrived_at)
    refuse_if_overloaded(resources)
    raw = await read_body(request, resources.config.max_body_bytes)
    body = parse_body(MessagesRequestBody, raw)
    generation = await resources.builder.build(body.generation_params(), origin)
    engine = resources.engine
    writer = MessagesAnswer(
        request_id=origin.request_id,
        model=engine.capabilities.name,
        prompt_tokens=len(generation.prompt_token_ids),
        tools=body.tool_plan,
        reasoning=resources.reasoning.for_prompt(
            generation.prompt_token_ids,
            engine.decode,
            constrained=generation.constraint is not None,
        ),
    )
    return await answer(request, resources, [generation], [writer], stream=bool(body.stream))


@router.post(
    "/messages/count_tokens",
    response_model=CountTokensResponse,
    openapi_extra=request_body_openapi(CountTokensRequestBody),
)
async def count_tokens(request: Request) -> CountTokensResponse:
    """The prompt tokens of a conversation (``input_tokens``), nothing generated."""
    arrived_at = time.perf_counter()
    resources = resources_of(request)
    origin = RequestOrigin(request.state.request_id, resources.guard.owner_of(request), arrived_at)
    body = parse_body(
        CountTokensRequestBody, await read_body(request, resources.config.max_body_bytes)
    )
    params = dataclasses.replace(body.generation_params(), constraint=None)
    generation = await resources.builder.build(params, origin)
    return CountTokensResponse(input_tokens=len(generation.prompt_token_ids))


_Body = TypeVar("_Body", bound=MessagesRequestBody | CountTokensRequestBody)


def parse_body(model: type[_Body], raw: bytes) -> _Body:
    """Validates the body (JSON whatever the Content-Type); unknown fields are logged.

    Raises:
        APIError: 422 naming the first bad field (written as Anthropic's 400).
    """
    try:
        body = model.model_validate_json(raw or b"null")
    except ValidationError as exc:
        raise validation_error(exc) from None
    if body.model_extra:
        logger.debug("ignoring unknown fields %s", sorted(body.model_extra))
    return body
