"""Request bodies of the OpenAI-compatible API (``/v1/...``): validation happens here, once, and
each body becomes the wire-neutral ``GenerationParams`` (``generation_params()``).

Bodies follow OpenAI's field names and defaults. An unknown field is a 400 naming it, as OpenAI
answers one (API.md: a field the server cannot honour is never silently ignored: vLLM's
``stop_token_ids`` or ``guided_json`` would otherwise change nothing); OpenAI's bookkeeping fields
that change no output (``user``, ``metadata``, ``service_tier``, ``prompt_cache_key``,
``safety_identifier``, ``store`` false) are accepted and ignored. Known fields are checked against
the native ranges of ``../shared/API.md`` (a bad value is an error naming the field) and the OpenAI
features this server does not have are refused with the error type ``unsupported_value`` instead of
being silently ignored: ``best_of`` other than ``n``, ``suffix``, several prompts.
``response_format`` (``text``, ``json_object``, ``json_schema``) is enforced by constrained
decoding, on both endpoints; tools are ``app.api.openai.tools``'s. Native fields are accepted as
extensions, under vLLM's names: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids`` and ``constraint``; vLLM's and SGLang's other fields are
tolerated at the values this server follows anyway (``wire_fields.TOLERATED_FIELDS``: what
vllm-router sends with every request).
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from app.api.constraint_body import ConstraintBody
from app.api.openai.tools import MAX_TOOLS, ToolBody, ToolChoiceBody, ToolPlan, tool_plan
from app.api.openai.wire_fields import TOLERATED_FIELDS, ChatMessageBody, accepts, unsupported
from app.api.request_builder import (
    ChatPrompt,
    GenerationParams,
    TextPrompt,
    TokenBudget,
    TokenPrompt,
)
from app.api.schemas import (
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SEED_LIMIT,
    LogitBiasMap,
    TokenId,
    check_logit_bias_keys,
    logit_bias_pairs,
)
from app.constraints import ConstraintSpec

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 16  # n, API.md

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


_STOP_SCHEMA = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema. ``strict`` is accepted either
    way: the schema is always enforced (by constrained decoding)."""

    model_config = ConfigDict(extra="allow", strict=True)

    name: str | None = Field(None, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (free), ``json_object`` (one JSON object) or
    ``json_schema`` (a value valid against ``json_schema.schema``)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("missing", "json_schema is required for this type")
        return self

    def spec(self) -> ConstraintSpec | None:
        """The constraint it asks for (None for ``text``)."""
        if self.type == "json_object":
            return ConstraintSpec.json_object(param="response_format")
        if self.type == "json_schema" and self.json_schema is not None:
            schema = self.json_schema.json_schema
            return ConstraintSpec.json_schema(
                {} if schema is None else schema, param="response_format"
            )
        return None


class OpenAIRequestBody(BaseModel):
    """Fields both ``/v1/completions`` and ``/v1/chat/completions`` take; any other is a 400
    naming it unless ``tolerated_fields`` allows its value (``extra_field_error``)."""

    model_config = ConfigDict(extra="allow", strict=True)
    tolerated_fields: ClassVar[dict[str, tuple[Any, ...]]] = TOLERATED_FIELDS

    model: str | None = Field(None, description="ignored: the server has one model")
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, description="choices to generate")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: list[StopString] = Field(
        default_factory=list,
        max_length=MAX_STOP_STRINGS,
        json_schema_extra=accepts(
            _STOP_SCHEMA,
            {"type": "array", "items": _STOP_SCHEMA, "maxItems": MAX_STOP_STRINGS},
            {"type": "null"},
        ),
    )
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: LogitBiasMap | None = None
    user: str | None = Field(None, description="accepted and ignored")
    metadata: dict[str, str] | None = Field(None, description="accepted and ignored")
    service_tier: str | None = Field(None, description="accepted and ignored")
    prompt_cache_key: str | None = Field(None, description="accepted and ignored")
    safety_identifier: str | None = Field(None, description="accepted and ignored")
    store: bool | None = Field(None, description="false: this server stores nothing")
    # Extensions, as vLLM names them (``extra_body`` in the openai SDK); not OpenAI fields.
    top_k: int | None = Field(None, ge=0, description="extension: keep the k likeliest; 0: off")
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False, description="extension")
    repetition_penalty: float | None = Field(
        None, gt=0.0, le=2.0, allow_inf_nan=False, description="extension: Hugging Face's"
    )
    min_tokens: int | None = Field(None, ge=0, description="extension: EOS held back until then")
    ignore_eos: bool | None = Field(None, description="extension: only max tokens or stop end it")
    stop_token_ids: list[TokenId] = Field(
        default_factory=list, max_length=MAX_STOP_TOKEN_IDS, description="extension: as vLLM's"
    )
    constraint: ConstraintBody | None = Field(
        None, description="extension: structured output, as /generate's constraint"
    )
    response_format: ResponseFormat | None = None

    _logit_bias_keys = field_validator("logit_bias")(check_logit_bias_keys)

    @property
    def choices(self) -> int:
        """How many choices the answer has (``n``, default 1)."""
        return self.n or 1

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(
        cls, options: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise PydanticCustomError("invalid_value", "only allowed when stream is true")
        return options

    @field_validator("store")
    @classmethod
    def _nothing_stored(cls, store: bool | None) -> bool | None:
        if store:
            raise unsupported("this server is stateless: store must be false")
        return store

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, stop: Any) -> Any:
        if stop is None:
            return []
        return [stop] if isinstance(stop, str) else stop

    @model_validator(mode="after")
    def _one_constraint(self) -> OpenAIRequestBody:
        if self.constraint is not None and self.response_format is not None:
            if self.response_format.type != "text":
                raise PydanticCustomError(
                    "invalid_value", "give either response_format or constraint, not both"
                )
        return self

    def constraint_spec(self) -> ConstraintSpec | None:
        """The structured output asked for: ``response_format`` or the ``constraint``
        extension (never both), or None."""
        if self.constraint is not None:
            return self.constraint.spec("constraint")
        return None if self.response_format is None else self.response_format.spec()

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def streamed(self) -> bool:
        return bool(self.stream)

    def _params(
        self, prompt: TextPrompt | ChatPrompt, budget: TokenBudget, logprobs: int | None
    ) -> GenerationParams:
        """The fields both endpoints share, OpenAI's defaults applied."""
        return GenerationParams(
            prompt=prompt,
            budget=budget,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            stop=tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=bool(self.ignore_eos),
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=(
                1.0 if self.repetition_penalty is None else self.repetition_penalty
            ),
            min_tokens=self.min_tokens or 0,
            logit_bias=logit_bias_pairs(self.logit_bias),
            logprobs=logprobs,
            constraint=self.constraint_spec(),
        )


class CompletionRequestBody(OpenAIRequestBody):
    """Body of ``POST /v1/completions``; ``prompt`` is one string (or a list of one string)."""

    prompt: str | list[TokenId] = Field(
        min_length=1,
        json_schema_extra=accepts(
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 1},
            {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
            {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                "maxItems": 1,
            },
        ),
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    def generation_params(self) -> GenerationParams:
        """``max_tokens`` defaults to 16, as at OpenAI."""
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        prompt = (
            TextPrompt(self.prompt)
            if isinstance(self.prompt, str)
            else TokenPrompt(tuple(self.prompt))
        )
        budget = TokenBudget(max_tokens, default=self.max_tokens is None)
        params = self._params(prompt, budget, self.logprobs)
        if self.echo and self.logprobs is not None:  # the echoed prompt's logprobs
            params = replace(params, prompt_logprobs=self.logprobs)
        return params

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if prompt in ("", [""], [], [[]]):
            # (else pydantic's union says "at least 1 item" of a string)
            raise PydanticCustomError(
                "invalid_value", "the prompt is empty: give at least one character or token id"
            )
        if not isinstance(prompt, list):
            return prompt
        if len(prompt) == 1 and isinstance(prompt[0], str | list):
            return prompt[0]  # one text, or one list of token ids
        if prompt and all(isinstance(item, int) for item in prompt):
            return prompt  # token ids
        raise unsupported(f"one prompt per request is supported, got a list of {len(prompt)}")

    @field_validator("echo")
    @classmethod
    def _echo_logprobs_not_streamed(cls, echo: bool | None, info: ValidationInfo) -> bool | None:
        if echo and info.data.get("logprobs") is not None and info.data.get("stream"):
            raise unsupported("echo with logprobs is answered whole: set stream to false")
        return echo

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if best_of is not None and best_of != n:
            raise unsupported(f"best_of must equal n ({n}); ranking candidates is not supported")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise unsupported("suffix is not supported")
        return suffix


class ChatCompletionRequestBody(OpenAIRequestBody):
    """Body of ``POST /v1/chat/completions``.

    ``max_completion_tokens`` wins over the older ``max_tokens``; with neither, the answer may
    use the whole context left after the prompt (capped by the server's ``max_tokens`` cap).
    """

    messages: list[ChatMessageBody] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolBody] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoiceBody | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extension: more variables for the chat template (enable_thinking)"
    )

    def generation_params(self) -> GenerationParams:
        """``max_completion_tokens``, else ``max_tokens``, else the context left after the
        prompt; ``developer`` turns are rendered as ``system`` ones."""
        if self.max_completion_tokens is not None:
            budget = TokenBudget(self.max_completion_tokens, "max_completion_tokens")
        elif self.max_tokens is not None:
            budget = TokenBudget(self.max_tokens, "max_tokens")
        else:
            budget = TokenBudget(None, "max_completion_tokens")
        turns = tuple(message.turn() for message in self.messages)
        plan = self.tool_plan
        tools = () if plan is None else plan.template_tools()
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        prompt = ChatPrompt(turns, tools=tools, template_kwargs=self.chat_template_kwargs)
        params = self._params(prompt, budget, logprobs)
        constraint = None if plan is None else plan.constraint()
        if constraint is None:
            return params
        return dataclasses.replace(params, constraint=constraint)

    @property
    def tool_plan(self) -> ToolPlan | None:
        """What the tool fields ask for (None without tools); checked when the body was."""
        return tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls)

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(
        cls, choice: ToolChoiceBody | None, info: ValidationInfo
    ) -> ToolChoiceBody | None:
        try:
            tool_plan(info.data.get("tools"), choice, None)
        except ValueError as exc:
            raise PydanticCustomError("invalid_value", str(exc)) from None
        return choice

    @model_validator(mode="after")
    def _tools_consistent(self) -> ChatCompletionRequestBody:
        plan = self.tool_plan
        if plan is not None and plan.constraint() is not None and self.constraint_spec():
            raise PydanticCustomError(
                "invalid_value",
                "tool_choice required or named cannot be combined with response_format or "
                "constraint",
            )
        return self

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(
        cls, top_logprobs: int | None, info: ValidationInfo
    ) -> int | None:
        if top_logprobs is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("invalid_value", "top_logprobs needs logprobs: true")
        return top_logprobs
