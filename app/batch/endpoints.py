"""What ``/v1/completions`` and ``/v1/chat/completions`` would answer a body, without HTTP.

The route's steps after the body is read, with the route's own ``WireFormat``
(``app.api.request_path``): the body parsed by the route's schema (400 naming the field), its
plan (``n`` against the slots, ``RequestBuilder.build``: the model's checks, the tokenizer, the
seed; the route's answer formats), then ``app.api.answers.whole_answer``, the routes' own
answer of a JSON body (submitted to the server's ``AsyncEngine``, one choice or ``n``), and a
failure as the route's error body (``openai_error_body``, status ``openai_status``). A body
over ``--max-body-bytes`` is the route's 413. What differs is only what HTTP brings: no API
key, no early 429 (the runner keeps at most its window in flight, which the engine's queue is
sized to take), no client to leave.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from app.api.admission import body_too_large
from app.api.answers import whole_answer
from app.api.errors import APIError
from app.api.openai.errors import openai_error_body, openai_status
from app.api.request_builder import RequestOrigin
from app.api.request_id import make_request_id
from app.api.request_path import WIRE_FORMATS
from app.api.resources import ServerResources
from app.batch.requests import BatchRequest

logger = logging.getLogger(__name__)


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
            raise body_too_large(resources.config.max_body_bytes)
        wire = WIRE_FORMATS[request.url]
        plan = await wire.plan(wire.parse(request.body), origin, resources)
        whole = await whole_answer(resources, plan)
        assert whole is not None  # no client to leave
        return EndpointAnswer(
            origin.request_id,
            200,
            whole.body,
            prompt_tokens=whole.prompt_tokens,
            completion_tokens=whole.completion_tokens,
        )
