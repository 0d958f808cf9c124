"""The offline paths on the real model: the Python API over SmolLM2, and inert rows (the fixed
batch shape's padding) handed to the torch runner."""

from __future__ import annotations

from app.llm import LLM, SamplingOptions
from app.models.base import StepBatch, StepRow
from app.models.runner import ModelRunner
from tests.models.conftest import MAX_NUM_SEQS
from tests.models.stepping import GREEDY


def test_llm_generates_on_smollm2(runner: ModelRunner) -> None:
    llm = LLM(runner, max_num_seqs=MAX_NUM_SEQS)
    prompts = ["The capital of France is", "One, two, three,"]
    results = llm.generate(prompts, SamplingOptions(max_tokens=4, temperature=0))
    assert results[0].text.startswith(" Paris")
    for result in results:
        assert result.finish_reason == "length" and len(result.token_ids) == 4
        assert result.prompt_token_ids == tuple(runner.tokenizer.encode(result.prompt))
        assert runner.tokenizer.decode_bytes(result.token_ids).decode().startswith(result.text)
    assert all(runner.slot_length(slot) == 0 for slot in range(MAX_NUM_SEQS))  # all released


def test_torch_runner_leaves_inert_slots_alone(runner: ModelRunner) -> None:
    prompt = tuple(runner.tokenizer.encode("Once upon a time"))
    held = tuple(runner.tokenizer.encode("A slot that sits out this step"))
    runner.step(StepBatch((StepRow(0, prompt, 0, True, GREEDY), StepRow(1, held, 0, True, GREEDY))))
    rows = (StepRow(0, (42,), len(prompt), True, GREEDY),)
    padding = tuple(StepRow.padding(slot) for slot in range(1, MAX_NUM_SEQS))
    output = runner.step(StepBatch(rows + padding))
    assert isinstance(output.next_token_ids[0], int)
    assert output.next_token_ids[1:] == (None,) * (MAX_NUM_SEQS - 1)
    assert runner.slot_length(0) == len(prompt) + 1
    assert runner.slot_length(1) == len(held)  # padding at position 0 did not restart it
    assert all(runner.slot_length(slot) == 0 for slot in range(2, MAX_NUM_SEQS))
    runner.release(0)
    runner.release(1)
