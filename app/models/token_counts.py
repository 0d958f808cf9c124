"""Per-slot sampling state: what the penalties and ``min_tokens`` need to know of a sequence.

One :class:`SlotTokenCounts` per busy slot, created by the sampler when a sequence starts in the
slot (a row at position 0) and dropped when the slot is released. It counts the prompt's tokens
(fed to the model before the first sample) and the generated ones (each token the sampler
draws), and keeps the request's constant tensors (logit-bias ids and values, the ids
``min_tokens`` holds back) so a step only concatenates them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from app.models.base import SamplingParams


@dataclass(slots=True)
class SlotTokenCounts:
    """The sampling state of the sequence in one slot.

    Attributes:
        sampling: the sequence's parameters.
        generated: tokens generated so far (the ``min_tokens`` count), those sampled before a
            preemption included (:meth:`resume`).
        sampled_here: tokens the sampler drew in this slot; until the first, fed tokens are
            the prompt's.
        counts: ``[vocab]`` int32, occurrences of each token among the generated ones; only
            allocated when a penalty is on (None otherwise).
        in_prompt: ``[vocab]`` bool, tokens of the prompt (repetition penalty); None unless a
            penalty is on.
        bias_ids / bias_values: ``[B]`` int64 / float32, the logit bias (None when empty).
        held_back_ids: ``[H]`` int64, the ids ``min_tokens`` masks (None when unused).
    """

    sampling: SamplingParams
    generated: int = 0
    sampled_here: int = 0
    counts: torch.Tensor | None = None
    in_prompt: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    held_back_ids: torch.Tensor | None = None

    @classmethod
    def start(
        cls,
        sampling: SamplingParams,
        vocab_size: int,
        device: torch.device,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> SlotTokenCounts:
        """The state of a sequence that starts now (nothing fed, nothing generated);
        ``min_tokens`` holds back ``eos_token_ids`` and the request's own ids."""
        state = cls(sampling)
        if sampling.uses_penalties:
            state.counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
            state.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if sampling.logit_bias:
            ids, values = zip(*sampling.logit_bias, strict=True)
            state.bias_ids = torch.tensor(ids, dtype=torch.int64, device=device)
            state.bias_values = torch.tensor(values, dtype=torch.float32, device=device)
        held_back = eos_token_ids | set(sampling.min_tokens_token_ids)
        if sampling.min_tokens > 0 and held_back:
            state.held_back_ids = torch.tensor(sorted(held_back), dtype=torch.int64, device=device)
        return state

    @property
    def processes(self) -> bool:
        """Whether a step before the temperature changes this row's logits now."""
        return self.bias_ids is not None or self.counts is not None or self.holds_back

    @property
    def holds_back(self) -> bool:
        """Whether ``min_tokens`` still masks its ids at the next draw."""
        return self.held_back_ids is not None and self.generated < self.sampling.min_tokens

    def feed(self, token_ids: Iterable[int]) -> None:
        """Tokens fed to the model for this slot. Before the first draw they are the prompt's;
        after it a row carries the token drawn last step, already counted by :meth:`drawn`."""
        if self.sampled_here == 0 and self.in_prompt is not None:
            ids = torch.tensor(list(token_ids), dtype=torch.int64, device=self.in_prompt.device)
            self.in_prompt[ids] = True

    def resume(self, generated_token_ids: Sequence[int]) -> None:
        """The sequence was preempted and is recomputed in this slot: the tokens it had
        generated count as generated (``min_tokens``, the presence/frequency counts)."""
        self.generated += len(generated_token_ids)
        if self.counts is not None and generated_token_ids:
            ids = torch.tensor(list(generated_token_ids), dtype=torch.int64)
            self.counts += torch.bincount(ids, minlength=self.counts.numel()).to(
                device=self.counts.device, dtype=self.counts.dtype
            )

    def drawn(self, token_id: int) -> None:
        """The sampler drew ``token_id`` for this sequence."""
        self.generated += 1
        self.sampled_here += 1
        if self.counts is not None:
            self.counts[token_id] += 1
