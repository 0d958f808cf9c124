"""Picking the next token of every sampling row of a step, reproducibly per request.

Each slot owns a ``torch.Generator`` and, while a sequence runs in it, a
:class:`~app.models.sampling.token_counts.SlotTokenCounts`; :meth:`Sampler.start_sequence` re-seeds
the
one and creates the other when a sequence starts in the slot (a row at position 0),
:meth:`Sampler.release` drops the state with the slot. A sampled row draws exactly one uniform
number ``u`` in [0, 1) from its own slot's generator, and every other operation is row-wise
and chosen by the row's own parameters and logits, so a seeded request gets the same tokens
whether it runs alone or in a crowd.

The pipeline, in API.md's order, all rows of the step at once:

1. rows that use a processor, or sample, are taken as float32, a copy where a processor writes
   (the model's logits stay raw, for the logprobs; a batch used whole is not indexed, which
   would copy it); then logit bias, penalties and min_tokens, each on the few entries it
   changes (:mod:`app.models.sampling.logits_processors`), and the constraint's mask
   (:mod:`app.models.sampling.token_mask`), each touching only the rows that use it;
2. greedy rows (temperature 0) take the argmax (:func:`argmax_rows`); when every row is greedy
   and unprocessed nothing else runs;
3. logits are divided by the temperature;
4. *unfiltered* rows (``top_k == 0`` and ``top_p >= 1``) pick by inverse CDF over the whole
   vocabulary in token-id order: the first token whose cumulative probability exceeds ``u``
   (min_p, when set, zeroes the tokens under ``min_p`` times the top probability first);
5. *filtered* rows look at their best ``CANDIDATES`` tokens (or ``top_k`` if larger), sorted
   descending with probabilities from the full softmax: top-k keeps the k best, top-p keeps
   the shortest prefix whose mass reaches p (the best token is always kept), min_p drops those
   under ``min_p`` times the best, and the token is the first whose cumulative kept
   probability exceeds ``u`` times the kept mass. When the candidates hold less than ``top_p``
   of the mass (a very flat distribution) the row is redone over the fully sorted vocabulary,
   so the cut is always exact.

Sorting the whole 49k vocabulary costs ~2.4 ms per row on the 2-core CPU; a top-256 costs
~0.15 ms, hence step 5. Steps 3-5 run in one C loop, without a sort, where the runner gives the
sampler one (:mod:`app.models.sampling.fused_draw`: the same kept tokens and distribution).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from app.models.base import SamplingParams, TokenLogprobs
from app.models.sampling.fused_draw import Draw
from app.models.sampling.logits_processors import (
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
)
from app.models.sampling.logprobs import token_logprobs
from app.models.sampling.token_counts import SlotTokenCounts
from app.models.sampling.token_mask import TokenMask, apply_token_masks

# Tokens examined per filtered row before falling back to a full sort.
CANDIDATES = 256
# Columns per block of the two-level argmax (see argmax_rows).
ARGMAX_BLOCK = 1024


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One row that wants a token: the slot whose generator to use, how to pick, and the
    constraint's allowed tokens (None: unconstrained; see :mod:`app.models.sampling.token_mask`)."""

    slot: int
    sampling: SamplingParams
    token_mask: TokenMask | None = None


@dataclass(frozen=True, slots=True)
class GreedyTokens:
    """What :meth:`Sampler.sample` would pick from logits whose every row is greedy and
    unprocessed (:meth:`Sampler.argmax_suffices`), computed by the LM head in their place:
    ``token_ids`` int64 ``[N]``, each logit row's argmax (``DecoderModel.forward(argmax=True)``)."""

    token_ids: torch.Tensor


class Sampler:
    """Owns one random generator per slot (CPU generators: draws are a handful of floats) and
    the sampling state of the sequence in each busy slot.

    Args:
        max_num_seqs: slots.
        vocab_size: logits columns (the penalties refuse ids outside it); 0: taken from the
            first logits seen (a sampler used without penalties).
        eos_token_ids: the ids ``min_tokens`` holds back besides the request's stop ids.
        argmax: the greedy rows' argmax over logits ``[R, vocab]`` (int64 ``[R]``, the first
            index of each row's maximum, as ``torch.argmax``); None: :func:`argmax_rows`. The
            runner passes the fused kernels' ``argmax_rows`` where they are built.
        draw: steps 3-5 in one C loop (:mod:`app.models.sampling.fused_draw`), or None for
            torch's ops; where it answers None, they decide.
    """

    def __init__(
        self,
        max_num_seqs: int,
        *,
        vocab_size: int = 0,
        eos_token_ids: frozenset[int] = frozenset(),
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
        draw: Draw | None = None,
    ) -> None:
        self._argmax = argmax_rows if argmax is None else argmax
        self._draw = draw
        self._generators = [torch.Generator(device="cpu") for _ in range(max_num_seqs)]
        self._states: list[SlotTokenCounts | None] = [None] * max_num_seqs
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids

    def start_sequence(
        self,
        slot: int,
        seed: int,
        sampling: SamplingParams | None = None,
    ) -> None:
        """Re-seed the slot's generator for the sequence that starts in it, and start its
        sampling state (``sampling``: the sequence's parameters; None: default sampling).

        Raises:
            ValueError: ``sampling`` uses a penalty and the sampler has no ``vocab_size``.
        """
        self._generators[slot].manual_seed(seed)
        self._states[slot] = SlotTokenCounts.start(
            sampling or SamplingParams(seed=seed),
            self._vocab_size,
            eos_token_ids=self._eos_token_ids,
        )

    def feed(self, slot: int, token_ids: Sequence[int]) -> None:
        """Tokens fed to the model for ``slot`` this step (the prompt's count for the
        repetition penalty)."""
        state = self._states[slot]
        if state is not None:
            state.feed(token_ids)

    def generated(self, slot: int) -> int:
        """Tokens drawn for the slot's sequence so far (0: still in its prompt)."""
        state = self._states[slot]
        return 0 if state is None else state.generated

    def release(self, slot: int) -> None:
        """Drop the slot's sampling state (its sequence ended)."""
        self._states[slot] = None

    def resume(self, slot: int, generated_token_ids: Sequence[int], *, draws: int) -> None:
        """The sequence starting in ``slot`` is one recomputed after a preemption: the tokens
        it had generated count as its own (``SlotTokenCounts.resume``), and its generator
        advances past ``draws`` draws, exactly as that many sampled rows would have, so a
        seeded sequence goes on with the draws it would have made."""
        state = self._states[slot]
        if state is not None:
            state.resume(generated_token_ids)
        if draws:
            torch.rand(draws, generator=self._generators[slot])

    def generator_state(self, slot: int) -> torch.Tensor:
        """The slot's generator state, to rewind to (:meth:`keep_draws`)."""
        return self._generators[slot].get_state()

    def keep_draws(
        self, slot: int, state: torch.Tensor, *, drawn: int, kept: int, random: bool
    ) -> None:
        """A speculative row drew ``drawn`` positions for ``slot`` starting from generator
        ``state`` and keeps the first ``kept``: a ``random`` (not greedy) row's generator is
        rewound and advanced by ``kept`` draws (one uniform each, as :meth:`_sample_random`
        draws them), and the slot's counts forget the rest, so the draws stay per position,
        not per step."""
        if random:
            generator = self._generators[slot]
            generator.set_state(state)
            for _ in range(kept):
                torch.rand(1, generator=generator)
        counts = self._states[slot]
        if counts is not None and drawn > kept:
            counts.undraw(drawn - kept)

    def argmax_suffices(self, requests: Sequence[SampleRequest]) -> bool:
        """Whether every request's token is the argmax of its raw logits, and nothing else of
        them is read: greedy, no logprobs, no processor or mask (then the LM head may give
        :class:`GreedyTokens` in place of the logits). False for no requests, and for a
        sampler without ``vocab_size``."""
        return (
            bool(requests)
            and self._vocab_size > 0
            and all(
                r.sampling.is_greedy
                and r.sampling.logprobs is None
                and not _is_processed(r, self._state(r, self._vocab_size))
                for r in requests
            )
        )

    def sample(
        self, logits: torch.Tensor | GreedyTokens, requests: Sequence[SampleRequest]
    ) -> list[int]:
        """Token ids for ``logits [R, vocab]``, one per request, in order; each drawn token
        is counted in its slot's state.

        ``logits`` may be bfloat16 (a bfloat16 model's LM head output): unprocessed greedy
        rows take the argmax as they are (a cast to float32 is exact, so it would not change
        it); rows that sample or use a processor are copied to float32 first. ``logits`` is
        never modified. :class:`GreedyTokens` (requests that ``argmax_suffices``) are the
        tokens themselves.
        """
        if isinstance(logits, GreedyTokens):
            drawn = logits.token_ids.tolist()
            for request, token in zip(requests, drawn, strict=True):
                self._state(request, self._vocab_size).drawn(token)
            return drawn
        states = [self._state(r, self._vocab_size or logits.shape[-1]) for r in requests]
        processed = [_is_processed(r, state) for r, state in zip(requests, states, strict=True)]
        raw_greedy = [
            i for i, r in enumerate(requests) if r.sampling.is_greedy and not processed[i]
        ]
        work_rows = [i for i, r in enumerate(requests) if not r.sampling.is_greedy or processed[i]]
        tokens = torch.empty(len(requests), dtype=torch.int64, device=logits.device)
        if raw_greedy:  # the argmax of the raw logits
            tokens[raw_greedy] = self._argmax(_rows(logits, raw_greedy))
        if work_rows:
            # a float32 copy where a processor writes into it (``logits`` stays raw)
            work = _float32_rows(logits, work_rows, copy=any(processed[i] for i in work_rows))
            work_states = [states[i] for i in work_rows]
            apply_logit_bias(work, work_states)
            apply_penalties(work, work_states)
            apply_min_tokens(work, work_states)
            masks = [requests[i].token_mask for i in work_rows]
            if any(mask is not None for mask in masks):
                apply_token_masks(work, masks)
            greedy = [k for k, i in enumerate(work_rows) if requests[i].sampling.is_greedy]
            if greedy:
                tokens[[work_rows[k] for k in greedy]] = self._argmax(_rows(work, greedy))
            random = [k for k, i in enumerate(work_rows) if not requests[i].sampling.is_greedy]
            if random:
                tokens[[work_rows[k] for k in random]] = self._sample_random(
                    _rows(work, random), [requests[work_rows[k]] for k in random]
                )
        drawn = tokens.tolist()
        for state, token in zip(states, drawn, strict=True):
            state.drawn(token)
        return drawn

    def logprobs(
        self, logits: torch.Tensor, requests: Sequence[SampleRequest], tokens: Sequence[int]
    ) -> tuple[TokenLogprobs | None, ...] | None:
        """Raw logprobs of each drawn token for the requests that asked (None for the
        others), or None when none did (:func:`app.models.sampling.logprobs.token_logprobs`)."""
        asked = [i for i, r in enumerate(requests) if r.sampling.logprobs is not None]
        if not asked:
            return None
        scored = token_logprobs(
            logits[asked],
            [tokens[i] for i in asked],
            [requests[i].sampling.logprobs or 0 for i in asked],
        )
        results: list[TokenLogprobs | None] = [None] * len(requests)
        for i, result in zip(asked, scored, strict=True):
            results[i] = result
        return tuple(results)

    def _state(self, request: SampleRequest, vocab_size: int) -> SlotTokenCounts:
        """The slot's state; a fresh one over ``vocab_size`` tokens when the slot holds none
        for these parameters (a caller driving the sampler alone, without
        :meth:`start_sequence`)."""
        state = self._states[request.slot]
        if state is None or (
            state.sampling is not request.sampling and state.sampling != request.sampling
        ):
            state = SlotTokenCounts.start(
                request.sampling,
                vocab_size,
                eos_token_ids=self._eos_token_ids,
            )
            self._states[request.slot] = state
        return state

    def _sample_random(
        self, logits: torch.Tensor, requests: Sequence[SampleRequest]
    ) -> torch.Tensor:
        device = logits.device
        params = [r.sampling for r in requests]
        temperature = torch.tensor([p.temperature for p in params], device=device)
        uniforms = torch.cat(
            [torch.rand(1, generator=self._generators[r.slot]) for r in requests]
        ).to(device)
        if self._draw is not None:  # every row in one C loop, where it takes them
            drawn = self._draw(
                logits,
                temperature,
                torch.tensor([p.top_k for p in params]),
                torch.tensor([p.top_p for p in params], dtype=torch.float32),
                torch.tensor([p.min_p for p in params], dtype=torch.float32),
                uniforms,
            )
            if drawn is not None:
                return drawn
        tokens = torch.empty(len(requests), dtype=torch.int64, device=device)
        unfiltered = [i for i, p in enumerate(params) if p.top_k == 0 and p.top_p >= 1.0]
        if unfiltered:
            min_p = [params[i].min_p for i in unfiltered]
            probs = (_rows(logits, unfiltered) / temperature[unfiltered, None]).softmax(dim=-1)
            if any(min_p):
                floor = torch.tensor(min_p, device=device)[:, None] * probs.amax(-1, True)
                probs = probs.masked_fill(probs < floor, 0.0)
            tokens[unfiltered] = _inverse_cdf(probs, uniforms[unfiltered])

        filtered = [i for i, p in enumerate(params) if not (p.top_k == 0 and p.top_p >= 1.0)]
        if filtered:
            scaled = _rows(logits, filtered) / temperature[filtered, None]
            largest_k = max(params[i].top_k for i in filtered)
            count = min(scaled.shape[-1], max(CANDIDATES, largest_k))
            picked, covered = _pick_filtered(
                scaled, [params[i] for i in filtered], uniforms[filtered], count
            )
            tokens[filtered] = picked
            redo = [k for k, ok in enumerate(covered.tolist()) if not ok]
            if redo:
                full, _ = _pick_filtered(
                    scaled[redo],
                    [params[filtered[k]] for k in redo],
                    uniforms[[filtered[k] for k in redo]],
                    scaled.shape[-1],
                )
                tokens[[filtered[k] for k in redo]] = full
        return tokens


def _is_processed(request: SampleRequest, state: SlotTokenCounts) -> bool:
    """Whether a row needs a float32 copy before the draw: a processor or a mask is on."""
    return request.token_mask is not None or state.processes


def _rows(tensor: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """``tensor[rows]`` (a copy), or ``tensor`` itself when ``rows`` (increasing, distinct) is
    every row: no copy of a whole batch that is used whole."""
    return tensor if len(rows) == tensor.shape[0] else tensor[list(rows)]


def _float32_rows(logits: torch.Tensor, rows: Sequence[int], *, copy: bool) -> torch.Tensor:
    """``logits[rows]`` as float32 ``[len(rows), vocab]``: always a new tensor when ``copy``
    (a processor will write into it), otherwise ``logits`` itself when it is float32 and
    ``rows`` is all of it."""
    if len(rows) < logits.shape[0]:
        return logits[list(rows)].float()  # the indexing made a copy already
    return logits.to(torch.float32, copy=copy)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (the first index of each row's maximum), ~7x faster on the CPU.

    torch's CPU argmax over the last dimension is a scalar loop (~2.4 ns per element: 15 ms for
    64 rows of a 49k vocabulary in bfloat16), while ``amax`` is vectorised. So: the maximum of
    each block of ``ARGMAX_BLOCK`` columns (vectorised), the first block holding the row's
    maximum, then the argmax inside that one block. Ties resolve as ``argmax`` does: the first
    block with the maximum, the first column in it.
    """
    rows, vocab = logits.shape
    if vocab % ARGMAX_BLOCK or logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    blocks = logits.view(rows, vocab // ARGMAX_BLOCK, ARGMAX_BLOCK)
    best_block = blocks.amax(dim=-1).argmax(dim=-1)
    inside = blocks[torch.arange(rows), best_block].argmax(dim=-1)
    return best_block * ARGMAX_BLOCK + inside


def _pick_filtered(
    scaled: torch.Tensor, params: Sequence[SamplingParams], uniforms: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k/top-p pick among each row's ``count`` best tokens.

    Returns the token ids ``[R]`` and ``covered [R]`` (bool): whether the cut was decided
    inside the candidates (always true for ``top_k > 0``, whose k best are all candidates).
    """
    device = scaled.device
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    values, ids = scaled.topk(count, dim=-1)
    probs = (values - scaled.logsumexp(dim=-1, keepdim=True)).exp()
    rank = torch.arange(count, device=device)[None, :]
    within_k = (top_k[:, None] == 0) | (rank < top_k[:, None])
    keep = within_k & (probs.cumsum(dim=-1) - probs < top_p[:, None])
    min_p = [p.min_p for p in params]
    if any(min_p):  # relative to the best token, which top-k and top-p always keep
        keep &= probs >= torch.tensor(min_p, device=device)[:, None] * probs[:, :1]
    keep[:, 0] = True
    covered = (top_k > 0) | (probs.sum(dim=-1) >= top_p)
    picks = _inverse_cdf(probs * keep, uniforms)
    return ids.gather(1, picks[:, None])[:, 0], covered


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index of the first column whose cumulative weight exceeds ``u`` times the row total."""
    cdf = weights.cumsum(dim=-1)
    targets = uniforms * cdf[:, -1]
    picks = torch.searchsorted(cdf, targets[:, None].contiguous(), right=True)[:, 0]
    return picks.clamp_(max=weights.shape[-1] - 1)
