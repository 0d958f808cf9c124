"""Pydantic models of the native HTTP API (``../shared/API.md``): validation happens here, once.

Requests are strict: JSON types must match (``"5"`` is not an int, ``1`` is not a bool), unknown
fields are rejected, NaN/Infinity are not numbers.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.api.request_builder import GenerationParams, TextPrompt, TokenBudget

MAX_STOP_STRINGS = 8
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
SEED_LIMIT = 2**63

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
TokenId = Annotated[int, Field(ge=0)]


class GenerateRequestBody(BaseModel):
    """Body of ``POST /generate``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1, description="the text to continue")
    max_tokens: int = Field(128, ge=0, description="most tokens to generate; 0 ends at once")
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False, description="0: greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, description="0: off")
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    stream: bool = False

    def generation_params(self) -> GenerationParams:
        return GenerationParams(
            prompt=TextPrompt(self.prompt),
            budget=TokenBudget(self.max_tokens),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
        )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class TimingsBody(BaseModel):
    """Latencies in milliseconds; ``ttft_ms`` is null when no token was generated."""

    queued_ms: float
    ttft_ms: float | None
    total_ms: float


# The public finish reasons (app.api.answers.finish_reason_name), shared by every wire format.
FinishReasonName = Literal["stop", "length", "cancelled"]


class GenerateResponse(BaseModel):
    """Answer of ``POST /generate`` with ``stream: false``."""

    id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReasonName
    stop_reason: str | int | None
    usage: Usage
    timings: TimingsBody


class TokenEventData(BaseModel):
    """``data`` of an SSE ``token`` event."""

    id: str
    text: str
    token_ids: list[int]


class DoneEventData(BaseModel):
    """``data`` of the SSE ``done`` event."""

    id: str
    finish_reason: FinishReasonName
    stop_reason: str | int | None
    usage: Usage
    timings: TimingsBody


class CancelResponse(BaseModel):
    id: str
    status: Literal["cancelled"]


class ErrorDetail(BaseModel):
    type: str
    message: str
    param: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class HealthResponse(BaseModel):
    status: Literal["ok", "unavailable"]


class InfoResponse(BaseModel):
    model: str
    backend: str
    context_length: int
    max_num_seqs: int
    max_tokens_cap: int
    vocab_size: int
    keeps_kv_cache: bool
    scheduling: str
    version: str
    kv_block_size: int = Field(
        0, description="positions per block of the paged KV cache; 0 without one"
    )
    num_kv_blocks: int = Field(
        0, description="blocks in the paged KV cache pool (usable ones); 0 without one"
    )
    prefix_caching: bool = Field(
        False, description="whether prompt prefixes reuse cached KV blocks"
    )
