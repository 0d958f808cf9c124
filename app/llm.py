"""In-process generation, in the spirit of vLLM's ``LLM``: no server, the same engine.

    from app.llm import LLM, SamplingOptions

    llm = LLM("smollm2", max_num_seqs=8)             # the names and flags of `serve`
    for out in llm.generate(["The capital of France is", "Once upon a time"],
                            SamplingOptions(max_tokens=16, temperature=0)):
        print(out.finish_reason, repr(out.text))

The model is loaded by ``app.models.loading.load_model`` from a ``ServerConfig``, so every model
name and flag of ``python -m app serve`` works here (``SLOTSERVE_*`` environment variables too;
keyword arguments win). Prompts are checked by the server's ``RequestBuilder`` (the same checks,
in the same order, as every HTTP route) and run on the server's ``Scheduler`` (``SyncEngine``,
on the caller's thread), so limits, batching, stop handling and finish reasons are the server's.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.api.constraint_body import ConstraintBody
from app.api.errors import APIError
from app.api.request_builder import (
    GenerationParams,
    RequestBuilder,
    RequestLimits,
    RequestOrigin,
    TextPrompt,
    TokenBudget,
)
from app.api.schemas import (
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SEED_LIMIT,
    LogitBiasMap,
    StopString,
    TokenId,
    check_logit_bias_keys,
    logit_bias_pairs,
)
from app.config import ServerConfig
from app.engine.policy import make_policy
from app.engine.request import GenerationRequest
from app.engine.speculation import NgramSpeculation
from app.engine.sync_engine import ModelStepError, SyncEngine, SyncHandle
from app.models.base import Model, ModelCapabilities, TokenLogprobs
from app.models.loading import load_model

logger = logging.getLogger(__name__)


class SamplingOptions(BaseModel):
    """How one prompt is continued: the fields, defaults and bounds of ``POST /generate``
    (API.md) less ``prompt`` and ``stream``. Frozen; an invalid value raises pydantic's
    ``ValidationError`` (a ValueError) naming the field.

    Attributes:
        max_tokens: most tokens to generate; 0 ends at once.
        temperature: 0 is greedy; 0..2.
        top_p: nucleus mass, (0, 1].
        top_k: 0 is off.
        seed: same seed + prompt + options give the same tokens, whatever else is batched;
            None: a random seed.
        stop: strings that end the text (not part of it).
        stop_token_ids: token ids that end it (in ``token_ids``, not in the text).
        ignore_eos: only ``max_tokens`` or a stop ends it.
        constraint: structured output (API.md, "Constrained output"), e.g.
            ``{"type": "json_schema", "schema": {...}}``; None: free text.
        min_p, presence_penalty, frequency_penalty, repetition_penalty, min_tokens,
            logit_bias: the logits processors, as /generate takes them.
        logprobs / prompt_logprobs: raw logprobs of the generated / prompt tokens with this
            many alternatives (``Generation.logprobs`` / ``prompt_logprobs``); None: none.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: tuple[StopString, ...] = Field((), max_length=MAX_STOP_STRINGS)
    stop_token_ids: tuple[TokenId, ...] = Field((), max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    constraint: ConstraintBody | None = None
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0)
    logit_bias: LogitBiasMap = Field(default_factory=dict)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    _logit_bias_keys = field_validator("logit_bias")(check_logit_bias_keys)

    def generation_params(self, prompt: str) -> GenerationParams:
        """These options for ``prompt``, in the request builder's wire-neutral terms."""
        return GenerationParams(
            prompt=TextPrompt(prompt),
            budget=TokenBudget(self.max_tokens),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            constraint=None if self.constraint is None else self.constraint.spec("constraint"),
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            logit_bias=logit_bias_pairs(self.logit_bias),
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )


@dataclass(frozen=True, slots=True)
class Generation:
    """What one prompt became.

    Attributes:
        request_id: the engine's id for it (``llm-<n>``).
        prompt / prompt_token_ids: the prompt and its tokens.
        text: the generated text (a matched stop string trimmed).
        token_ids: every generated token id, an EOS or stop token that ended it included.
        finish_reason: ``"stop"`` (EOS, stop string, stop token), ``"length"``
            (``max_tokens`` or the context length), or ``"error"`` (the model failed on this
            request; ``error`` says so, the other prompts are unaffected).
        stop_reason: the stop string or stop token id matched; None otherwise.
        error: a message when ``finish_reason`` is ``"error"``, else None.
        logprobs: one entry per ``token_ids`` entry when asked (``SamplingOptions.logprobs``).
        prompt_logprobs: one entry per prompt token (None for the first) when asked.
    """

    request_id: str
    prompt: str
    prompt_token_ids: tuple[int, ...]
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    stop_reason: str | int | None
    error: str | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()


class LLM:
    """A model and an engine in this process.

    Args:
        model: a model name or path, as ``serve --model`` takes it; or an already built
            ``Model`` (then the settings that choose and load a model are not used).
        **settings: any other ``ServerConfig`` field (``max_num_seqs``, ``dtype``,
            ``max_model_len``, ``scheduling``, ``max_num_batched_tokens``, ``max_tokens_cap``,
            ``max_prompt_tokens``, ...), validated as the server validates its flags.

    Steps run on the thread that calls ``generate``; load and generate on one thread (a torch
    model's OpenMP team is per thread, see ``app.engine.model_thread``). Not thread-safe.

    Raises:
        pydantic.ValidationError: an unknown or invalid setting.
        Exception: whatever loading the model raises.
    """

    def __init__(self, model: str | Model = "smollm2", **settings: Any) -> None:
        if isinstance(model, str):
            self.config = ServerConfig(model=model, **settings)
            self.model: Model = load_model(self.config)
        else:
            self.config = ServerConfig(**settings)
            self.model = model
        self._engine = SyncEngine(
            self.model,
            policy=make_policy(self.config.scheduling),
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            prefix_caching=self.config.prefix_caching,
            speculation=NgramSpeculation(self.config.speculative_ngram),
        )
        self._builder = RequestBuilder(
            self._engine, RequestLimits.of(self.config, self.model.capabilities)
        )
        self._ids = itertools.count()

    @property
    def capabilities(self) -> ModelCapabilities:
        return self.model.capabilities

    def generate(
        self,
        prompts: str | Sequence[str],
        sampling: SamplingOptions | Sequence[SamplingOptions] | None = None,
    ) -> list[Generation]:
        """Generates for every prompt, all in flight at once up to the slots; returns one
        ``Generation`` per prompt, in order (a list also for a single prompt).

        Args:
            prompts: one prompt or several.
            sampling: one ``SamplingOptions`` for every prompt, one per prompt, or None for
                the defaults.

        Raises:
            ValueError: ``prompts`` neither a string nor a sequence of them (bytes, None),
                ``sampling`` a list of another length than ``prompts``, a prompt that is not a
                string, or a prompt the server would refuse (``prompts[i]: `` and
                the server's message: no tokens, over the prompt limit or the context length,
                ``max_tokens`` over the cap, a stop token id outside the vocabulary). Nothing
                runs when any is refused.
            RuntimeError: the tokenizer failed on a prompt (the server's 500).
        """
        if isinstance(prompts, bytes | bytearray) or not isinstance(prompts, str | Sequence):
            raise ValueError(
                f"prompts: a string or a list of strings, got {type(prompts).__name__}"
            )
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        for index, text in enumerate(texts):
            if not isinstance(text, str):  # token ids: the HTTP API's /v1/completions takes them
                raise ValueError(
                    f"prompts[{index}]: a prompt is a string, got {type(text).__name__}"
                )
        options = self._options_per_prompt(sampling, len(texts))
        requests = [
            self._request(index, text, option)
            for index, (text, option) in enumerate(zip(texts, options, strict=True))
        ]
        handles = [self._engine.add(request) for request in requests]
        try:
            self._run_until_idle()
        finally:
            if self._engine.has_work:  # interrupted: leave no request behind for the next call
                self._engine.cancel_all()
        return [_generation(text, handle) for text, handle in zip(texts, handles, strict=True)]

    def _run_until_idle(self) -> None:
        while self._engine.has_work:
            try:
                self._engine.step()
            except ModelStepError:
                # As in the server: that step's requests ended with an error, the rest go on.
                logger.exception("a model step failed; its requests end with an error")

    def _options_per_prompt(
        self, sampling: SamplingOptions | Sequence[SamplingOptions] | None, count: int
    ) -> list[SamplingOptions]:
        if sampling is None:
            return [SamplingOptions()] * count
        if isinstance(sampling, SamplingOptions):
            return [sampling] * count
        options = list(sampling) if isinstance(sampling, Sequence) else [sampling]
        for option in options:  # a dict of options was read key by key: say what it was
            if not isinstance(option, SamplingOptions):
                kind = type(option).__name__
                raise ValueError(f"sampling: a SamplingOptions or a list of them, got {kind}")
        if len(options) != count:
            raise ValueError(f"{len(options)} sampling options for {count} prompts")
        return options

    def _request(self, index: int, text: str, options: SamplingOptions) -> GenerationRequest:
        """The frozen request for ``prompts[index]``, checked by the server's request builder.

        Raises:
            ValueError: a refusal the server answers with a 4xx, prefixed ``prompts[index]: ``.
            RuntimeError: the server's 500 (the tokenizer failed).
        """
        origin = RequestOrigin(f"llm-{next(self._ids)}", owner=None, arrived_at=time.perf_counter())
        try:
            return self._builder.build_sync(options.generation_params(text), origin)
        except APIError as error:
            refusal = ValueError if error.status < 500 else RuntimeError
            raise refusal(f"prompts[{index}]: {error.message}") from None


def _generation(text: str, handle: SyncHandle) -> Generation:
    final = handle.final
    if final is None:  # generate returns only once the engine is idle or cancelled
        raise RuntimeError(f"request {handle.request_id} has no final event")
    return Generation(
        request_id=handle.request_id,
        prompt=text,
        prompt_token_ids=handle.request.prompt_token_ids,
        text=final.text,
        token_ids=final.token_ids,
        finish_reason=final.finish_reason.value,
        stop_reason=final.stop_reason,
        error=final.error,
        logprobs=final.logprobs,
        prompt_logprobs=final.prompt_logprobs,
    )
