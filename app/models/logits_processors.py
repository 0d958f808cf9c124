"""The logits-processing steps before the temperature, over a step's rows at once (API.md's
order): logit bias -> penalties (presence, frequency, repetition) -> min_tokens.

Each function takes the float32 rows being sampled (``[R, vocab]``, modified in place) and the
per-row :class:`SlotTokenCounts`, touches only the rows that use it, and returns at once when
none does: a step whose rows use no processor pays a list scan. Every operation is elementwise
per row, so a row's result never depends on the other rows (batch invariance).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.models.token_counts import SlotTokenCounts


def apply_logit_bias(logits: torch.Tensor, states: Sequence[SlotTokenCounts]) -> None:
    """Adds each row's bias to its tokens' logits (OpenAI's ``logit_bias``)."""
    rows = [i for i, state in enumerate(states) if state.bias_ids is not None]
    if not rows:
        return
    device = logits.device
    ids = torch.cat([states[i].bias_ids for i in rows]).to(device)  # type: ignore[misc]
    values = torch.cat([states[i].bias_values for i in rows]).to(device)  # type: ignore[misc]
    row_index = torch.repeat_interleave(
        torch.tensor(rows, device=device),
        torch.tensor([states[i].bias_ids.numel() for i in rows], device=device),  # type: ignore[union-attr]
    )
    logits.index_put_((row_index, ids), values, accumulate=True)


def apply_penalties(logits: torch.Tensor, states: Sequence[SlotTokenCounts]) -> None:
    """Repetition, then frequency and presence penalties, for the rows that set any.

    Repetition (Hugging Face's ``RepetitionPenaltyLogitsProcessor``, from CTRL,
    https://arxiv.org/abs/1909.05858): a token of the prompt or the output has its logit divided
    by ``r`` when positive, multiplied by ``r`` otherwise. Frequency and presence (OpenAI's
    definition, https://platform.openai.com/docs/advanced-usage/parameter-details):
    ``logit - count * frequency_penalty - (count > 0) * presence_penalty``, counts over the
    generated tokens only.
    """
    rows = [i for i, state in enumerate(states) if state.counts is not None]
    if not rows:
        return
    device = logits.device
    counts = torch.stack([states[i].counts for i in rows]).to(device)  # type: ignore[misc]
    params = [states[i].sampling for i in rows]
    index = torch.tensor(rows, device=device)
    selected = logits[index]
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    if bool((repetition != 1.0).any()):
        in_prompt = torch.stack([states[i].in_prompt for i in rows]).to(device)  # type: ignore[misc]
        seen = in_prompt | (counts > 0)
        penalised = torch.where(selected > 0, selected / repetition, selected * repetition)
        selected = torch.where(seen, penalised, selected)
    if any(p.frequency_penalty for p in params):
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        selected = selected - counts * frequency
    if any(p.presence_penalty for p in params):
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        selected = selected - (counts > 0) * presence
    logits[index] = selected


def apply_min_tokens(logits: torch.Tensor, states: Sequence[SlotTokenCounts]) -> None:
    """Masks (``-inf``) the EOS and stop token ids of rows that have not yet generated
    ``min_tokens`` tokens."""
    rows = [i for i, state in enumerate(states) if state.holds_back]
    if not rows:
        return
    device = logits.device
    ids = torch.cat([states[i].held_back_ids for i in rows]).to(device)  # type: ignore[misc]
    row_index = torch.repeat_interleave(
        torch.tensor(rows, device=device),
        torch.tensor([states[i].held_back_ids.numel() for i in rows], device=device),  # type: ignore[union-attr]
    )
    logits[row_index, ids] = float("-inf")
