"""N-gram speculative decoding on SmolLM2 (issue 32): the same tokens with it on and off.

Greedy requests give the same tokens with speculation on and off, and a seeded sampled
request gives the same tokens alone without speculation as in a crowd with it: its verify
rows (several positions of one row) are computed as exactly as its decode rows (the seeded,
batch-invariant path), and its draws are per position. Each test checks that drafts were
accepted, so it can fail.
"""

from __future__ import annotations

import pytest

from app.config import ServerConfig
from app.llm import LLM, SamplingOptions
from app.models.base import StepBatch, StepOutput
from app.models.load.plan import LoadOptions, load_runner, plan_load
from app.models.runner import ModelRunner
from tests.models.conftest import MAX_NUM_SEQS

pytestmark = pytest.mark.slow

GROUNDED = [
    "Copy the list exactly. List: apples, pears, plums, figs, dates, limes, kiwis. "
    "Copy: apples, pears,",
    "def add(a, b):\n    return a + b\n\n# the same function again\ndef add(a, b):\n",
]
FREE = ["Once upon a time", "The weather today is"]


class CountingDrafts:
    """The runner, counting the drafted tokens its steps accepted."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.capabilities = runner.capabilities
        self.tokenizer = runner.tokenizer
        self.accepted = 0

    def step(self, batch: StepBatch) -> StepOutput:
        output = self.runner.step(batch)
        self.accepted += sum(row.num_accepted for row in output.rows)
        return output

    def release(self, slot: int) -> None:
        self.runner.release(slot)


def _generate(runner: ModelRunner, prompts, options, k: int) -> tuple[list, int]:
    return _generate_with(runner, prompts, options, k, slots=MAX_NUM_SEQS)


def _generate_with(runner: ModelRunner, prompts, options, k: int, *, slots: int):
    model = CountingDrafts(runner)
    llm = LLM(model, max_num_seqs=slots, speculative_ngram=k)
    results = llm.generate(prompts, options)
    assert all(runner.slot_length(slot) == 0 for slot in range(slots))
    return [r.token_ids for r in results], model.accepted


@pytest.mark.parametrize("runner_name", ["runner", "bf16_runner"])
def test_greedy_output_is_the_same_with_speculation_on_and_off(
    runner_name: str, request: pytest.FixtureRequest
) -> None:
    runner = request.getfixturevalue(runner_name)
    options = SamplingOptions(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = GROUNDED + FREE
    off, _ = _generate(runner, prompts, options, 0)
    on, accepted = _generate(runner, prompts, options, 4)
    assert on == off
    assert accepted > 0


def test_a_seeded_request_in_a_speculating_crowd_gets_its_tokens_alone(
    bf16_runner: ModelRunner,
) -> None:
    target = SamplingOptions(max_tokens=20, temperature=0.7, seed=11, ignore_eos=True)
    (alone,), _ = _generate(bf16_runner, GROUNDED[:1], [target], 0)
    crowd_options = [
        target,
        SamplingOptions(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingOptions(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True),
        SamplingOptions(max_tokens=9, temperature=0, ignore_eos=True),
    ]
    crowd, accepted = _generate(
        bf16_runner, [GROUNDED[0], GROUNDED[1], FREE[0], FREE[1]], crowd_options, 4
    )
    assert crowd[0] == alone
    assert accepted > 0


def test_the_served_default_with_speculation_gives_the_same_greedy_tokens() -> None:
    """The serve command's defaults (bfloat16, the GGUF file's own blocks, fused decode kernels
    and, on a CPU with native bfloat16 matmuls, dense copies for calls of more than a few
    rows): a grounded prompt's greedy tokens with ``--speculative-ngram 8`` are those without,
    alone and beside another request. A plain decode row computes on the blocks; a step that
    verifies drafts counts its rows without the drafted tokens (``ForwardPlan.drafted_tokens``).
    Failing input (issue 32): on the AMX Xeon this prompt's tokens parted at token 67 while
    the drafted rows took the copies."""
    prompt = (
        "Rewrite the text below with every sentence kept exactly, adding the heading Notes.\n"
        "Text: The committee met on Monday. It approved the budget for the new library. The "
        "budget covers books, shelves and two new reading rooms. Work starts in March.\n"
        "Notes:\nThe committee met on Monday. It approved the budget for the new library."
    )
    config = ServerConfig(max_num_seqs=2, max_model_len=512, speculative_ngram=8)
    options = LoadOptions.from_config(config)
    assert options.quantization == "auto" and options.dtype == "bfloat16"
    runner = load_runner(plan_load(config.model, options))
    greedy = SamplingOptions(max_tokens=96, temperature=0, ignore_eos=True)
    for prompts in ([prompt], [prompt, GROUNDED[1]]):
        off, _ = _generate_with(runner, prompts, greedy, 0, slots=2)
        on, accepted = _generate_with(runner, prompts, greedy, 8, slots=2)
        assert accepted > 0
        assert on == off


def test_a_long_context_verify_row_stays_on_the_decode_rows_path() -> None:
    """Failing input (found in review, issue 32): one request with a ~1,900-token prompt and
    ``--speculative-ngram 8``. A verify row of 9 positions past position ~1,800 attends to more
    keys than the fused step's budget for prompt chunks, so the whole step fell to the eager
    path (SDPA, the dense copies) while its decode rows ran fused: greedy tokens parted at
    token 13. A verify row no longer counts against that budget."""
    facts = " ".join(
        f"Item {i}: the {['red', 'blue', 'green', 'old', 'new'][i % 5]} box holds "
        f"{i * 7 % 13} stones."
        for i in range(400)
    )
    prompt = (
        "Inventory notes. " + " ".join(facts.split()[:1100]) + "\n\nRepeat after me three "
        "times: the quick brown fox jumps over the lazy dog. 1. the quick brown fox jumps over "
        "the lazy dog. 2."
    )
    config = ServerConfig(max_num_seqs=2, max_model_len=4096, speculative_ngram=8)
    runner = load_runner(plan_load(config.model, LoadOptions.from_config(config)))
    assert len(runner.tokenizer.encode(prompt)) > 1850
    greedy = SamplingOptions(max_tokens=40, temperature=0, ignore_eos=True)
    off, _ = _generate_with(runner, [prompt], greedy, 0, slots=2)
    on, accepted = _generate_with(runner, [prompt], greedy, 8, slots=2)
    assert accepted > 0
    assert on == off
