"""Verifying a speculative row's draft: one sample per position, the longest agreeing prefix.

A row with ``num_draft_tokens = k`` (:class:`app.models.base.StepRow`) has logits at its last
``k + 1`` positions. Each position is sampled exactly as an ordinary row would be (the same
pipeline, one uniform from the slot's own generator, in position order), and the draft's
token ``d_i`` is accepted while the sample at position ``i`` equals it; the first sample that
differs, or the sample after a wholly accepted draft, is the model's own next token.

Why this is exact. The proposal of an n-gram draft is deterministic (``q(d) = 1``), and
speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", https://arxiv.org/abs/2211.17192; Chen et al. 2023, "Accelerating Large
Language Model Decoding with Speculative Sampling", https://arxiv.org/abs/2302.01318) then
accepts ``d`` with probability ``min(1, p(d) / q(d)) = p(d)`` and on rejection samples from
``max(0, p - q)`` renormalised: ``p`` with ``d``'s mass removed. Drawing ``t ~ p`` and
accepting when ``t == d`` realises exactly that: ``P(accept) = p(d)``, and given ``t != d``,
``t`` follows ``p`` without ``d``, renormalised. Every emitted token is therefore the token
plain sampling would draw with the same uniform, so a seeded request gets the same tokens with
speculation on or off, and greedy rows (the argmax) the same as without it. The draws of the
rejected positions are taken back (:meth:`Sampler.keep_draws`): a sequence's ``i``-th token
always uses its generator's ``i``-th uniform, whatever the steps were.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app.models.base import StepRow, TokenLogprobs
from app.models.sampling.sampler import GreedyTokens, Sampler, SampleRequest


@dataclass(frozen=True, slots=True)
class RowSample:
    """What one sampling row produced.

    Attributes:
        token: the model's own next token (after the accepted draft, if any).
        num_accepted: drafted tokens accepted (0 for an ordinary row).
        logprobs: the last token's logprobs, when the row asked for them.
        draft_logprobs: the accepted drafted tokens' logprobs, when asked.
    """

    token: int
    num_accepted: int = 0
    logprobs: TokenLogprobs | None = None
    draft_logprobs: tuple[TokenLogprobs, ...] | None = None


def accepted_length(draft: Sequence[int], samples: Sequence[int]) -> int:
    """How many leading drafted tokens agree with the samples at their positions
    (``samples[i]`` is the token sampled where ``draft[i]`` was proposed)."""
    count = 0
    for drafted, sampled in zip(draft, samples, strict=False):
        if drafted != sampled:
            break
        count += 1
    return count


def argmax_suffices(sampler: Sampler, rows: Sequence[StepRow]) -> bool:
    """Whether each position of every sampling row (a verify row's too) takes the argmax of its
    raw logits and nothing else reads them (``Sampler.argmax_suffices``): the model may then
    give :class:`~app.models.sampling.sampler.GreedyTokens` for :func:`sample_rows`."""
    requests = [SampleRequest(r.slot, r.sampling, r.token_mask) for r in rows if r.sample]
    return sampler.argmax_suffices(requests)


def sample_rows(
    sampler: Sampler, logits: torch.Tensor | GreedyTokens, rows: Sequence[StepRow]
) -> list[RowSample | None]:
    """One :class:`RowSample` per row of ``rows`` (None for a row with ``sample`` False).

    Args:
        sampler: the model's sampler (its per-slot generators and counts advance).
        logits: ``[sum over sampling rows of (num_draft_tokens + 1), vocab]``, in row order,
            each row's positions in order; or their argmax (rows that ``argmax_suffices``).
        rows: the step's rows.

    Raises:
        ValueError: a drafting row does not sample or carries a constraint mask (a
            constrained row never drafts: its mask is for the first position only).
    """
    requests: list[SampleRequest] = []
    marks: dict[int, torch.Tensor] = {}
    for row in rows:
        if not row.sample:
            if row.num_draft_tokens:
                raise ValueError(f"slot {row.slot}: a drafting row must sample")
            continue
        if row.num_draft_tokens:
            if row.token_mask is not None:
                raise ValueError(f"slot {row.slot}: a constrained row cannot verify a draft")
            marks[row.slot] = sampler.generator_state(row.slot)
        request = SampleRequest(row.slot, row.sampling, row.token_mask)
        requests.extend([request] * (row.num_draft_tokens + 1))
    sampled = sampler.sample(logits, requests)
    greedy = isinstance(logits, GreedyTokens)  # nobody asked for logprobs
    logprobs = None if greedy else sampler.logprobs(logits, requests, sampled)
    results: list[RowSample | None] = []
    start = 0
    for row in rows:
        if not row.sample:
            results.append(None)
            continue
        positions = row.num_draft_tokens + 1
        samples = sampled[start : start + positions]
        accepted = accepted_length(row.draft_token_ids, samples)
        if row.num_draft_tokens:
            sampler.keep_draws(
                row.slot,
                marks[row.slot],
                drawn=positions,
                kept=accepted + 1,
                random=not row.sampling.is_greedy,
            )
        row_logprobs = logprobs[start : start + accepted + 1] if logprobs else None
        results.append(
            RowSample(
                token=samples[accepted],
                num_accepted=accepted,
                logprobs=row_logprobs[-1] if row_logprobs else None,
                draft_logprobs=(
                    tuple(e for e in row_logprobs[:-1] if e is not None)
                    if row_logprobs and row.num_draft_tokens
                    else None
                ),
            )
        )
        start += positions
    return results
