"""The logits-processing steps before the temperature, over a step's rows at once (API.md's
order): logit bias -> penalties (presence, frequency, repetition) -> min_tokens.

Each function takes the float32 rows being sampled (``[R, vocab]``, contiguous, modified in
place) and the per-row :class:`SlotTokenCounts`, and returns at once when no row uses it: a
step whose rows use no processor pays a list scan. A processor changes only a few entries of a
row (the biased ids, the ids the row has seen, the held-back ids), so it works on those alone:
the rows' id arrays are concatenated (host memory, one ``numpy.concatenate``), offset by
``row * vocab`` into positions of the flattened logits, moved to the logits' device in one
copy, and the entries are read with one ``index_select``, changed elementwise and written back
with one ``index_copy_`` (``index_add_``, ``index_fill_``). The cost is the number of such
entries, not ``R * vocab``, and no operation runs per row. Every operation is elementwise over
entries that belong to one row each, so a row's result never depends on the other rows (batch
invariance); within a row the ids are distinct, so the writes never collide.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from app.models.sampling.token_counts import SeenTokens, SlotTokenCounts


def apply_logit_bias(logits: torch.Tensor, states: Sequence[SlotTokenCounts]) -> None:
    """Adds each row's bias to its tokens' logits (OpenAI's ``logit_bias``)."""
    rows, ids, values = [], [], []
    for row, state in enumerate(states):
        if state.bias_ids is not None and state.bias_values is not None:
            rows.append(row)
            ids.append(state.bias_ids)
            values.append(state.bias_values)
    if not rows:
        return
    biases = torch.from_numpy(np.concatenate(values)).to(logits.device)
    logits.view(-1).index_add_(0, _positions(rows, ids, logits), biases)


def apply_penalties(logits: torch.Tensor, states: Sequence[SlotTokenCounts]) -> None:
    """Repetition, then frequency and presence penalties, for the rows that set any, on the
    entries of the ids each row has seen (the others are unchanged by all three).

    Repetition (Hugging Face's ``RepetitionPenaltyLogitsProcessor``, from CTRL,
    https://arxiv.org/abs/1909.05858): a token of the prompt or the output has its logit divided
    by ``r`` when positive, multiplied by ``r`` otherwise. Frequency and presence (OpenAI's
    definition, https://platform.openai.com/docs/advanced-usage/parameter-details):
    ``logit - count * frequency_penalty - (count > 0) * presence_penalty``, counts over the
    generated tokens only. The operations, their order and their float32 operands are those
    of the same formulas over whole rows, so the results are bit-identical to them.
    """
    rows: list[int] = []
    seen: list[SeenTokens] = []
    for row, state in enumerate(states):
        if state.seen is not None:
            rows.append(row)
            seen.append(state.seen)
    if not rows:
        return
    lengths = np.array([s.size for s in seen], dtype=np.int64)
    positions = _positions(rows, [s.ids for s in seen], logits, lengths)
    params = [states[row].sampling for row in rows]
    device = logits.device
    flat = logits.view(-1)
    values = flat.index_select(0, positions)
    repetition = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in repetition):
        penalty = _per_entry(repetition, lengths, device)
        values = torch.where(values > 0, values / penalty, values * penalty)
    frequency = [p.frequency_penalty for p in params]
    presence = [p.presence_penalty for p in params]
    if any(frequency) or any(presence):
        counts = np.concatenate([s.generated_counts for s in seen])
        generated = torch.from_numpy(counts).to(device)
        if any(frequency):
            values = values - generated * _per_entry(frequency, lengths, device)
        if any(presence):
            values = values - (generated > 0) * _per_entry(presence, lengths, device)
    flat.index_copy_(0, positions, values)


def apply_min_tokens(logits: torch.Tensor, states: Sequence[SlotTokenCounts]) -> None:
    """Masks (``-inf``) the EOS and stop token ids of rows that have not yet generated
    ``min_tokens`` tokens."""
    rows, ids = [], []
    for row, state in enumerate(states):
        if state.holds_back and state.held_back_ids is not None:
            rows.append(row)
            ids.append(state.held_back_ids)
    if not rows:
        return
    logits.view(-1).index_fill_(0, _positions(rows, ids, logits), float("-inf"))


def _positions(
    rows: Sequence[int],
    ids: Sequence[np.ndarray],
    logits: torch.Tensor,
    lengths: np.ndarray | None = None,
) -> torch.Tensor:
    """``row * vocab + id`` for each id of each row (``ids[k]`` belongs to row ``rows[k]``):
    positions in ``logits.view(-1)``, ``[sum of lengths]`` int64 on the logits' device.
    ``lengths``: the arrays' lengths, when the caller has them."""
    if lengths is None:
        lengths = np.array([len(a) for a in ids], dtype=np.int64)
    starts = np.asarray(rows, dtype=np.int64) * logits.shape[-1]
    positions = np.repeat(starts, lengths) + np.concatenate(ids)
    return torch.from_numpy(positions).to(logits.device)


def _per_entry(values: Sequence[float], lengths: np.ndarray, device: torch.device) -> torch.Tensor:
    """One float32 value per row, repeated over the row's entries: ``[sum of lengths]``."""
    return torch.from_numpy(np.repeat(np.asarray(values, dtype=np.float32), lengths)).to(device)
