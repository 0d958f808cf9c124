"""The one internal request builder: what a client asked for, in any wire format, becomes the
engine's frozen ``GenerationRequest``.

Every generating body (``POST /generate``, ``/v1/completions``, ``/v1/chat/completions``) turns
itself into ``GenerationParams`` (its ``generation_params()``): wire names and wire defaults end
there. ``RequestBuilder.build`` then runs the checks that need the model, once and in one order:

    token budget <= the server's cap -> stop token ids and logit_bias ids in the vocabulary ->
    min_tokens <= the budget -> the prompt, tokenized by the engine (a chat rendered with the
    model's template) -> the default budget of a chat -> prompt + budget <= the context length
    -> the seed (a random one unless the client chose it) -> the constraint, compiled by the
    engine (on a worker thread: cached, else milliseconds)

A new request field is added to ``GenerationParams``, to ``build``, and to each wire schema that
offers it. ``build`` needs no HTTP request (the batch runner has only a body): every refusal is
an ``APIError`` in the native vocabulary, which each route family renders in its own shape.
``build_sync`` is the same checks without an event loop (``app.llm``, on a ``SyncEngine``): the
builder reads the model only through the engine's ``capabilities`` / ``encode_text`` /
``encode_chat``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from app.api.errors import APIError
from app.config import ServerConfig
from app.constraints import CompiledConstraint, ConstraintError, ConstraintSpec
from app.engine.chat_template import ChatMessage, ChatTemplateError
from app.engine.prompt_encoder import TokenizationError
from app.engine.request import GenerationRequest, StopCriteria
from app.models.base import ModelCapabilities, SamplingParams

logger = logging.getLogger(__name__)

# Prompts longer than this (characters) are tokenized on a worker thread: a 1 MB prompt takes
# ~1 s to tokenize, which on the event loop would stall every open stream. Shorter ones take
# microseconds, less than the hop to a thread.
INLINE_TOKENIZE_MAX_CHARS = 16_384
SEED_BITS = 63  # seeds are in [0, 2**63), API.md


@dataclass(frozen=True, slots=True)
class TextPrompt:
    """A prompt to continue as it is; ``param`` names its field in error messages."""

    text: str
    param: str = "prompt"


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    """A prompt already tokenized by the client (OpenAI's completions take token ids; so
    evaluation harnesses send them). Each id must be in the vocabulary."""

    token_ids: tuple[int, ...]
    param: str = "prompt"


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A conversation, rendered with the model's chat template up to the assistant's turn;
    ``tools`` (OpenAI's tool entries) and ``template_kwargs`` (more variables) go to it.
    ``continue_final_message``: the last message is left open for the model to continue (an
    Anthropic prefill)."""

    messages: tuple[ChatMessage, ...]
    param: str = "messages"
    tools: tuple[dict[str, Any], ...] = ()
    template_kwargs: Mapping[str, Any] | None = None
    continue_final_message: bool = False


@dataclass(frozen=True, slots=True)
class TokenBudget:
    """The most tokens to generate, as asked.

    Attributes:
        max_tokens: a count (0 finishes at once), or None: whatever the context has room for
            after the prompt, up to the server's cap (a chat without a limit).
        param: the field it came from, for error messages (``max_completion_tokens``...).
        default: ``max_tokens`` is the wire's default, not the client's: the cap lowers it.
    """

    max_tokens: int | None
    param: str = "max_tokens"
    default: bool = False


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """A generating request in no wire format's terms, already checked against the wire
    schema's own ranges (pydantic); the model-dependent checks are ``RequestBuilder``'s.

    Attributes:
        prompt: what to continue.
        budget: how many tokens at most.
        temperature / top_p / top_k: sampling (0 / 1 / 0 switch each off; temperature 0: greedy).
        seed: the client's seed, or None (a random one is drawn). stop / stop_token_ids: stop
            strings, token ids that end generation. ignore_eos: EOS does not end generation.
        min_p / presence_penalty / frequency_penalty / repetition_penalty / min_tokens /
            logit_bias: the logits processors (``SamplingParams``; 0 / 0 / 0 / 1 / 0 / ()
            switch each off); ``logit_bias`` as ``(token_id, bias)`` pairs, distinct ids.
        logprobs: alternatives reported with each generated token's logprob (None: no logprobs).
        prompt_logprobs: the same for each prompt token (None: none).
        constraint: structured output (the language every output must be in), or None.
    """

    prompt: TextPrompt | TokenPrompt | ChatPrompt
    budget: TokenBudget
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    constraint: ConstraintSpec | None = None


@dataclass(frozen=True, slots=True)
class RequestOrigin:
    """Who sent a request and when.

    Attributes:
        request_id: the public id (the client's ``X-Request-Id`` or a server-made one).
        owner: a digest of the API key used (only the same owner may cancel), or None.
        arrived_at: ``time.perf_counter()`` seconds when the request was accepted.
    """

    request_id: str
    owner: str | None
    arrived_at: float


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the server accepts beyond the wire schemas' ranges, in tokens: the largest token
    budget (``max_tokens_cap``) and the largest prompt (``max_prompt_tokens``)."""

    max_tokens_cap: int
    max_prompt_tokens: int

    @classmethod
    def of(cls, config: ServerConfig, capabilities: ModelCapabilities) -> RequestLimits:
        """The configured caps, none above the model's context length (unset: the context)."""
        context = capabilities.context_length
        return cls(
            max_tokens_cap=min(config.max_tokens_cap or context, context),
            max_prompt_tokens=min(config.max_prompt_tokens or context, context),
        )


class PromptTokenizingEngine(Protocol):
    """What the builder reads of an engine (``AsyncEngine`` and ``SyncEngine`` both are one)."""

    @property
    def capabilities(self) -> ModelCapabilities: ...

    @property
    def chat_stop_strings(self) -> tuple[str, ...]: ...

    def encode_text(self, text: str) -> tuple[int, ...]: ...

    def encode_chat(
        self,
        messages: tuple[ChatMessage, ...],
        tools: tuple[dict[str, Any], ...] = (),
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> tuple[int, ...]: ...

    def compile_constraint(self, spec: ConstraintSpec) -> CompiledConstraint: ...


class RequestBuilder:
    """Builds the engine's requests for one engine (see the module doc for the order of checks).

    Args:
        engine: the engine whose model the requests are checked against and tokenized by.
        limits: the server's caps.
    """

    def __init__(self, engine: PromptTokenizingEngine, limits: RequestLimits) -> None:
        self._engine = engine
        self.limits = limits

    async def build(self, params: GenerationParams, origin: RequestOrigin) -> GenerationRequest:
        """The validated, tokenized request; a long prompt is tokenized on a worker thread
        (``INLINE_TOKENIZE_MAX_CHARS``), so the event loop keeps serving meanwhile.

        Raises:
            APIError: 422 ``invalid_request`` naming the field (budget over the cap, a stop
                token id outside the vocabulary, a prompt of no tokens or over the prompt
                limit, a conversation the chat template refuses, a constraint that cannot be
                compiled); 400 ``context_length_exceeded``; 500 ``internal`` when the
                tokenizer fails.
        """
        self._check_before_encoding(params)
        if _prompt_chars(params.prompt) > INLINE_TOKENIZE_MAX_CHARS:
            prompt_ids = await asyncio.to_thread(self._encode, params.prompt, origin.request_id)
        else:
            prompt_ids = self._encode(params.prompt, origin.request_id)
        request = self._request(params, origin, prompt_ids)
        if params.constraint is None:
            return request
        compiled = await asyncio.to_thread(self._compile, params.constraint)
        return dataclasses.replace(request, constraint=compiled)

    def build_sync(self, params: GenerationParams, origin: RequestOrigin) -> GenerationRequest:
        """``build`` on the caller's thread, for a caller without an event loop.

        Raises:
            APIError: as ``build``.
        """
        self._check_before_encoding(params)
        request = self._request(params, origin, self._encode(params.prompt, origin.request_id))
        if params.constraint is None:
            return request
        return dataclasses.replace(request, constraint=self._compile(params.constraint))

    def _check_before_encoding(self, params: GenerationParams) -> None:
        budget = params.budget
        if budget.max_tokens is not None and not budget.default:
            self._check_max_tokens(budget.max_tokens, budget.param)
        self._check_stop_token_ids(params.stop_token_ids)
        self._check_logit_bias(params.logit_bias)
        if budget.max_tokens is not None and params.min_tokens > budget.max_tokens:
            raise APIError(
                422,
                "invalid_request",
                f"min_tokens ({params.min_tokens}) must be <= {budget.param} ({budget.max_tokens})",
                param="min_tokens",
            )

    def _request(
        self, params: GenerationParams, origin: RequestOrigin, prompt_ids: tuple[int, ...]
    ) -> GenerationRequest:
        """The checks after tokenizing, then the frozen request (the seed drawn if unset)."""
        budget = params.budget
        max_tokens = self._max_tokens(budget, len(prompt_ids))
        self._check_context_length(params.prompt.param, len(prompt_ids), budget.param, max_tokens)
        return GenerationRequest(
            request_id=origin.request_id,
            prompt_token_ids=prompt_ids,
            max_tokens=max_tokens,
            sampling=SamplingParams(
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                seed=params.seed if params.seed is not None else secrets.randbits(SEED_BITS),
                batch_invariant=params.seed is not None,
                min_p=params.min_p,
                presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty,
                repetition_penalty=params.repetition_penalty,
                min_tokens=min(params.min_tokens, max_tokens),
                min_tokens_token_ids=params.stop_token_ids if params.min_tokens else (),
                logit_bias=params.logit_bias,
                logprobs=params.logprobs,
                prompt_logprobs=params.prompt_logprobs,
            ),
            stop=StopCriteria(
                stop_strings=self._stop_strings(params),
                stop_token_ids=frozenset(params.stop_token_ids),
                ignore_eos=params.ignore_eos,
            ),
            owner=origin.owner,
            arrived_at=origin.arrived_at,
        )

    def _stop_strings(self, params: GenerationParams) -> tuple[str, ...]:
        """The request's stop strings, and a chat's end of turn where the template's is text
        (``chat_stop_strings``)."""
        if not isinstance(params.prompt, ChatPrompt):
            return params.stop
        extra = tuple(s for s in self._engine.chat_stop_strings if s not in params.stop)
        return params.stop + extra

    # ----------------------------------------------------------------- the checks

    def _check_max_tokens(self, max_tokens: int, param: str) -> None:
        cap = self.limits.max_tokens_cap
        if max_tokens > cap:
            raise APIError(422, "invalid_request", f"{param} must be <= {cap}", param=param)

    def _check_stop_token_ids(self, stop_token_ids: tuple[int, ...]) -> None:
        self._check_vocabulary(stop_token_ids, "stop_token_ids", "stop_token_ids: {}")

    def _checked_token_ids(self, prompt: TokenPrompt) -> tuple[int, ...]:
        self._check_vocabulary(prompt.token_ids, prompt.param, prompt.param + ": token {}")
        return prompt.token_ids

    def _check_logit_bias(self, logit_bias: tuple[tuple[int, float], ...]) -> None:
        self._check_vocabulary([token for token, _ in logit_bias], "logit_bias", "logit_bias: {}")

    def _check_vocabulary(self, token_ids: Sequence[int], param: str, what: str) -> None:
        """A 422 naming ``param`` for the first of ``token_ids`` outside the vocabulary."""
        vocab_size = self._engine.capabilities.vocab_size
        outside = [token for token in token_ids if token >= vocab_size]
        if outside:
            message = f"{what.format(outside[0])} is outside the vocabulary (size {vocab_size})"
            raise APIError(422, "invalid_request", message, param=param)

    def _encode(
        self, prompt: TextPrompt | TokenPrompt | ChatPrompt, request_id: str
    ) -> tuple[int, ...]:
        """The prompt's token ids: at least one, within the context and the prompt limit."""
        try:
            if isinstance(prompt, TokenPrompt):
                prompt_ids = self._checked_token_ids(prompt)
            elif isinstance(prompt, TextPrompt):
                prompt_ids = self._engine.encode_text(prompt.text)
            else:
                prompt_ids = self._engine.encode_chat(
                    prompt.messages,
                    prompt.tools,
                    template_kwargs=prompt.template_kwargs,
                    continue_final_message=prompt.continue_final_message,
                )
        except ChatTemplateError as exc:
            message = f"{prompt.param}: {exc}"
            raise APIError(422, "invalid_request", message, param=prompt.param) from None
        except TokenizationError:
            logger.exception("request %s: tokenizing the prompt failed", request_id)
            raise APIError(500, "internal", "failed to tokenize the prompt") from None
        param = prompt.param
        if not prompt_ids:
            raise APIError(422, "invalid_request", f"{param}: encodes to no tokens", param=param)
        context_length = self._engine.capabilities.context_length
        if len(prompt_ids) > context_length:
            raise APIError(
                400,
                "context_length_exceeded",
                f"{param}: {len(prompt_ids)} tokens, the limit is {context_length} "
                "(the context length)",
                param=param,
            )
        limit = self.limits.max_prompt_tokens
        if len(prompt_ids) > limit:
            raise APIError(
                422,
                "invalid_request",
                f"{param}: {len(prompt_ids)} tokens, the limit is {limit}",
                param=param,
            )
        return prompt_ids

    def _compile(self, spec: ConstraintSpec) -> CompiledConstraint:
        try:
            return self._engine.compile_constraint(spec)
        except ConstraintError as exc:
            message = f"{spec.param}: {exc}"
            raise APIError(422, "invalid_request", message, param=spec.param) from None

    def _max_tokens(self, budget: TokenBudget, prompt_tokens: int) -> int:
        if budget.max_tokens is not None:
            cap = self.limits.max_tokens_cap if budget.default else budget.max_tokens
            return min(budget.max_tokens, cap)
        room = self._engine.capabilities.context_length - prompt_tokens
        # no room at all: ask for one token, so that the context check refuses the request
        return min(self.limits.max_tokens_cap, max(room, 1))

    def _check_context_length(
        self, prompt_param: str, prompt_tokens: int, max_tokens_param: str, max_tokens: int
    ) -> None:
        context_length = self._engine.capabilities.context_length
        if prompt_tokens + max_tokens > context_length:
            raise APIError(
                400,
                "context_length_exceeded",
                f"{prompt_param} ({prompt_tokens} tokens) + {max_tokens_param} ({max_tokens}) "
                f"exceed the context length of {context_length} tokens",
                param=prompt_param,
            )


def _prompt_chars(prompt: TextPrompt | TokenPrompt | ChatPrompt) -> int:
    if isinstance(prompt, TokenPrompt):
        return 0  # nothing to tokenize
    if isinstance(prompt, TextPrompt):
        return len(prompt.text)
    return sum(len(message.content) for message in prompt.messages)
