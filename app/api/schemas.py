"""Pydantic models of the native HTTP API (``../shared/API.md``): validation happens here, once.

Requests are strict: JSON types must match (``"5"`` is not an int, ``1`` is not a bool), unknown
fields are rejected, NaN/Infinity are not numbers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from app.api.constraint_body import ConstraintBody
from app.api.request_builder import GenerationParams, TextPrompt, TokenBudget
from app.models.base import TokenLogprobs

MAX_STOP_STRINGS = 8
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
SEED_LIMIT = 2**63
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
MAX_LOGIT_BIAS = 100.0
MAX_LOGPROBS = 20

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
TokenId = Annotated[int, Field(ge=0)]
LogitBias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]
LogitBiasMap = Annotated[dict[str, LogitBias], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)]


def check_logit_bias_keys(bias: dict[str, float] | None) -> dict[str, float] | None:
    """``logit_bias``'s keys must be token ids written in decimal (OpenAI's wire form)."""
    for key in bias or {}:
        if not (key.isascii() and key.isdigit()):
            raise PydanticCustomError(
                "invalid_value", f"keys must be token ids in decimal, got {key!r}"
            )
    return bias


def logit_bias_pairs(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """The checked map as ``(token_id, bias)`` pairs (distinct ids: JSON keys; ``"07"`` and
    ``"7"`` would be one id, so the later one wins)."""
    merged: dict[int, float] = {}
    for key, value in (bias or {}).items():
        merged[int(key)] = value
    return tuple(merged.items())


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
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0, description="EOS and stop_token_ids held back until then")
    logit_bias: LogitBiasMap = Field(default_factory=dict)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    _logit_bias_keys = field_validator("logit_bias")(check_logit_bias_keys)
    constraint: ConstraintBody | None = None

    def generation_params(self) -> GenerationParams:
        return GenerationParams(
            prompt=TextPrompt(self.prompt),
            budget=TokenBudget(self.max_tokens, default="max_tokens" not in self.model_fields_set),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            logit_bias=logit_bias_pairs(self.logit_bias),
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            constraint=None if self.constraint is None else self.constraint.spec("constraint"),
        )


def request_body_openapi(model: type[BaseModel]) -> dict[str, object]:
    """The OpenAPI request body of a route that parses its body itself, nested models inlined:
    pydantic's ``#/$defs/...`` references (and a discriminator's mapping onto them) would not
    resolve inside the OpenAPI document. A discriminated union stays a plain ``oneOf``."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})

    def inline(node: object) -> object:
        if isinstance(node, dict):
            reference = node.get("$ref", "")
            if reference.startswith("#/$defs/"):
                return inline(definitions[reference.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items() if key != "discriminator"}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": inline(schema)}},
        }
    }


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


class TopLogprobBody(BaseModel):
    token_id: int
    logprob: float


class TokenLogprobBody(BaseModel):
    """One generated token's raw log-probability and the ``top`` most likely alternatives."""

    token_id: int
    logprob: float
    top: list[TopLogprobBody]


def logprob_bodies(logprobs: Iterable[TokenLogprobs | None]) -> list[TokenLogprobBody | None]:
    return [
        None
        if entry is None
        else TokenLogprobBody(
            token_id=entry.token_id,
            logprob=entry.logprob,
            top=[TopLogprobBody(token_id=t, logprob=lp) for t, lp in entry.top],
        )
        for entry in logprobs
    ]


class GenerateResponse(BaseModel):
    """Answer of ``POST /generate`` with ``stream: false``; ``logprobs`` only when asked."""

    id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReasonName
    stop_reason: str | int | None
    usage: Usage
    timings: TimingsBody
    logprobs: list[TokenLogprobBody] | None = None
    prompt_logprobs: list[TokenLogprobBody | None] | None = None


class TokenEventData(BaseModel):
    """``data`` of an SSE ``token`` event; ``logprobs`` only when asked."""

    id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobBody] | None = None


class DoneEventData(BaseModel):
    """``data`` of the SSE ``done`` event; ``prompt_logprobs`` only when asked."""

    id: str
    finish_reason: FinishReasonName
    stop_reason: str | int | None
    usage: Usage
    timings: TimingsBody
    prompt_logprobs: list[TokenLogprobBody | None] | None = None


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


# The /generate fields that choose how tokens are picked (/info lists them; a client can tell
# which controls this server has). Every one is a field of GenerateRequestBody.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logit_bias",
    "logprobs",
    "prompt_logprobs",
    "stop",
    "stop_token_ids",
    "ignore_eos",
)


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
    sampling_fields: list[str]
    kv_block_size: int = Field(
        0, description="positions per block of the paged KV cache; 0 without one"
    )
    num_kv_blocks: int = Field(
        0, description="blocks in the paged KV cache pool (usable ones); 0 without one"
    )
    prefix_caching: bool = Field(
        False, description="whether prompt prefixes reuse cached KV blocks"
    )
    speculative_ngram: int = Field(
        0, description="--speculative-ngram: most tokens drafted per row and step; 0: off"
    )
    spec_decode_acceptance_rate: float | None = Field(
        None,
        description="drafted tokens the model accepted / drafted tokens, since start; null "
        "before any draft",
    )
    weight_kernels: str = Field(
        "",
        description="what computes the projections when chosen by the CPU's features (the "
        "GGUF-block kernels: instruction set, why, the file's types); empty otherwise",
    )
