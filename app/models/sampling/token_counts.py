"""Per-slot sampling state: what the penalties and ``min_tokens`` need to know of a sequence.

One :class:`SlotTokenCounts` per busy slot, created by the sampler when a sequence starts in the
slot (a row at position 0) and dropped when the slot is released. It counts the generated tokens
(each token the sampler draws, and those a preempted sequence had drawn) and, when a penalty is
on, keeps a :class:`SeenTokens`: the distinct ids of the prompt and the output with their
generated counts, the only tokens whose logits the penalties change. It also keeps the
request's constant arrays (logit-bias ids and values, the ids ``min_tokens`` holds back) so a
step only concatenates them.

Everything here is host memory (numpy), updated by Python scalars as tokens are fed and drawn;
:mod:`app.models.sampling.logits_processors` concatenates the rows' arrays once per step and moves
the
result to the logits' device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from app.models.base import SamplingParams

# Ids a SeenTokens holds before its first growth (it doubles when full).
_INITIAL_CAPACITY = 64


@dataclass(slots=True)
class SeenTokens:
    """The distinct token ids a sequence has seen (prompt or generated), in first-seen order,
    and how many times each was generated.

    Attributes:
        vocab_size: ids are in ``[0, vocab_size)``.
        size: distinct ids seen so far.

    :attr:`ids` and :attr:`generated_counts` are read-only views of the first ``size`` entries
    of buffers that grow by doubling; a view is valid until the next :meth:`see` or
    :meth:`generate`.
    """

    vocab_size: int
    size: int = field(default=0, init=False)
    _ids: np.ndarray = field(
        init=False, repr=False, default_factory=lambda: np.empty(_INITIAL_CAPACITY, np.int64)
    )
    _counts: np.ndarray = field(
        init=False, repr=False, default_factory=lambda: np.zeros(_INITIAL_CAPACITY, np.float32)
    )
    _positions: dict[int, int] = field(init=False, repr=False, default_factory=dict)

    @property
    def ids(self) -> np.ndarray:
        """``[size]`` int64: the distinct ids seen."""
        return self._ids[: self.size]

    @property
    def generated_counts(self) -> np.ndarray:
        """``[size]`` float32: occurrences of each of :attr:`ids` among the generated tokens
        (0 for one seen only in the prompt); exact below 2**24."""
        return self._counts[: self.size]

    def see(self, token_ids: Iterable[int]) -> None:
        """Prompt tokens: each becomes seen (its generated count is unchanged).

        Raises:
            ValueError: an id outside ``[0, vocab_size)``; the ids before it are kept.
        """
        for token_id in token_ids:
            self._position(token_id)

    def generate(self, token_id: int) -> None:
        """One generated occurrence of ``token_id``.

        Raises:
            ValueError: ``token_id`` is outside ``[0, vocab_size)``.
        """
        position = self._position(token_id)  # first: it may replace the buffers
        self._counts[position] += 1.0

    def _position(self, token_id: int) -> int:
        """Where ``token_id`` is in the buffers, appended (count 0) when new."""
        position = self._positions.get(token_id)
        if position is not None:
            return position
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(
                f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})"
            )
        if self.size == len(self._ids):
            self._grow()
        position = self.size
        self._ids[position] = token_id
        self._positions[token_id] = position
        self.size += 1
        return position

    def _grow(self) -> None:
        capacity = 2 * len(self._ids)
        ids = np.empty(capacity, np.int64)
        counts = np.zeros(capacity, np.float32)
        ids[: self.size] = self._ids[: self.size]
        counts[: self.size] = self._counts[: self.size]
        self._ids, self._counts = ids, counts


@dataclass(slots=True)
class SlotTokenCounts:
    """The sampling state of the sequence in one slot.

    Attributes:
        sampling: the sequence's parameters.
        generated: tokens generated so far (the ``min_tokens`` count), those sampled before a
            preemption included (:meth:`resume`).
        sampled_here: tokens the sampler drew in this slot; until the first, fed tokens are
            the prompt's.
        seen: the prompt's and the output's distinct ids with their generated counts; None
            unless a penalty is on.
        bias_ids / bias_values: ``[B]`` int64 / float32, the logit bias (None when empty).
        held_back_ids: ``[H]`` int64, the ids ``min_tokens`` masks (None when unused).
    """

    sampling: SamplingParams
    generated: int = 0
    sampled_here: int = 0
    seen: SeenTokens | None = None
    bias_ids: np.ndarray | None = None
    bias_values: np.ndarray | None = None
    held_back_ids: np.ndarray | None = None

    @classmethod
    def start(
        cls,
        sampling: SamplingParams,
        vocab_size: int,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> SlotTokenCounts:
        """The state of a sequence that starts now (nothing fed, nothing generated);
        ``min_tokens`` holds back ``eos_token_ids`` and the request's own ids.

        Raises:
            ValueError: a penalty is on and ``vocab_size`` is not positive.
        """
        state = cls(sampling)
        if sampling.uses_penalties:
            if vocab_size < 1:
                raise ValueError("the penalties need the vocabulary size")
            state.seen = SeenTokens(vocab_size)
        if sampling.logit_bias:
            ids, values = zip(*sampling.logit_bias, strict=True)
            state.bias_ids = np.array(ids, dtype=np.int64)
            state.bias_values = np.array(values, dtype=np.float32)
        held_back = eos_token_ids | set(sampling.min_tokens_token_ids)
        if sampling.min_tokens > 0 and held_back:
            state.held_back_ids = np.array(sorted(held_back), dtype=np.int64)
        return state

    @property
    def processes(self) -> bool:
        """Whether a step before the temperature changes this row's logits now."""
        return self.bias_ids is not None or self.seen is not None or self.holds_back

    @property
    def holds_back(self) -> bool:
        """Whether ``min_tokens`` still masks its ids at the next draw."""
        return self.held_back_ids is not None and self.generated < self.sampling.min_tokens

    def feed(self, token_ids: Iterable[int]) -> None:
        """Tokens fed to the model for this slot. Before the first draw they are the prompt's;
        after it a row carries the token drawn last step, already counted by :meth:`drawn`.

        Raises:
            ValueError: a prompt id outside the vocabulary (penalties on).
        """
        if self.sampled_here == 0 and self.seen is not None:
            self.seen.see(token_ids)

    def resume(self, generated_token_ids: Sequence[int]) -> None:
        """The sequence was preempted and is recomputed in this slot: the tokens it had
        generated count as generated (``min_tokens``, the presence/frequency counts)."""
        self.generated += len(generated_token_ids)
        if self.seen is not None:
            for token_id in generated_token_ids:
                self.seen.generate(token_id)

    def drawn(self, token_id: int) -> None:
        """The sampler drew ``token_id`` for this sequence."""
        self.generated += 1
        self.sampled_here += 1
        if self.seen is not None:
            self.seen.generate(token_id)

    def undraw(self, count: int) -> None:
        """Forget the last ``count`` draws: the positions of a speculative row after its first
        rejection, which the sequence never generated.

        Raises:
            ValueError: the state keeps the penalties' counts (such a row never drafts).
        """
        if self.seen is not None:
            raise ValueError("a row with penalties cannot verify a draft")
        self.generated -= count
        self.sampled_here -= count
