"""Drive a runner through whole sequences (prefill, then decode rows batched together)."""

from __future__ import annotations

from collections.abc import Sequence

from app.models.base import SamplingParams, StepBatch, StepRow
from app.models.smollm2 import LlamaModelRunner

GREEDY = SamplingParams(temperature=0.0)


def generate_together(
    runner: LlamaModelRunner,
    prompts: dict[int, Sequence[int]],
    num_tokens: int,
    sampling: dict[int, SamplingParams] | None = None,
) -> dict[int, list[int]]:
    """Prefill every ``slot -> prompt`` in one step, then decode all slots together.

    Returns ``num_tokens`` generated tokens per slot. Leaves the slots occupied.
    """
    sampling = sampling or {}
    rows = tuple(
        StepRow(slot, tuple(prompt), 0, True, sampling.get(slot, GREEDY))
        for slot, prompt in prompts.items()
    )
    generated = {slot: [] for slot in prompts}
    lengths = {slot: len(prompt) for slot, prompt in prompts.items()}
    for _ in range(num_tokens):
        output = runner.step(StepBatch(rows))
        for row, token in zip(rows, output.next_token_ids, strict=True):
            generated[row.slot].append(token)
        rows = tuple(
            StepRow(row.slot, (generated[row.slot][-1],), lengths[row.slot], True, row.sampling)
            for row in rows
        )
        for slot in lengths:
            lengths[slot] += 1
    return generated


def generate_alone(
    runner: LlamaModelRunner,
    slot: int,
    prompt: Sequence[int],
    num_tokens: int,
    sampling: SamplingParams = GREEDY,
) -> list[int]:
    """Generate for one sequence in ``slot``, then release the slot."""
    tokens = generate_together(runner, {slot: prompt}, num_tokens, {slot: sampling})[slot]
    runner.release(slot)
    return tokens
