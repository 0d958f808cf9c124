"""The OpenAI-compatible API: ``GET /v1/models``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (JSON, or SSE with ``stream: true``), on the native request path.

A body is validated once (``openai_schemas``), a chat is rendered with the model's own chat
template (``app.engine.chat_template``), and then it is the path of ``POST /generate``: a frozen
``GenerationRequest``, ``submit``, the handle's events, and a client that leaves cancels its
request (``engine.abort``), streamed or not.

Ids. An answer's ``id`` is the native request id (the client's ``X-Request-Id`` or the
server-made one; the ``X-Request-Id`` header carries it too), so ``DELETE /generate/{id}``
cancels an OpenAI request as well. There is no ``cmpl-`` / ``chatcmpl-`` prefix to strip.

Finish reasons. ``stop`` (EOS or a stop string), ``length`` (the token budget), and
``cancelled`` (DELETE, shutdown): the native name, since OpenAI has none for it and ``stop``
would pass a cut answer off as a complete one. A model failure is a 500, or, once a stream has
begun, a chunk ``data: {"error": {...}}`` and then ``data: [DONE]``.

Errors. Under ``/v1`` every error has OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` with the statuses of API.md, except that a
native 422 is a 400, as OpenAI answers invalid parameters. ``code`` is the native error type
(``context_length_exceeded``, ``unauthorized``, ``conflict``, ``overloaded``...) or, for a bad
field, ``invalid_value``, ``missing_required_parameter`` or ``unsupported_value``; ``type`` is
``authentication_error`` (401), ``rate_limit_error`` (429), ``server_error`` (5xx), else
``invalid_request_error``.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api.errors import CLIENT_CLOSED_REQUEST, APIError, validation_error
from app.api.openai_schemas import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequestBody,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageBody,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequestBody,
    CompletionResponse,
    ModelCard,
    ModelList,
    OpenAIErrorResponse,
    OpenAIRequestBody,
    Usage,
)
from app.api.resources import ServerResources, resources_of
from app.api.submission import (
    check_context_length,
    check_max_tokens,
    encode_prompt,
    final_unless_disconnected,
    read_body,
    refuse_if_overloaded,
    submit,
)
from app.engine.chat_template import ChatMessage, ChatTemplate, ChatTemplateError
from app.engine.handle import RequestHandle
from app.engine.request import (
    FinalEvent,
    FinishReason,
    GenerationRequest,
    StopCriteria,
    TokenEvent,
)
from app.models.base import SamplingParams

logger = logging.getLogger(__name__)

V1_PREFIX = "/v1"
SSE_LINE_END = "\n"  # chunks are written "data: {json}\n\n", as OpenAI writes them

_FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "cancelled",
}
_ERROR_TYPE_BY_STATUS = {401: "authentication_error", 429: "rate_limit_error"}
_CODE_BY_NATIVE_TYPE = {"invalid_request": "invalid_value"}
_CODE_BY_PYDANTIC_TYPE = {
    "missing": "missing_required_parameter",
    "unsupported_value": "unsupported_value",
}
_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    status: {"model": OpenAIErrorResponse} for status in (400, 401, 404, 409, 413, 429, 500, 503)
}


class _OpenAIRoute(APIRoute):
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


router = APIRouter(prefix=V1_PREFIX, route_class=_OpenAIRoute, tags=["openai"])


def _body_schema(model: type[OpenAIRequestBody]) -> dict[str, object]:
    """The OpenAPI request body of a route that parses its body itself (nested models inlined:
    pydantic's ``#/$defs/...`` references would not resolve inside the OpenAPI document)."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})

    def inline(node: object) -> object:
        if isinstance(node, dict):
            reference = node.get("$ref", "")
            if reference.startswith("#/$defs/"):
                return inline(definitions[reference.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": inline(schema)}},
        }
    }


# --------------------------------------------------------------------------- routes


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
    openapi_extra=_body_schema(CompletionRequestBody),
)
async def create_completion(request: Request) -> Response:
    """Continues one prompt. ``max_tokens`` defaults to 16, as at OpenAI."""
    arrived_at = time.perf_counter()
    resources = resources_of(request)
    owner = resources.guard.owner_of(request)
    refuse_if_overloaded(resources)
    body = _parse_body(
        CompletionRequestBody, await read_body(request, resources.config.max_body_bytes)
    )
    request_id: str = request.state.request_id
    prompt_ids = await encode_prompt(resources, body.prompt, request_id=request_id, param="prompt")
    max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    generation = _generation_request(
        body,
        resources,
        _TokenBudget(prompt_ids, "prompt", max_tokens, "max_tokens"),
        request_id=request_id,
        owner=owner,
        arrived_at=arrived_at,
    )
    handle = submit(resources, generation)
    reply = _CompletionReply(request_id, int(time.time()), resources.engine.model.capabilities.name)
    return await _answer(request, resources, handle, reply, body)


@router.post(
    "/chat/completions",
    response_model=ChatCompletionResponse,
    responses={**_ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}},
    openapi_extra=_body_schema(ChatCompletionRequestBody),
)
async def create_chat_completion(request: Request) -> Response:
    """Answers a conversation, rendered with the model's chat template (see the module doc)."""
    arrived_at = time.perf_counter()
    resources = resources_of(request)
    owner = resources.guard.owner_of(request)
    refuse_if_overloaded(resources)
    body = _parse_body(
        ChatCompletionRequestBody, await read_body(request, resources.config.max_body_bytes)
    )
    request_id: str = request.state.request_id
    prompt = _render_chat(resources, body.messages)
    prompt_ids = await encode_prompt(
        resources, prompt, request_id=request_id, param="messages", add_special_tokens=False
    )
    generation = _generation_request(
        body,
        resources,
        _chat_token_budget(body, resources, prompt_ids),
        request_id=request_id,
        owner=owner,
        arrived_at=arrived_at,
    )
    handle = submit(resources, generation)
    reply = _ChatReply(request_id, int(time.time()), resources.engine.model.capabilities.name)
    return await _answer(request, resources, handle, reply, body)


# --------------------------------------------------------------------------- validation

_Body = TypeVar("_Body", bound=OpenAIRequestBody)


def _parse_body(model: type[_Body], raw: bytes) -> _Body:
    """Validates the body (JSON whatever the Content-Type); unknown fields are logged."""
    try:
        body = model.model_validate_json(raw or b"null")
    except ValidationError as exc:
        raise _invalid_field(exc) from None
    if body.model_extra:
        logger.debug("ignoring unknown fields %s", sorted(body.model_extra))
    return body


def _invalid_field(exc: ValidationError) -> APIError:
    """pydantic's first complaint as a 400 naming the field (``messages.1.role`` style)."""
    native = validation_error(exc)
    errors = exc.errors()
    kind = str(errors[0].get("type", "")) if errors else ""
    code = _CODE_BY_PYDANTIC_TYPE.get(kind, "invalid_value")
    return APIError(400, code, native.message, param=native.param)


def _render_chat(resources: ServerResources, messages: list[ChatMessageBody]) -> str:
    template = ChatTemplate.of(resources.engine.model.tokenizer)
    if not template.from_model:
        logger.debug("the model has no chat template; rendering ChatML")
    turns = [
        ChatMessage(role="system" if m.role == "developer" else m.role, content=m.content)
        for m in messages
    ]
    try:
        return template.render(turns)
    except ChatTemplateError as exc:
        raise APIError(400, "invalid_value", f"messages: {exc}", param="messages") from None


@dataclass(frozen=True, slots=True)
class _TokenBudget:
    """A prompt's token ids and the most tokens to generate after it, with the names of the
    fields they came from (for error messages)."""

    prompt_ids: tuple[int, ...]
    prompt_param: str
    max_tokens: int
    max_tokens_param: str


def _chat_token_budget(
    body: ChatCompletionRequestBody, resources: ServerResources, prompt_ids: tuple[int, ...]
) -> _TokenBudget:
    """``max_completion_tokens``, else ``max_tokens``, else the context left after the prompt."""
    if body.max_completion_tokens is not None:
        return _TokenBudget(
            prompt_ids, "messages", body.max_completion_tokens, "max_completion_tokens"
        )
    if body.max_tokens is not None:
        return _TokenBudget(prompt_ids, "messages", body.max_tokens, "max_tokens")
    room = resources.engine.model.capabilities.context_length - len(prompt_ids)
    # no room at all: ask for one token, so that the context check below refuses the request
    max_tokens = min(resources.max_tokens_cap, max(room, 1))
    return _TokenBudget(prompt_ids, "messages", max_tokens, "max_completion_tokens")


def _generation_request(
    body: OpenAIRequestBody,
    resources: ServerResources,
    budget: _TokenBudget,
    *,
    request_id: str,
    owner: str | None,
    arrived_at: float,
) -> GenerationRequest:
    check_max_tokens(resources, budget.max_tokens, param=budget.max_tokens_param)
    check_context_length(
        resources,
        prompt_tokens=len(budget.prompt_ids),
        max_tokens=budget.max_tokens,
        prompt_param=budget.prompt_param,
        max_tokens_param=budget.max_tokens_param,
    )
    return GenerationRequest(
        request_id=request_id,
        prompt_token_ids=budget.prompt_ids,
        max_tokens=budget.max_tokens,
        sampling=SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=body.seed if body.seed is not None else secrets.randbits(63),
            batch_invariant=body.seed is not None,
        ),
        stop=StopCriteria(stop_strings=tuple(body.stop), ignore_eos=bool(body.ignore_eos)),
        owner=owner,
        arrived_at=arrived_at,
    )


def _model_card(resources: ServerResources) -> ModelCard:
    model = resources.engine.model
    return ModelCard(
        id=model.capabilities.name,
        created=int(time.time()),
        max_model_len=model.capabilities.context_length,
        chat_template="model" if ChatTemplate.of(model.tokenizer).from_model else "chatml-fallback",
    )


# --------------------------------------------------------------------------- answers


class _Reply(Protocol):
    """How one endpoint writes its answer, whole or as stream chunks (JSON-ready dicts)."""

    def response(self, final: FinalEvent) -> dict[str, object]: ...

    def opening_chunks(self) -> tuple[dict[str, object], ...]: ...

    def text_chunk(self, text: str) -> dict[str, object]: ...

    def final_chunk(self, final: FinalEvent) -> dict[str, object]: ...

    def usage_chunk(self, final: FinalEvent) -> dict[str, object]: ...


def _usage(final: FinalEvent) -> Usage:
    return Usage(
        prompt_tokens=final.prompt_tokens,
        completion_tokens=final.completion_tokens,
        total_tokens=final.prompt_tokens + final.completion_tokens,
    )


@dataclass(frozen=True, slots=True)
class _CompletionReply:
    id: str
    created: int
    model: str

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> dict:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        ).model_dump()

    def response(self, final: FinalEvent) -> dict[str, object]:
        choice = CompletionChoice(
            text=final.text, finish_reason=_FINISH_REASONS[final.finish_reason]
        )
        return self._chunk([choice], _usage(final))

    def opening_chunks(self) -> tuple[dict[str, object], ...]:
        return ()

    def text_chunk(self, text: str) -> dict[str, object]:
        return self._chunk([CompletionChoice(text=text, finish_reason=None)])

    def final_chunk(self, final: FinalEvent) -> dict[str, object]:
        return self._chunk(
            [CompletionChoice(text="", finish_reason=_FINISH_REASONS[final.finish_reason])]
        )

    def usage_chunk(self, final: FinalEvent) -> dict[str, object]:
        return self._chunk([], _usage(final))


@dataclass(frozen=True, slots=True)
class _ChatReply:
    id: str
    created: int
    model: str

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> dict:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        ).model_dump()

    def response(self, final: FinalEvent) -> dict[str, object]:
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[
                ChatChoice(
                    message=ChatMessageOut(content=final.text),
                    finish_reason=_FINISH_REASONS[final.finish_reason],
                )
            ],
            usage=_usage(final),
        ).model_dump()

    def opening_chunks(self) -> tuple[dict[str, object], ...]:
        delta = ChatDelta(role="assistant", content="")
        return (self._chunk([ChatChunkChoice(delta=delta, finish_reason=None)]),)

    def text_chunk(self, text: str) -> dict[str, object]:
        return self._chunk([ChatChunkChoice(delta=ChatDelta(content=text), finish_reason=None)])

    def final_chunk(self, final: FinalEvent) -> dict[str, object]:
        reason = _FINISH_REASONS[final.finish_reason]
        return self._chunk([ChatChunkChoice(delta=ChatDelta(), finish_reason=reason)])

    def usage_chunk(self, final: FinalEvent) -> dict[str, object]:
        return self._chunk([], _usage(final))


async def _answer(
    request: Request,
    resources: ServerResources,
    handle: RequestHandle,
    reply: _Reply,
    body: OpenAIRequestBody,
) -> Response:
    """The whole answer as JSON, or the SSE stream when the body asked for one."""
    if body.stream:
        return EventSourceResponse(
            _sse_chunks(handle, resources, reply, include_usage=body.include_usage),
            ping=resources.config.sse_ping_interval,
            sep=SSE_LINE_END,
            send_timeout=resources.config.sse_send_timeout,
            ping_message_factory=lambda: ServerSentEvent(comment="ping", sep=SSE_LINE_END),
            headers={"Cache-Control": "no-cache"},
        )
    final = await final_unless_disconnected(request, handle, resources)
    if final is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody is left to read it
    if final.finish_reason is FinishReason.ERROR:
        raise APIError(500, "internal", final.error or "the model failed on this request")
    return JSONResponse(reply.response(final))


async def _sse_chunks(
    handle: RequestHandle, resources: ServerResources, reply: _Reply, *, include_usage: bool
) -> AsyncIterator[ServerSentEvent]:
    """``data: {chunk}`` events, the final chunk (finish_reason, empty delta), the usage chunk
    when asked, then ``data: [DONE]``; a model failure is an error chunk before ``[DONE]``."""
    try:
        for chunk in reply.opening_chunks():
            yield _data(chunk)
        async for event in handle.events():
            if isinstance(event, TokenEvent):
                if event.text:  # text held back (a partial character or stop string) waits
                    yield _data(reply.text_chunk(event.text))
            elif event.finish_reason is FinishReason.ERROR:
                failure = APIError(500, "internal", event.error or "the model failed")
                yield _data(openai_error_body(failure))
            else:
                yield _data(reply.final_chunk(event))
                if include_usage:
                    yield _data(reply.usage_chunk(event))
        yield ServerSentEvent(data="[DONE]", sep=SSE_LINE_END)
    finally:
        if not handle.is_finished:
            resources.engine.abort(handle)


def _data(payload: dict[str, object]) -> ServerSentEvent:
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return ServerSentEvent(data=text, sep=SSE_LINE_END)


# --------------------------------------------------------------------------- errors


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


def openai_error_response(error: APIError) -> JSONResponse:
    status = 400 if error.status == 422 else error.status
    return JSONResponse(openai_error_body(error), status_code=status, headers=error.headers)


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
        return openai_error_response(_as_api_error(request, exc))

    return handle


def _as_api_error(request: Request, exc: Exception) -> APIError:
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
