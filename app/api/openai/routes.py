"""The OpenAI-compatible routes: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` and ``POST /v1/responses`` (JSON, or SSE with ``stream: true``),
on the native request path.

Each generating route is a ``WireFormat`` of ``app.api.request_path`` on the one request path:
the key, the early refusal (429/503, before the body is read), the body validated once
(``schemas``), ``n`` against the slots and ``RequestBuilder.build`` (a chat is rendered with the
model's own chat template; ``choices``), then ``app.api.answers.answer`` in its format
(``answers``, ``responses_answer``). Errors are rendered in OpenAI's shape (``errors``).
"""

from __future__ import annotations

import logging
import time

from fastapi import APIRouter, Request

from app.api.errors import APIError
from app.api.openai.errors import V1_PREFIX, OpenAIRoute
from app.api.openai.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ModelCard,
    ModelList,
    OpenAIErrorResponse,
)
from app.api.request_path import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    RESPONSES,
    add_generating_route,
)
from app.api.resources import ServerResources, resources_of

logger = logging.getLogger(__name__)

_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    status: {"model": OpenAIErrorResponse} for status in (400, 401, 404, 409, 413, 429, 500, 503)
}

router = APIRouter(prefix=V1_PREFIX, route_class=OpenAIRoute, tags=["openai"])


@router.get("/models", response_model=ModelList, responses=_ERROR_RESPONSES)
async def list_models(request: Request) -> ModelList:
    """The one served model."""
    resources = resources_of(request)
    resources.guard.owner_of(request)
    return ModelList(data=[_model_card(resources)])


@router.get("/models/{model_id:path}", response_model=ModelCard, responses=_ERROR_RESPONSES)
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    """The served model, or 404 for any other name."""
    resources = resources_of(request)
    resources.guard.owner_of(request)
    card = _model_card(resources)
    if model_id != card.id:
        raise APIError(
            404, "not_found", f"no model {model_id!r}; serving {card.id!r}", param="model"
        )
    return card


_GENERATING_RESPONSES = {**_ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}}
add_generating_route(
    router,
    COMPLETIONS,
    name="create_completion",
    description="Continues one prompt. ``max_tokens`` defaults to 16, as at OpenAI.",
    responses=_GENERATING_RESPONSES,
    response_model=CompletionResponse,
)
add_generating_route(
    router,
    CHAT_COMPLETIONS,
    name="create_chat_completion",
    description="Answers a conversation, rendered with the model's chat template.",
    responses=_GENERATING_RESPONSES,
    response_model=ChatCompletionResponse,
)
add_generating_route(
    router,
    RESPONSES,
    name="create_response",
    description="OpenAI's Responses API, stateless (``app.api.openai.responses_answer``).",
    responses=_GENERATING_RESPONSES,
)


def _model_card(resources: ServerResources) -> ModelCard:
    engine = resources.engine
    return ModelCard(
        id=engine.capabilities.name,
        created=int(time.time()),
        max_model_len=engine.capabilities.context_length,
        chat_template="model" if engine.chat_template.from_model else "chatml-fallback",
    )
