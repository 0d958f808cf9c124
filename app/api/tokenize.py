"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes (API.md).

``/tokenize`` takes ``{"prompt": "..."}`` (tokenized as /generate tokenizes a prompt) or
``{"messages": [...], "add_generation_prompt": true}`` (the model's chat template applied, as
/v1/chat/completions renders it) and answers the token ids, their count and the context length;
``/detokenize`` turns ids back into text. Errors are /generate's: 422 for a bad body or an id
outside the vocabulary, 500 when the tokenizer fails. Neither touches the batch: they run on
the event loop (a long text on a worker thread) and are never refused as overloaded.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.api.admission import read_body
from app.api.errors import APIError, validation_error
from app.api.openai.wire_fields import ChatMessageBody
from app.api.request_builder import INLINE_TOKENIZE_MAX_CHARS
from app.api.request_path import parse_body
from app.api.resources import resources_of
from app.api.schemas import ErrorResponse, TokenId, request_body_openapi
from app.engine.chat_template import ChatMessage, ChatTemplateError
from app.engine.prompt_encoder import TokenizationError

logger = logging.getLogger(__name__)

router = APIRouter()
_ERRORS: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorResponse} for status in (401, 413, 422, 500, 503)
}


class TokenizeRequestBody(BaseModel):
    """Body of ``POST /tokenize``: exactly one of ``prompt`` and ``messages``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="ignored: the server has one model")
    prompt: str | None = Field(None, min_length=1)
    messages: list[ChatMessageBody] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(
        False,
        description="vLLM's flag: end the rendering inside the last message (for the model to "
        "continue it); add_generation_prompt must then be false",
    )

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequestBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' and 'messages'")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequestBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="ignored: the server has one model")
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post(
    "/tokenize",
    response_model=TokenizeResponse,
    responses=_ERRORS,
    openapi_extra=request_body_openapi(TokenizeRequestBody),
)
async def tokenize(request: Request) -> TokenizeResponse:
    """The token ids of a prompt, or of a conversation through the chat template."""
    resources = resources_of(request)
    resources.guard.owner_of(request)
    raw = await read_body(request, resources.config.max_body_bytes)
    body = parse_body(TokenizeRequestBody, raw, validation_error)
    engine = resources.engine
    try:
        if body.messages is not None:
            turns = tuple(
                ChatMessage(role="system" if m.role == "developer" else m.role, content=m.content)
                for m in body.messages
            )
            tokens = engine.encode_chat(
                turns,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
            )
        elif len(body.prompt or "") > INLINE_TOKENIZE_MAX_CHARS:
            tokens = await asyncio.to_thread(engine.encode_text, body.prompt or "")
        else:
            tokens = engine.encode_text(body.prompt or "")
    except ChatTemplateError as exc:
        raise APIError(422, "invalid_request", f"messages: {exc}", param="messages") from None
    except TokenizationError:
        logger.exception("tokenizing failed")
        raise APIError(500, "internal", "failed to tokenize the prompt") from None
    return TokenizeResponse(
        count=len(tokens), max_model_len=engine.capabilities.context_length, tokens=list(tokens)
    )


@router.post(
    "/detokenize",
    response_model=DetokenizeResponse,
    responses=_ERRORS,
    openapi_extra=request_body_openapi(DetokenizeRequestBody),
)
async def detokenize(request: Request) -> DetokenizeResponse:
    """The text of token ids."""
    resources = resources_of(request)
    resources.guard.owner_of(request)
    raw = await read_body(request, resources.config.max_body_bytes)
    body = parse_body(DetokenizeRequestBody, raw, validation_error)
    vocab_size = resources.engine.capabilities.vocab_size
    outside = [token for token in body.tokens if token >= vocab_size]
    if outside:
        raise APIError(
            422,
            "invalid_request",
            f"tokens: {outside[0]} is outside the vocabulary (size {vocab_size})",
            param="tokens",
        )
    try:
        text = resources.engine.decode(tuple(body.tokens), special_tokens=True)
    except TokenizationError:
        logger.exception("detokenizing failed")
        raise APIError(500, "internal", "failed to detokenize the tokens") from None
    return DetokenizeResponse(prompt=text)
