"""Picking the next token of every sampling row of a step, reproducibly per request.

Each slot owns a ``torch.Generator``; :meth:`Sampler.start_sequence` re-seeds it with the
request's seed when a sequence starts in the slot (a row at position 0). A sampled row draws
exactly one uniform number from its own slot's generator, and every other operation is
row-wise, so a seeded request gets the same tokens whether it runs alone or in a crowd (up to
the tiny float differences a batched matmul may introduce in its logits).

Per row (all rows of the step at once, vectorised):

1. greedy rows (temperature 0) take the argmax; when every row is greedy nothing else runs;
2. logits are divided by the temperature and sorted descending;
3. top-k keeps the k best (k = 0: all), top-p keeps the shortest prefix of the sorted
   distribution whose mass reaches p (the best token is always kept);
4. with ``u`` uniform in [0, 1) from the row's generator, the token is the first one whose
   cumulative kept probability exceeds ``u`` times the kept mass (inverse CDF).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app.models.base import SamplingParams


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One row that wants a token: the slot whose generator to use, and how to pick."""

    slot: int
    sampling: SamplingParams


class Sampler:
    """Owns one random generator per slot (CPU generators: draws are a handful of floats)."""

    def __init__(self, max_num_seqs: int) -> None:
        self._generators = [torch.Generator(device="cpu") for _ in range(max_num_seqs)]

    def start_sequence(self, slot: int, seed: int) -> None:
        """Re-seed the slot's generator for the sequence that starts in it."""
        self._generators[slot].manual_seed(seed)

    def sample(self, logits: torch.Tensor, requests: Sequence[SampleRequest]) -> list[int]:
        """Token ids for ``logits [R, vocab]`` (float32), one per request, in order."""
        greedy_tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling.is_greedy]
        if not random_rows:
            return greedy_tokens.tolist()
        tokens = greedy_tokens.clone()
        chosen = [requests[i] for i in random_rows]
        tokens[random_rows] = self._sample_random(logits[random_rows], chosen)
        return tokens.tolist()

    def _sample_random(self, logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
        device, vocab = logits.device, logits.shape[-1]
        temperature = torch.tensor([r.sampling.temperature for r in requests], device=device)
        top_p = torch.tensor([r.sampling.top_p for r in requests], device=device)
        top_k = torch.tensor(
            [r.sampling.top_k if r.sampling.top_k > 0 else vocab for r in requests], device=device
        )
        sorted_logits, sorted_ids = (logits / temperature[:, None]).sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        rank = torch.arange(vocab, device=device)[None, :]
        keep = (rank < top_k[:, None]) & (mass_before < top_p[:, None])
        keep[:, 0] = True
        cdf = (probs * keep).cumsum(dim=-1)
        uniforms = torch.cat(
            [torch.rand(1, generator=self._generators[r.slot]) for r in requests]
        ).to(device)
        targets = uniforms * cdf[:, -1]
        picks = torch.searchsorted(cdf, targets[:, None], right=True).clamp_(max=vocab - 1)
        return sorted_ids.gather(1, picks)[:, 0]
