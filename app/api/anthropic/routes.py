"""Anthropic's Messages API: ``POST /v1/messages`` (JSON, or Anthropic's SSE events with
``stream: true``) and ``POST /v1/messages/count_tokens``.

``/v1/messages`` is ``app.api.request_path.MESSAGES`` on the one request path: the key
(``Authorization: Bearer`` or ``x-api-key``), the early refusal (429 / 529, before the body is
read), the body validated once (``schemas``), ``RequestBuilder.build`` (the conversation
rendered with the chat template), then ``app.api.answers.answer`` in ``MessagesAnswer``'s
format (``answers``). ``count_tokens`` builds the same prompt through the same builder and
answers its size, ``{"input_tokens": N}``: the ``usage.input_tokens`` a message with that body
reports. Errors are in Anthropic's shape (``errors``).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from fastapi import APIRouter, Request
from pydantic import BaseModel

from app.api.admission import read_body
from app.api.anthropic.schemas import CountTokensRequestBody
from app.api.errors import validation_error
from app.api.openai.errors import OpenAIRoute
from app.api.request_builder import RequestOrigin
from app.api.request_path import MESSAGES, add_generating_route, parse_body
from app.api.resources import resources_of
from app.api.schemas import request_body_openapi

logger = logging.getLogger(__name__)

# OpenAIRoute turns an unexpected exception into a logged 500 APIError, which the handlers of
# app.api.anthropic.errors then write in Anthropic's shape.
router = APIRouter(prefix="/v1", route_class=OpenAIRoute, tags=["anthropic"])


class CountTokensResponse(BaseModel):
    input_tokens: int


add_generating_route(
    router,
    MESSAGES,
    name="create_message",
    description="Answers a conversation as Anthropic's Messages API does (see the module doc).",
    responses={200: {"content": {"text/event-stream": {}}}},
)


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
    raw = await read_body(request, resources.config.max_body_bytes)
    body = parse_body(CountTokensRequestBody, raw, validation_error)
    params = dataclasses.replace(body.generation_params(), constraint=None)
    generation = await resources.builder.build(params, origin)
    return CountTokensResponse(input_tokens=len(generation.prompt_token_ids))
