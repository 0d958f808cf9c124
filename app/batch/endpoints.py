"""What ``/v1/completions`` and ``/v1/chat/completions`` would answer a body, without HTTP.

The steps of ``app.api.openai.routes`` after the body is read, in their order and with their
own functions: the body parsed by the route's schema (``parse_body``: 400 naming the field),
``RequestBuilder.build`` (the model's checks, the tokenizer, the seed), ``submit`` to the
engine (the server's ``AsyncEngine``), the final event written by the route's answer format
(``openai_answer_format``), a failure as the route's error body (``openai_error_body``, status
``openai_status``). A body over ``--max-body-bytes`` is the route's 413. What differs is only
what HTTP brings: no API key, no early 429 (the runner keeps at most its window in flight, which
the engine's queue is sized to take), no client to leave.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from app.api.answers import finals_of
from app.api.errors import APIError
from app.api.openai.answers import ChatAnswer, CompletionAnswer
from app.api.openai.choices import choice_requests, group_usage, merged_body
from app.api.openai.errors import openai_error_body, openai_status
from app.api.openai.routes import check_choices, openai_answer_format, parse_body
from app.api.openai.schemas import ChatCompletionRequestBody, CompletionRequestBody
from app.api.request_builder import RequestOrigin
from app.api.request_id import make_request_id
from app.api.resources import ServerResources
from app.batch.requests import CHAT_COMPLETIONS_URL, COMPLETIONS_URL, BatchRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One route's schema and answer format."""

    body_schema: type[CompletionRequestBody] | type[ChatCompletionRequestBody]
    answer_format: type[CompletionAnswer] | type[ChatAnswer]


ENDPOINTS = {
    COMPLETIONS_URL: Endpoint(CompletionRequestBody, CompletionAnswer),
    CHAT_COMPLETIONS_URL: Endpoint(ChatCompletionRequestBody, ChatAnswer),
}


@dataclass(frozen=True, slots=True)
class EndpointAnswer:
    """What the endpoint answered one request.

    Attributes:
        request_id: the request's id (its ``X-Request-Id`` over HTTP; the body's ``id``).
        status_code: 200, or the endpoint's error status (400, 413, 500...).
        body: the JSON body, exactly as the endpoint writes it (an error body on failure).
        prompt_tokens / completion_tokens: usage of a request that ran (0 when refused).
    """

    request_id: str
    status_code: int
    body: dict[str, object]
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.status_code == 200


class BatchEndpoints:
    """Answers batch requests as the ``/v1`` routes of a server with these resources would.

    Args:
        resources: the started engine, its config and its request builder.
    """

    def __init__(self, resources: ServerResources) -> None:
        self._resources = resources

    async def answer(self, request: BatchRequest) -> EndpointAnswer:
        """The endpoint's answer to ``request.body``; never raises but for cancellation (an
        unexpected error is the route's logged 500)."""
        request_id = make_request_id()
        origin = RequestOrigin(request_id, owner=None, arrived_at=time.perf_counter())
        try:
            return await self._run(request, origin)
        except APIError as error:
            return EndpointAnswer(request_id, openai_status(error), openai_error_body(error))
        except Exception:
            logger.exception("line %d (%s): unexpected error", request.line, request.custom_id)
            error = APIError(500, "internal", "internal server error")
            return EndpointAnswer(request_id, openai_status(error), openai_error_body(error))

    async def _run(self, request: BatchRequest, origin: RequestOrigin) -> EndpointAnswer:
        resources = self._resources
        if len(request.body) > resources.config.max_body_bytes:
            limit = resources.config.max_body_bytes
            raise APIError(413, "payload_too_large", f"request body is larger than {limit} bytes")
        endpoint = ENDPOINTS[request.url]
        body = parse_body(endpoint.body_schema, request.body)
        check_choices(body, resources)
        generation = await resources.builder.build(body.generation_params(), origin)
        if body.choices > 1:
            generations = choice_requests(generation, body.choices)
            formats = [
                openai_answer_format(
                    endpoint.answer_format, body, choice, resources, index=i, group=True
                )
                for i, choice in enumerate(generations)
            ]
            finals = await finals_of(resources, generations)
            answer_body = merged_body(formats, finals)
            usage = group_usage(finals)
            return EndpointAnswer(
                origin.request_id,
                200,
                answer_body,
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
            )
        writer = openai_answer_format(endpoint.answer_format, body, generation, resources)
        (final,) = await finals_of(resources, [generation])
        return EndpointAnswer(
            origin.request_id,
            200,
            writer.response(final),
            prompt_tokens=final.prompt_tokens,
            completion_tokens=final.completion_tokens,
        )
