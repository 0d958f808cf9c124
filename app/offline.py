"""The founding problem's function (``seeds/003``): ``generate`` over a stateless model.

    from app.offline import Request, generate
    from app.models.mock import MockModel, MOCK_EOS_TOKEN_ID

    outputs = generate(MockModel(), [Request("a", [104, 105], 16), Request("b", [], 4)],
                       num_slots=2, stop_token=MOCK_EOS_TOKEN_ID)
    # {"a": [...up to 16 ids...], "b": [...]}

It is not a second loop: ``generate`` hands the requests to the server's own ``Scheduler``
(through ``SyncEngine``, on the caller's thread) behind a ``Model`` adapter, so slot refilling,
the stop and length checks and the finish funnel are the code that serves HTTP.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from app.engine.policy import make_policy
from app.engine.request import GenerationRequest
from app.engine.sync_engine import ModelStepError, SyncEngine
from app.models.base import ModelCapabilities, SamplingParams, StepBatch, StepOutput

__all__ = ["ModelStepError", "NextTokensModel", "NextTokensRunner", "Request", "generate"]

# Position 0 of every sequence the scheduler sees; never passed to ``next_tokens``. A step row
# carries at least one token (a real model needs one to compute logits from, the role BOS plays),
# and the seed allows an empty prompt: with the marker in front, an empty prompt is one token.
START_MARKER = 0


class NextTokensModel(Protocol):
    """The seed's model: stateless, one next token per full prefix."""

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        """``batch[i]`` is the token prefix of one sequence. Returns one next token id per
        entry, in the same order as the batch."""
        ...


@dataclass(frozen=True, slots=True)
class Request:
    """One request of the seed's ``generate`` (its fields verbatim; frozen, so that it reads
    the same while it is served).

    Attributes:
        request_id: unique within one ``generate`` call.
        prompt: token ids; may be empty.
        max_tokens: most new tokens to generate (the prompt does not count), >= 0.
    """

    request_id: str
    prompt: list[int]
    max_tokens: int


def generate(
    model: NextTokensModel,
    requests: list[Request],
    num_slots: int,
    stop_token: int,
    *,
    pad_to_slots: bool = False,
    scheduling: str = "continuous",
) -> dict[str, list[int]]:
    """Serves ``requests`` with continuous batching over ``num_slots`` slots; returns the
    generated tokens of every request, keyed by request_id (in the order of ``requests``).

    The seed's clarifying questions, answered:

    - ``max_tokens`` counts new tokens only, never the prompt.
    - The returned tokens include the stop token when it ended the request (as ``/generate``'s
      ``token_ids`` do); a request cut by ``max_tokens`` has exactly ``max_tokens`` tokens.
    - Batches are compacted: each ``next_tokens`` call gets only the occupied slots, at most
      ``num_slots`` entries, each the full prefix (prompt + tokens generated so far) of a live
      request. With ``pad_to_slots=True`` every call gets exactly ``num_slots`` entries (the
      fixed batch shape of the seed's follow-up): an empty slot is an empty prefix ``[]``
      (the cheapest valid input), and its output is dropped, reaching no request.
    - The requests are known up front; they wait in a FIFO queue in list order, and a slot
      freed in one step is refilled before the next call, so no slot is empty while a request
      waits (``scheduling="static"``: a new batch only once every slot is empty, the baseline).
    - ``max_tokens == 0`` returns ``[]`` without a model call; an empty prompt is allowed (its
      first call gets ``[]``).
    - Duplicate request ids or ``num_slots < 1`` raise ValueError (as does ``max_tokens < 0``),
      before any call.
    - An exception from ``model.next_tokens``, or a call that returns a wrong number of
      tokens, raises ``ModelStepError`` (the model's exception as ``__cause__``) whose message
      names the step (1-based call number) and the ids of the requests in it; no call is made
      after it.

    Where the seed's "strong answer" lives: the slot to request mapping is ``Scheduler.slots``,
    each request's token buffer is its ``Sequence``, the FIFO queue is ``Scheduler.waiting``;
    ``Scheduler.apply`` checks stop token and ``max_tokens`` after every step and frees the
    slot through ``Scheduler.finish``; ``SyncEngine.step`` admits into free slots before the
    next call. Runs synchronously on the caller's thread: no event loop, no thread.

    Args:
        model: anything with ``next_tokens(batch: list[list[int]]) -> list[int]``.
        requests: served FIFO in this order.
        num_slots: most sequences per model call.
        stop_token: generating it ends a request.
        pad_to_slots: give every call exactly ``num_slots`` entries (see above).
        scheduling: ``"continuous"`` or ``"static"`` (``app.engine.policy``).

    Raises:
        ValueError: duplicate ids, ``num_slots < 1``, a negative ``max_tokens``, an unknown
            ``scheduling``.
        ModelStepError: the model failed (see above).
    """
    _check(requests, num_slots)
    runner = NextTokensRunner(
        model, num_slots=num_slots, stop_token=stop_token, fixed_batch_shape=pad_to_slots
    )
    # Every prompt goes to the model in one row (marker + prompt), so one step is one call.
    longest_row = 1 + max((len(request.prompt) for request in requests), default=0)
    engine = SyncEngine(
        runner,
        policy=make_policy(scheduling),
        max_num_batched_tokens=num_slots * longest_row,
    )
    handles = [engine.add(_generation_request(request)) for request in requests]
    # Each call gives every live request a token, so this many calls end them all.
    engine.run_until_idle(max_steps=sum(request.max_tokens for request in requests))
    outputs: dict[str, list[int]] = {}
    for handle in handles:
        if handle.final is None:  # run_until_idle returns only once every request finished
            raise RuntimeError(f"request {handle.request_id!r} did not finish")
        outputs[handle.request_id] = list(handle.final.token_ids)
    return outputs


class NextTokensRunner:
    """The scheduler's ``Model`` protocol over a ``NextTokensModel`` (as ``MockModelRunner``
    adapts ``MockModel``): it keeps each slot's prefix between steps, the way a real model
    keeps a KV cache, drops it on ``release``, and makes one ``next_tokens`` call per step.

    Args:
        model: the stateless model.
        num_slots: slots (``capabilities.max_num_seqs``).
        stop_token: the model's end of sequence (``capabilities.eos_token_ids``).
        fixed_batch_shape: declare it (``ModelCapabilities.fixed_batch_shape``) and pass every
            row of a step, an inert one as ``[]``, so each call has ``num_slots`` entries.
            Otherwise a call holds the rows that sample, only.

    Sequences start with ``START_MARKER`` (see there), which ``next_tokens`` never sees.
    Nothing limits a sequence's length but its ``max_tokens``.
    """

    def __init__(
        self,
        model: NextTokensModel,
        *,
        num_slots: int,
        stop_token: int,
        fixed_batch_shape: bool = False,
    ) -> None:
        self.model = model
        self.tokenizer = TokenIdsOnly()
        self.capabilities = ModelCapabilities(
            name=type(model).__name__,
            backend="next_tokens",
            context_length=sys.maxsize,
            max_num_seqs=num_slots,
            vocab_size=sys.maxsize,
            eos_token_ids=frozenset({stop_token}),
            keeps_kv_cache=False,
            max_tokens_per_row=sys.maxsize,
            fixed_batch_shape=fixed_batch_shape,
        )
        self._prefixes: list[list[int]] = [[] for _ in range(num_slots)]

    def step(self, batch: StepBatch) -> StepOutput:
        """Extends each live row's slot prefix, then calls ``next_tokens`` once.

        Raises:
            ValueError: a row does not continue its slot's prefix, or ``next_tokens`` returned
                another number of tokens than it was given sequences.
            TypeError: a returned token is not an integer.
            Exception: whatever ``next_tokens`` raised.
        """
        for row in batch.rows:
            if not row.inert:
                self._extend(row.slot, row.position, row.token_ids)
        if self.capabilities.fixed_batch_shape:
            called = list(range(len(batch.rows)))
        else:
            called = [i for i, row in enumerate(batch.rows) if row.sample and not row.inert]
        # Copies without the marker: the model may keep or change what it is given.
        prefixes = [
            [] if batch.rows[i].inert else self._prefixes[batch.rows[i].slot][1:] for i in called
        ]
        tokens = self.model.next_tokens(prefixes) if prefixes else []
        if len(tokens) != len(prefixes):
            raise ValueError(
                f"next_tokens returned {len(tokens)} tokens for {len(prefixes)} sequences"
            )
        result: list[int | None] = [None] * len(batch.rows)
        for index, token in zip(called, tokens, strict=True):
            row = batch.rows[index]
            if row.sample and not row.inert:  # an inert or non-sampling row's output is dropped
                result[index] = operator.index(token)
        return StepOutput.of_token_ids(result)

    def release(self, slot: int) -> None:
        self._prefixes[slot] = []

    def _extend(self, slot: int, position: int, token_ids: Sequence[int]) -> None:
        prefix = self._prefixes[slot]
        if position == 0:
            prefix.clear()
        elif position != len(prefix):
            raise ValueError(f"slot {slot}: row at position {position}, state has {len(prefix)}")
        prefix.extend(token_ids)


class TokenIdsOnly:
    """The ``Tokenizer`` of a model that speaks token ids, not text: no id decodes to bytes,
    so every output's text is empty and only its token ids matter."""

    vocab_size = sys.maxsize

    def encode(self, text: str) -> list[int]:
        """Raises ValueError: there is no text to token mapping."""
        raise ValueError("this model takes token ids, not text")

    def decode_bytes(self, token_ids: Sequence[int]) -> bytes:
        return b""


def _check(requests: Sequence[Request], num_slots: int) -> None:
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    seen: set[str] = set()
    for request in requests:
        if request.request_id in seen:
            raise ValueError(f"duplicate request_id {request.request_id!r}")
        seen.add(request.request_id)
        if request.max_tokens < 0:
            raise ValueError(
                f"request {request.request_id!r}: max_tokens must be >= 0, got {request.max_tokens}"
            )


def _generation_request(request: Request) -> GenerationRequest:
    return GenerationRequest(
        request_id=request.request_id,
        prompt_token_ids=(START_MARKER, *request.prompt),
        max_tokens=request.max_tokens,
        sampling=SamplingParams(temperature=0.0),  # the model picks its tokens itself
    )
