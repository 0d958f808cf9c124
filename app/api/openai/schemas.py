"""Request bodies of the OpenAI-compatible API (``/v1/...``): validation happens here, once, and
each body becomes the wire-neutral ``GenerationParams`` (``generation_params()``).

Bodies follow OpenAI's field names and defaults. Like OpenAI, unknown fields are accepted (the
route logs and ignores them). Known fields are checked against the native ranges of
``../shared/API.md`` (a bad value is an error naming the field) and the OpenAI features this
server does not have are refused with the error type ``unsupported_value`` instead of being
silently ignored: ``best_of`` other than ``n``, ``suffix``, tools, a non-text
``response_format``, several prompts. Native fields are accepted as extensions, under vLLM's
names: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens`` and ``ignore_eos``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

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
    SEED_LIMIT,
    LogitBiasMap,
    TokenId,
    check_logit_bias_keys,
    logit_bias_pairs,
)
from app.engine.chat_template import ChatMessage

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 16  # n, API.md

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


def _unsupported(message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_value", message)


def _accepts(*alternatives: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    """A field's JSON schema, for fields whose ``before`` validator takes more shapes than the
    type they become (``stop``: a string or a list)."""

    def document(schema: dict[str, Any]) -> None:
        description = schema.get("description")
        schema.clear()
        schema["anyOf"] = list(alternatives)
        if description:
            schema["description"] = description

    return document


_STOP_SCHEMA = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: bool = False


class OpenAIRequestBody(BaseModel):
    """Fields both ``/v1/completions`` and ``/v1/chat/completions`` take."""

    model_config = ConfigDict(extra="allow", strict=True)

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
        json_schema_extra=_accepts(
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
    # Extensions, as vLLM names them (``extra_body`` in the openai SDK); not OpenAI fields.
    top_k: int | None = Field(None, ge=0, description="extension: keep the k likeliest; 0: off")
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False, description="extension")
    repetition_penalty: float | None = Field(
        None, gt=0.0, le=2.0, allow_inf_nan=False, description="extension: Hugging Face's"
    )
    min_tokens: int | None = Field(None, ge=0, description="extension: EOS held back until then")
    ignore_eos: bool | None = Field(None, description="extension: only max tokens or stop end it")

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

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, stop: Any) -> Any:
        if stop is None:
            return []
        return [stop] if isinstance(stop, str) else stop

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
        )


class CompletionRequestBody(OpenAIRequestBody):
    """Body of ``POST /v1/completions``; ``prompt`` is one string (or a list of one string)."""

    prompt: str | list[TokenId] = Field(
        min_length=1,
        json_schema_extra=_accepts(
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
        params = self._params(prompt, TokenBudget(max_tokens), self.logprobs)
        if self.echo and self.logprobs is not None:  # the echoed prompt's logprobs
            params = replace(params, prompt_logprobs=self.logprobs)
        return params

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if not isinstance(prompt, list):
            return prompt
        if len(prompt) == 1 and isinstance(prompt[0], str | list):
            return prompt[0]  # one text, or one list of token ids
        if prompt and all(isinstance(item, int) for item in prompt):
            return prompt  # token ids
        raise _unsupported(f"one prompt per request is supported, got a list of {len(prompt)}")

    @field_validator("echo")
    @classmethod
    def _echo_logprobs_not_streamed(cls, echo: bool | None, info: ValidationInfo) -> bool | None:
        if echo and info.data.get("logprobs") is not None and info.data.get("stream"):
            raise _unsupported("echo with logprobs is answered whole: set stream to false")
        return echo

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if best_of is not None and best_of != n:
            raise _unsupported(f"best_of must equal n ({n}); ranking candidates is not supported")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise _unsupported("suffix is not supported")
        return suffix


class ChatMessageBody(BaseModel):
    """One message. ``content`` is a string or a list of text parts (joined with newlines);
    ``developer`` is OpenAI's newer name for ``system``."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str = Field(
        json_schema_extra=_accepts(
            {"type": "string"},
            {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                    "required": ["type", "text"],
                },
            },
        )
    )
    name: str | None = Field(None, description="accepted and ignored")

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_joined(cls, content: Any) -> Any:
        if not isinstance(content, list):
            return content
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise _unsupported("only text content parts are supported")
            texts.append(part.get("text"))
        if not all(isinstance(text, str) for text in texts):
            raise PydanticCustomError("invalid_value", "a text part needs a string 'text'")
        return "\n".join(texts)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind != "text":
            raise _unsupported("only response_format type 'text' is supported")
        return kind


class ChatCompletionRequestBody(OpenAIRequestBody):
    """Body of ``POST /v1/chat/completions``.

    ``max_completion_tokens`` wins over the older ``max_tokens``; with neither, the answer may
    use the whole context left after the prompt (capped by the server's ``max_tokens`` cap).
    """

    messages: list[ChatMessageBody] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    response_format: ResponseFormat | None = None

    def generation_params(self) -> GenerationParams:
        """``max_completion_tokens``, else ``max_tokens``, else the context left after the
        prompt; ``developer`` turns are rendered as ``system`` ones."""
        if self.max_completion_tokens is not None:
            budget = TokenBudget(self.max_completion_tokens, "max_completion_tokens")
        elif self.max_tokens is not None:
            budget = TokenBudget(self.max_tokens, "max_tokens")
        else:
            budget = TokenBudget(None, "max_completion_tokens")
        turns = tuple(
            ChatMessage(role="system" if m.role == "developer" else m.role, content=m.content)
            for m in self.messages
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(ChatPrompt(turns), budget, logprobs)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(
        cls, top_logprobs: int | None, info: ValidationInfo
    ) -> int | None:
        if top_logprobs is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("invalid_value", "top_logprobs needs logprobs: true")
        return top_logprobs

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if tools:
            raise _unsupported("tools are not supported")
        return tools
