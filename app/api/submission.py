"""What every generating route shares (``/generate``, ``/v1/completions``, ``/v1/chat/...``).

Reading the body under the size limit, checking a prompt against the model's limits, submitting
the frozen request, and waiting for its answer while watching for the client leaving. Every
check raises the native ``APIError``; each family of routes renders it in its own error shape.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request

from app.api.errors import APIError
from app.api.resources import ServerResources
from app.engine.engine import DuplicateRequestId, EngineUnavailable, Overloaded
from app.engine.handle import RequestHandle
from app.engine.request import FinalEvent, GenerationRequest

logger = logging.getLogger(__name__)


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The whole body, refusing more than ``limit_bytes`` before reading it all.

    Raises:
        APIError: 413 ``payload_too_large`` (by Content-Length, or while streaming it in).
    """
    too_large = APIError(
        413, "payload_too_large", f"request body is larger than {limit_bytes} bytes"
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def check_max_tokens(resources: ServerResources, max_tokens: int, *, param: str) -> None:
    """Raises APIError 422 when ``max_tokens`` is over the server's cap; ``param`` names it."""
    if max_tokens > resources.max_tokens_cap:
        raise APIError(
            422,
            "invalid_request",
            f"{param}: must be <= {resources.max_tokens_cap}",
            param=param,
        )


# Prompts longer than this (characters) are tokenized on a worker thread: a 1 MB prompt takes
# ~1 s to tokenize, which on the event loop would stall every open stream. Shorter ones take
# microseconds, less than the hop to a thread.
INLINE_TOKENIZE_MAX_CHARS = 16_384


async def encode_prompt(
    resources: ServerResources,
    text: str,
    *,
    request_id: str,
    param: str,
    add_special_tokens: bool = True,
) -> tuple[int, ...]:
    """The prompt's token ids (>= 1, at most the server's prompt limit). Long prompts are
    tokenized off the event loop (``INLINE_TOKENIZE_MAX_CHARS``).

    ``add_special_tokens=False`` is for a prompt a chat template rendered: the template writes
    BOS itself, so the tokenizer must not add another (vLLM does the same); a tokenizer without
    ``encode_without_special_tokens`` (the mock's) adds none anyway.

    Raises:
        APIError: 500 when the tokenizer fails; 400 ``context_length_exceeded`` when it alone
            exceeds the context; 422 naming ``param`` when the text encodes to no tokens or to
            more than ``resources.max_prompt_tokens``.
    """
    try:
        tokenizer = resources.engine.model.tokenizer
        encode = tokenizer.encode
        if not add_special_tokens:
            encode = getattr(tokenizer, "encode_without_special_tokens", encode)
        if len(text) > INLINE_TOKENIZE_MAX_CHARS:
            prompt_ids = tuple(await asyncio.to_thread(encode, text))
        else:
            prompt_ids = tuple(encode(text))
    except Exception:
        logger.exception("request %s: tokenizing the prompt failed", request_id)
        raise APIError(500, "internal", "failed to tokenize the prompt") from None
    if not prompt_ids:
        raise APIError(422, "invalid_request", f"{param}: encodes to no tokens", param=param)
    context_length = resources.engine.model.capabilities.context_length
    if len(prompt_ids) > context_length:
        raise APIError(
            400,
            "context_length_exceeded",
            f"{param} ({len(prompt_ids)} tokens) exceeds the context length of "
            f"{context_length} tokens",
            param=param,
        )
    if len(prompt_ids) > resources.max_prompt_tokens:
        raise APIError(
            422,
            "invalid_request",
            f"{param}: {len(prompt_ids)} tokens, the limit is {resources.max_prompt_tokens}",
            param=param,
        )
    return prompt_ids


def check_context_length(
    resources: ServerResources,
    *,
    prompt_tokens: int,
    max_tokens: int,
    prompt_param: str,
    max_tokens_param: str,
) -> None:
    """Raises APIError 400 ``context_length_exceeded`` when prompt + max_tokens do not fit."""
    context_length = resources.engine.model.capabilities.context_length
    if prompt_tokens + max_tokens > context_length:
        raise APIError(
            400,
            "context_length_exceeded",
            f"{prompt_param} ({prompt_tokens} tokens) + {max_tokens_param} ({max_tokens}) "
            f"exceeds the context length of {context_length} tokens",
            param=prompt_param,
        )


def admission_refusal(
    resources: ServerResources, *, max_tokens: int | None = None
) -> Overloaded | EngineUnavailable | None:
    """Why a generating request would be refused now, before any expensive work (tokenizing,
    the engine), or None when it would be taken; ``submit`` checks again with the real prompt
    size. A request with ``max_tokens == 0`` never waits for a slot, so it is never refused as
    overloaded. Counts nothing: ``refusal_error`` does, once the refusal is answered.
    """
    if not resources.engine.is_alive:
        return EngineUnavailable(resources.engine.state.value)
    if max_tokens == 0:
        return None
    try:
        resources.engine.check_admission(prompt_tokens=0)
    except Overloaded as exc:
        return exc
    return None


def refuse_if_overloaded(resources: ServerResources, *, max_tokens: int | None = None) -> None:
    """Raises the refusal of ``admission_refusal``, if any.

    Raises:
        APIError: 429 (queue full, ``Retry-After`` set), 503 (not serving).
    """
    refusal = admission_refusal(resources, max_tokens=max_tokens)
    if refusal is not None:
        raise refusal_error(resources, refusal)


def submit(resources: ServerResources, generation: GenerationRequest) -> RequestHandle:
    """Hands the request to the engine.

    Raises:
        APIError: 409 (id in flight), 429 (queue full, ``Retry-After`` set), 503 (not serving).
    """
    try:
        return resources.engine.submit(generation)
    except DuplicateRequestId:
        raise APIError(
            409,
            "conflict",
            f"a request with id {generation.request_id!r} is already in flight",
            param="X-Request-Id",
        ) from None
    except (Overloaded, EngineUnavailable) as exc:
        raise refusal_error(resources, exc) from None


def refusal_error(resources: ServerResources, exc: Overloaded | EngineUnavailable) -> APIError:
    """The answer to a refusal (429 with ``Retry-After``, or 503), counted in the rejected
    requests metric."""
    if isinstance(exc, Overloaded):
        resources.engine.metrics.requests_rejected.labels(type="overloaded").inc()
        return APIError(
            429,
            "overloaded",
            f"the server is overloaded: {exc}; retry later",
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    resources.engine.metrics.requests_rejected.labels(type="unavailable").inc()
    return APIError(503, "unavailable", "the server is not accepting requests")


async def final_unless_disconnected(
    request: Request, handle: RequestHandle, resources: ServerResources
) -> FinalEvent | None:
    """Waits for the final event while listening for the client leaving (body already read).

    Returns None when the client disconnected first; the request is then cancelled.
    """
    result = asyncio.ensure_future(handle.result())
    disconnect = asyncio.ensure_future(_client_disconnected(request))
    try:
        done, _ = await asyncio.wait({result, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if result in done:
            return result.result()
        resources.engine.abort(handle)
        return None
    except asyncio.CancelledError:
        resources.engine.abort(handle)
        raise
    finally:
        result.cancel()
        disconnect.cancel()


async def _client_disconnected(request: Request) -> None:
    """Returns once the ASGI server reports ``http.disconnect`` (body already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
