"""ModelRunner through the Model protocol: validation, slot reuse, seeded sampling,
chunked prefill."""

from __future__ import annotations

import pytest

from app.models.base import Model, SamplingParams, StepBatch, StepRow
from app.models.runner import ModelRunner
from tests.models.conftest import MAX_MODEL_LEN, MAX_NUM_SEQS
from tests.models.stepping import GREEDY, generate_alone, generate_together

SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7)


def _fresh_runner(runner: ModelRunner) -> ModelRunner:
    """A new runner (new cache, new generators) sharing the loaded weights."""
    return ModelRunner(
        name="fresh",
        model=runner.model,
        tokenizer=runner.tokenizer,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
    )


def test_capabilities(runner: ModelRunner) -> None:
    caps = runner.capabilities
    assert isinstance(runner, Model)
    assert caps.name == "SmolLM2-135M-Instruct"
    assert caps.backend == "torch-cpu-float32"
    assert caps.context_length == MAX_MODEL_LEN
    assert caps.max_num_seqs == MAX_NUM_SEQS
    assert caps.vocab_size == 49152
    assert caps.eos_token_ids == frozenset({0, 2})
    assert caps.keeps_kv_cache
    assert 1 <= caps.max_tokens_per_row <= MAX_MODEL_LEN


def test_greedy_answer_is_sensible(runner: ModelRunner) -> None:
    prompt = runner.tokenizer.encode("The capital of France is")
    tokens = generate_alone(runner, 0, prompt, 4)
    assert runner.tokenizer.decode_bytes(tokens).startswith(b" Paris")


def test_reused_slot_never_reads_the_previous_sequence(runner: ModelRunner) -> None:
    tok = runner.tokenizer
    long_prompt = tok.encode("Once upon a time, in a kingdom far away, there lived a dragon " * 4)
    short_prompt = tok.encode("The capital of France is")
    other_prompt = tok.encode("Water boils at a temperature of one hundred degrees " * 3)
    generate_together(runner, {1: long_prompt}, 8)
    runner.release(1)

    # Slot 1 now holds stale keys past the short prompt; slot 2's longer row makes the step
    # read those positions (masked) for slot 1 too.
    reused = generate_together(runner, {1: short_prompt, 2: other_prompt}, 8)
    runner.release(1)
    runner.release(2)

    assert reused[1] == generate_alone(_fresh_runner(runner), 0, short_prompt, 8)


def test_seeded_sampling_is_the_same_alone_and_in_a_crowd(runner: ModelRunner) -> None:
    prompt = runner.tokenizer.encode("Write a short poem about the sea.")
    alone = generate_alone(runner, 3, prompt, 12, SEEDED)

    crowd_prompts = {
        0: runner.tokenizer.encode("List three colours:"),
        3: prompt,
        5: runner.tokenizer.encode("Tell me a joke about cats and dogs and birds."),
        6: runner.tokenizer.encode("1 2 3 4"),
    }
    crowd_sampling = {
        0: GREEDY,
        3: SEEDED,
        5: SamplingParams(temperature=1.0, top_k=40, seed=123),
        6: SamplingParams(temperature=0.8, top_p=0.9, seed=8),
    }
    crowd = generate_together(runner, crowd_prompts, 12, crowd_sampling)
    for slot in crowd_prompts:
        runner.release(slot)

    assert crowd[3] == alone
    again = generate_alone(runner, 4, prompt, 12, SEEDED)  # another slot, re-seeded at position 0
    assert again == alone
    other_seed = generate_alone(runner, 3, prompt, 12, SamplingParams(0.8, 0.9, 0, seed=8))
    assert other_seed != alone


def test_prompt_fed_in_chunks_gives_the_same_next_token(runner: ModelRunner) -> None:
    prompt = tuple(runner.tokenizer.encode("A long prompt that arrives in several pieces, " * 3))
    whole = runner.step(StepBatch((StepRow(0, prompt, 0, True, GREEDY),))).next_token_ids
    runner.release(0)
    cut = len(prompt) // 3
    first = runner.step(StepBatch((StepRow(0, prompt[:cut], 0, False, GREEDY),)))
    rest = runner.step(StepBatch((StepRow(0, prompt[cut:], cut, True, GREEDY),)))
    runner.release(0)
    assert first.next_token_ids == (None,)
    assert rest.next_token_ids == whole


@pytest.mark.parametrize(
    "row",
    [
        StepRow(MAX_NUM_SEQS, (5,), 0, True, GREEDY),  # slot out of range
        StepRow(0, (), 0, True, GREEDY),  # no tokens
        StepRow(0, (5,), 3, True, GREEDY),  # position is neither 0 nor the slot's length
        StepRow(0, (5,) * 4, MAX_MODEL_LEN - 3, True, GREEDY),  # past max_model_len
        StepRow(0, (49152,), 0, True, GREEDY),  # token outside the vocabulary
    ],
    ids=["slot", "empty", "position", "too-long", "vocab"],
)
def test_invalid_rows_raise_and_change_nothing(runner: ModelRunner, row: StepRow) -> None:
    runner.step(StepBatch((StepRow(0, (10, 11), 0, False, GREEDY),)))
    with pytest.raises(ValueError):
        runner.step(StepBatch((StepRow(1, (12,), 0, False, GREEDY), row)))
    assert runner.slot_length(0) == 2
    assert runner.slot_length(1) == 0
    runner.release(0)


def test_a_slot_twice_in_one_step_is_rejected(runner: ModelRunner) -> None:
    row = StepRow(0, (5,), 0, True, GREEDY)
    with pytest.raises(ValueError):
        runner.step(StepBatch((row, row)))
