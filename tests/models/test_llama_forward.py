"""The batched forward: ragged single-token rows and prefill rows in one step equal each
sequence run alone (tokens equal, logits close)."""

from __future__ import annotations

import pytest
import torch

from app.models.forward.decoder import DecoderModel
from app.models.forward.forward_plan import ForwardPlan, RowSpec
from app.models.forward.kv_cache import KVCache
from app.models.runner import ModelRunner

DECODE_STEPS = 8
PROMPT_LENGTHS = (3, 11, 17, 29)


def _prompt(length: int, salt: int) -> list[int]:
    return [(101 + 37 * i + 1009 * salt) % 40000 + 50 for i in range(length)]


class Sequences:
    """Greedy decoding of several sequences on a private cache, recording logits per step."""

    def __init__(self, model: DecoderModel, max_num_seqs: int) -> None:
        self.model = model
        self.cache = KVCache(
            model.hparams,
            max_num_seqs=max_num_seqs,
            max_model_len=128,
            dtype=model.dtype,
            device=model.device,
        )
        self.tokens: dict[int, list[int]] = {}
        self.logits: dict[int, list[torch.Tensor]] = {}

    def run(self, rows: list[RowSpec]) -> None:
        plan = ForwardPlan.build(rows, cache=self.cache)
        with torch.inference_mode():
            logits = self.model.forward(plan, self.cache)
        for row, row_logits in zip(rows, logits, strict=True):
            self.logits.setdefault(row.slot, []).append(row_logits)
            self.tokens.setdefault(row.slot, []).append(int(row_logits.argmax()))

    def next_row(self, slot: int, prompt_length: int) -> RowSpec:
        generated = self.tokens[slot]
        return RowSpec(slot, [generated[-1]], prompt_length + len(generated) - 1, True)


def _alone(model: DecoderModel, prompts: dict[int, list[int]]) -> Sequences:
    sequences = Sequences(model, max_num_seqs=8)
    for slot, prompt in prompts.items():
        sequences.run([RowSpec(slot, prompt, 0, True)])
        for _ in range(DECODE_STEPS):
            sequences.run([sequences.next_row(slot, len(prompt))])
    return sequences


@pytest.mark.parametrize("slots", [(0, 1, 2, 3), (1, 3, 4, 7)], ids=["dense", "with-holes"])
def test_ragged_batch_equals_one_sequence_at_a_time(
    runner: ModelRunner, slots: tuple[int, ...]
) -> None:
    prompts = {slot: _prompt(n, slot) for slot, n in zip(slots, PROMPT_LENGTHS, strict=True)}
    expected = _alone(runner.model, prompts)

    together = Sequences(runner.model, max_num_seqs=8)
    *early, late = slots
    together.run([RowSpec(slot, prompts[slot], 0, True) for slot in early])
    # The last prompt joins one step later: its prefill row shares a step with decode rows.
    together.run(
        [together.next_row(slot, len(prompts[slot])) for slot in early]
        + [RowSpec(late, prompts[late], 0, True)]
    )
    while len(together.tokens[late]) <= DECODE_STEPS:
        together.run(
            [
                together.next_row(slot, len(prompts[slot]))
                for slot in slots
                if len(together.tokens[slot]) <= DECODE_STEPS
            ]
        )

    worst = 0.0
    for slot in slots:
        assert together.tokens[slot] == expected.tokens[slot], f"slot {slot}"
        for got, want in zip(together.logits[slot], expected.logits[slot], strict=True):
            worst = max(worst, (got - want).abs().max().item())
    print(f"max |logit difference| batched vs alone: {worst:.2e}")
    assert worst < 2e-3


def test_masked_positions_of_other_slots_are_never_read(runner: ModelRunner) -> None:
    """Poisoning everything outside a slot's valid positions changes nothing."""
    model = runner.model
    prompts = {0: _prompt(5, 0), 2: _prompt(9, 1)}
    clean = _alone(model, prompts)

    poisoned = Sequences(model, max_num_seqs=8)
    poisoned.cache.keys.fill_(1e4)
    poisoned.cache.values.fill_(1e4)
    poisoned.run([RowSpec(slot, prompt, 0, True) for slot, prompt in prompts.items()])
    for _ in range(DECODE_STEPS):
        poisoned.run([poisoned.next_row(slot, len(p)) for slot, p in prompts.items()])
    assert poisoned.tokens == clean.tokens
