"""The OpenAI-compatible routes: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` and ``POST /v1/responses`` (JSON, or SSE with ``stream: true``),
on the native request path.

Each generating route: the key, the early refusal (429/503, before the body is read), the body
validated once (``schemas``), ``RequestBuilder.build`` (a chat is rendered with the model's own
chat template), then ``app.api.answers.answer`` in its format (``answers``). Errors are rendered
in OpenAI's shape (``errors``).
"""

from __future__ import annotations

import logging
import time
from typing import TypeVar

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from app.api.admission import read_body, refuse_if_overloaded
from app.api.answers import answer
from app.api.errors import APIError
from app.api.openai.answers import ChatAnswer, CompletionAnswer
from app.api.openai.choices import choice_requests, group_answer
from app.api.openai.errors import V1_PREFIX, OpenAIRoute, invalid_field
from app.api.openai.logprobs import LogprobsWriter
from app.api.openai.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ModelCard,
    ModelList,
    OpenAIErrorResponse,
)
from app.api.openai.responses_api import ResponsesAnswer
from app.api.openai.responses_request import ResponsesRequestBody
from app.api.openai.schemas import (
    ChatCompletionRequestBody,
    CompletionRequestBody,
    OpenAIRequestBody,
)
from app.api.request_builder import RequestOrigin
from app.api.resources import ServerResources, resources_of
from app.api.schemas import request_body_openapi
from app.engine.request import GenerationRequest

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


@router.post(
    "/completions",
    response_model=CompletionResponse,
    responses={**_ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}},
    openapi_extra=request_body_openapi(CompletionRequestBody),
)
async def create_completion(request: Request) -> Response:
    """Continues one prompt. ``max_tokens`` defaults to 16, as at OpenAI."""
    return await _generate(request, CompletionRequestBody, CompletionAnswer)


@router.post(
    "/chat/completions",
    response_model=ChatCompletionResponse,
    responses={**_ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}},
    openapi_extra=request_body_openapi(ChatCompletionRequestBody),
)
async def create_chat_completion(request: Request) -> Response:
    """Answers a conversation, rendered with the model's chat template."""
    return await _generate(request, ChatCompletionRequestBody, ChatAnswer)


@router.post(
    "/responses",
    responses={**_ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}},
    openapi_extra=request_body_openapi(ResponsesRequestBody),
)
async def create_response(request: Request) -> Response:
    """OpenAI's Responses API, stateless (``app.api.openai.responses_api``)."""
    arrived_at = time.perf_counter()
    resources = resources_of(request)
    origin = RequestOrigin(request.state.request_id, resources.guard.owner_of(request), arrived_at)
    refuse_if_overloaded(resources)
    body = parse_body(
        ResponsesRequestBody, await read_body(request, resources.config.max_body_bytes)
    )
    generation = await resources.builder.build(body.generation_params(), origin)
    writer = ResponsesAnswer(
        request_id=origin.request_id,
        created=int(time.time()),
        model=resources.engine.capabilities.name,
        body=body,
        reasoning=resources.reasoning.for_prompt(
            generation.prompt_token_ids,
            resources.engine.decode,
            constrained=generation.constraint is not None,
        ),
    )
    return await answer(request, resources, [generation], [writer], stream=body.streamed)


_Body = TypeVar(
    "_Body", bound=CompletionRequestBody | ChatCompletionRequestBody | ResponsesRequestBody
)


async def _generate(
    request: Request,
    body_model: type[_Body],
    answer_format: type[CompletionAnswer] | type[ChatAnswer],
) -> Response:
    """What both generating routes do, in this order (see the module doc)."""
    arrived_at = time.perf_counter()
    resources = resources_of(request)
    origin = RequestOrigin(request.state.request_id, resources.guard.owner_of(request), arrived_at)
    refuse_if_overloaded(resources)
    body = parse_body(body_model, await read_body(request, resources.config.max_body_bytes))
    check_choices(body, resources)
    generation = await resources.builder.build(body.generation_params(), origin)
    if body.choices == 1:
        writer = openai_answer_format(answer_format, body, generation, resources)
        return await answer(request, resources, [generation], [writer], stream=body.streamed)
    generations = choice_requests(generation, body.choices)
    formats = [
        openai_answer_format(answer_format, body, choice, resources, index=index, group=True)
        for index, choice in enumerate(generations)
    ]
    merged, usage = group_answer(formats, body.include_usage)
    return await answer(
        request, resources, generations, formats, stream=body.streamed, body=merged, trailer=usage
    )


def check_choices(body: OpenAIRequestBody, resources: ServerResources) -> None:
    """``n`` must fit the batch slots (a group is admitted all at once).

    Raises:
        APIError: 400 naming ``n``.
    """
    slots = resources.engine.capabilities.max_num_seqs
    if body.choices > slots:
        raise APIError(
            422, "invalid_request", f"n ({body.choices}) exceeds the {slots} batch slots", param="n"
        )


def openai_answer_format(
    answer_format: type[CompletionAnswer] | type[ChatAnswer],
    body: OpenAIRequestBody,
    generation: GenerationRequest,
    resources: ServerResources,
    *,
    index: int = 0,
    group: bool = False,
) -> CompletionAnswer | ChatAnswer:
    """How the answer to ``body`` (choice ``index``) is written (also by the batch runner, so
    that its answers are these routes' own): the request id as the object's id, created now,
    the model's name; logprobs and the echoed prompt when asked. In a group (``n`` > 1) the
    usage chunk is the group's, not the choice's. A chat's reasoning is split out when the
    server's parser is on (``resources.reasoning``)."""
    engine = resources.engine
    writer = None
    echo = ""
    if isinstance(body, CompletionRequestBody) and body.echo:
        echo = (
            body.prompt
            if isinstance(body.prompt, str)
            else engine.decode(generation.prompt_token_ids)
        )
    scores_prompt = generation.sampling.prompt_logprobs is not None
    if generation.sampling.logprobs is not None:
        # chat's content lists the tokens of the message; completions list every token, as
        # vLLM's do (a harness slices them by position: the ending token keeps its place)
        hidden: frozenset[int] = frozenset()
        if answer_format is ChatAnswer:
            hidden = frozenset(generation.stop.stop_token_ids)
            if not generation.stop.ignore_eos:
                hidden |= engine.capabilities.eos_token_ids
        offset = 0 if scores_prompt else len(echo)  # else the prompt's tokens count it
        writer = LogprobsWriter(engine.token_bytes, hidden, text_offset=offset)
    fields: dict[str, object] = {}
    if answer_format is CompletionAnswer:
        fields = {"echo": echo, "echo_first_token": generation.prompt_token_ids[0]}
    elif isinstance(body, ChatCompletionRequestBody):
        reasoning = resources.reasoning.for_prompt(
            generation.prompt_token_ids,
            engine.decode,
            constrained=generation.constraint is not None,
        )
        fields = {"tools": body.tool_plan, "reasoning": reasoning}
    return answer_format(
        id=generation.request_id if not group else generation.group_id or generation.request_id,
        created=int(time.time()),
        model=engine.capabilities.name,
        include_usage=body.include_usage and not group,
        index=index,
        logprobs=writer,
        **fields,  # type: ignore[arg-type]
    )


def parse_body(model: type[_Body], raw: bytes) -> _Body:
    """Validates the body (JSON whatever the Content-Type); unknown fields are logged.

    Raises:
        APIError: 400 naming the first bad field (``invalid_field``).
    """
    try:
        body = model.model_validate_json(raw or b"null")
    except ValidationError as exc:
        raise invalid_field(exc) from None
    if body.model_extra:
        logger.debug("ignoring unknown fields %s", sorted(body.model_extra))
    return body


def _model_card(resources: ServerResources) -> ModelCard:
    engine = resources.engine
    return ModelCard(
        id=engine.capabilities.name,
        created=int(time.time()),
        max_model_len=engine.capabilities.context_length,
        chat_template="model" if engine.chat_template.from_model else "chatml-fallback",
    )
