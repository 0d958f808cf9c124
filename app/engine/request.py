"""Request-side types: what enters the engine, what a request becomes, what comes out.

``GenerationRequest`` is the frozen, already-validated request the HTTP edge hands the engine.
``Sequence`` is the one mutable object per request that the scheduler owns while it lives.
``TokenEvent`` / ``FinalEvent`` are the frozen messages the scheduler puts on a request's stream.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app.constraints import CompiledConstraint, ConstraintMatcher
from app.models.base import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from app.engine.output_processor import RequestOutput


class FinishReason(enum.Enum):
    """Why a sequence ended. Serialised to the public ``finish_reason`` string at the edge."""

    STOP = "stop"  # EOS, a stop string or a stop token id
    LENGTH = "length"  # max_tokens reached (or max_tokens == 0)
    CANCELLED = "cancelled"  # DELETE, client disconnect, shutdown
    ERROR = "error"  # the model or the detokenizer failed on this request


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(frozen=True, slots=True)
class StopCriteria:
    """What ends generation besides ``max_tokens``.

    Attributes:
        stop_strings: matched on the decoded text; the match is not part of the output.
        stop_token_ids: generating one of these ends the sequence (token not in the text).
        ignore_eos: when True, the model's EOS ids do not end generation.
    """

    stop_strings: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated request, as it crosses from the HTTP edge into the engine.

    Attributes:
        request_id: the public id (client ``X-Request-Id`` or server-made).
        prompt_token_ids: the tokenised prompt (>= 1 token).
        max_tokens: most tokens to generate (0 finishes at once).
        sampling: sampling parameters (seed always set).
        stop: stop criteria.
        owner: an opaque tag of who made the request (API key digest), so that only the same
            owner may cancel it; None when no key is configured.
        arrived_at: ``time.perf_counter()`` seconds when the HTTP request was accepted.
        constraint: the compiled structured-output constraint every generated token must
            keep the output inside, or None (unconstrained).
        group_id: set on the ``n`` choices of one prompt (submitted one after another, the
            same value on each): the scheduler admits a group's waiting sequences into slots
            together (all or none); None for a request on its own.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop: StopCriteria = StopCriteria()
    owner: str | None = None
    arrived_at: float = field(default_factory=time.perf_counter)
    constraint: CompiledConstraint | None = None
    group_id: str | None = None


@dataclass(frozen=True, slots=True)
class Timings:
    """Per-request latencies in milliseconds.

    ``ttft_ms`` is None when no token was generated (max_tokens 0, cancelled while waiting).
    """

    queued_ms: float
    ttft_ms: float | None
    total_ms: float


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """New output of one request: ``text`` may be empty when text is held back.

    ``logprobs``: one entry per ``token_ids`` entry when the request asked for logprobs
    (``SamplingParams.logprobs``), else empty.
    """

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True, slots=True)
class FinalEvent:
    """The single last event of every request.

    Attributes:
        finish_reason: why it ended.
        stop_reason: the stop string or stop token id matched; None for EOS, length, cancel.
        text: the whole output text (stop string trimmed).
        token_ids: every generated token id, including an EOS or stop token that ended it.
        prompt_tokens / completion_tokens: usage, in tokens.
        timings: latencies in ms.
        error: a client-safe message when ``finish_reason`` is ERROR, else None.
        logprobs: one entry per ``token_ids`` entry when the request asked for logprobs,
            else empty.
        prompt_logprobs: one entry per prompt token (None for the first) when the request
            asked for prompt logprobs, else empty.
    """

    finish_reason: FinishReason
    stop_reason: str | int | None
    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    error: str | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()


StreamEvent = TokenEvent | FinalEvent


@dataclass(slots=True, eq=False)
class Sequence:
    """Everything the engine knows about one request while it lives (seed 000).

    Owned by the scheduler; removing it from the scheduler removes all of its state. Identity
    (``is``), not ``request_id``, tells two requests apart: an id can be reused (rule R17).

    Attributes:
        request: the frozen request it came from.
        output: its output side (text, stream, token times; ``app.engine.output_processor``).
        status: WAITING -> RUNNING -> FINISHED, or WAITING -> FINISHED.
        slot: the batch slot while RUNNING, else None.
        num_computed_tokens: tokens of ``prompt + generated`` the model's state covers.
        num_cached_tokens: of those, the prefix found in the prefix cache at admission (a
            multiple of the KV block size; 0 without a paged model).
        generated: sampled token ids, in order (the scheduler appends them; ``output``
            keeps how far its text and its stream got).
        logprobs: one entry a generated token, when the request asked for logprobs.
        prompt_logprobs: the prompt tokens' logprobs so far (when asked for).
        admitted_at: ``time.perf_counter()`` seconds, or None until then.
        matcher: the request's place in its constraint's language, from admission until it
            finishes (None when unconstrained, waiting or finished).
        draft_acceptance: speculative decoding's running estimate of the probability that
            a drafted token is accepted when those before it were (``NgramSpeculation``
            reads and updates it).
    """

    request: GenerationRequest
    output: RequestOutput
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    admitted_at: float | None = None
    matcher: ConstraintMatcher | None = None
    draft_acceptance: float = 0.5

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def scores_prompt_only(self) -> bool:
        """A request for prompt logprobs and no tokens (``max_tokens`` 0): it needs the
        model's prefill, and nothing after it."""
        return self.request.max_tokens == 0 and self.request.sampling.prompt_logprobs is not None

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens fed as prompt chunks: the prompt; after a preemption (recompute), the prompt
        and every generated token but the last, which the next decode row feeds."""
        return self.num_prompt_tokens + max(0, len(self.generated) - 1)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prefill_tokens

    def all_token_ids(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids + tuple(self.generated)

    def add_prompt_logprobs(self, entries: tuple[TokenLogprobs | None, ...]) -> None:
        """Appends a prompt chunk's logprobs, those of the prompt's own positions only: a
        preempted sequence recomputes from 0, its generated tokens after the prompt (each
        scored once, when it was sampled)."""
        room = self.num_prompt_tokens - len(self.prompt_logprobs)
        self.prompt_logprobs.extend(entries[: max(0, room)])

    def enter_slot(self, slot: int, num_cached_tokens: int, now: float) -> None:
        """WAITING -> RUNNING in ``slot`` (the scheduler's admission), its first
        ``num_cached_tokens`` positions already computed (a cached prefix) at ``now``
        (seconds). A constrained request gets its matcher here; a preempted one keeps its
        own, since its generated tokens stay."""
        self.status = SequenceStatus.RUNNING
        self.slot = slot
        self.num_computed_tokens = self.num_cached_tokens = num_cached_tokens
        self.admitted_at = now
        if self.request.constraint is not None and self.matcher is None:
            self.matcher = self.request.constraint.new_matcher()

    def back_to_waiting(self) -> None:
        """RUNNING -> WAITING by recompute preemption, once its slot and blocks are released:
        nothing of it is computed any more; its generated tokens stay (it prefills them)."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = self.num_cached_tokens = 0
        self.prompt_logprobs.clear()  # computed again with the prompt

    def emit_final(
        self,
        reason: FinishReason,
        now: float,
        *,
        stop_reason: str | int | None = None,
        error: str | None = None,
    ) -> None:
        """Emits what text is held back (a last TokenEvent, when there is any), then the
        FinalEvent with this sequence's tokens, usage, logprobs and timings (``now``:
        ``time.perf_counter()`` seconds). The scheduler's ``finish`` calls it, once."""
        output = self.output
        output.send_rest(self.generated, self.logprobs)
        arrived = self.request.arrived_at
        first_token_at = output.first_token_at
        timings = Timings(
            queued_ms=((self.admitted_at or now) - arrived) * 1000.0,
            ttft_ms=None if first_token_at is None else (first_token_at - arrived) * 1e3,
            total_ms=(now - arrived) * 1000.0,
        )
        output.emit(
            FinalEvent(
                finish_reason=reason,
                stop_reason=stop_reason,
                text=output.text.text,
                token_ids=tuple(self.generated),
                prompt_tokens=self.num_prompt_tokens,
                completion_tokens=len(self.generated),
                timings=timings,
                error=error,
                logprobs=tuple(self.logprobs),
                prompt_logprobs=tuple(self.prompt_logprobs),
            )
        )
