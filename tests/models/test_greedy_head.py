"""A greedy step's LM head on GGUF blocks gives each row's argmax in place of its logits
(``DecoderModel.forward(argmax=True)``, ``GreedyTokens``): the runner asks for it when every
sampling row takes the argmax of its raw logits and nothing else reads them, and the tokens
are those the logits would give, decode rows and verify rows alike; a row that reads its
logits (logprobs, a processor, sampling) keeps the logits for the whole step."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from app.models import runner as runner_module
from app.models.base import SamplingParams, StepBatch, StepRow
from app.models.load.plan import load_checkpoint
from app.models.runner import ModelRunner
from app.models.sampling.sampler import Sampler, SampleRequest
from app.models.weights.ggml import GGMLLinear
from tests.models.stepping import GREEDY, generate_together

PROMPTS = {
    0: (1, 504, 3458, 282, 4649, 314),
    1: (1, 2023, 1016, 253, 2734),
    2: (1, 7051, 2967, 30, 2020, 5766, 28, 1464),
}


@pytest.fixture(scope="module")
def blocks_runner() -> ModelRunner:
    """SmolLM2 as the server loads it by default (bfloat16, its own blocks: a Q8_0 head)."""
    return load_checkpoint(
        "smollm2", max_num_seqs=4, max_model_len=128, dtype="bfloat16", quantization="auto"
    )


@pytest.fixture
def head_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The rows of every ``GGMLLinear.argmax`` call that gave tokens."""
    calls: list[int] = []
    argmax = GGMLLinear.argmax

    def counted(self: GGMLLinear, x, *, as_rows=None):  # type: ignore[no-untyped-def]
        tokens = argmax(self, x, as_rows=as_rows)
        if tokens is not None:
            calls.append(x.shape[0])
        return tokens

    monkeypatch.setattr(GGMLLinear, "argmax", counted)
    yield calls


def release(runner: ModelRunner) -> None:
    for slot in PROMPTS:
        runner.release(slot)


def test_greedy_steps_take_the_heads_argmax_and_give_the_logits_tokens(
    blocks_runner: ModelRunner, head_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert isinstance(blocks_runner.model.weights.lm_head, GGMLLinear)
    with_argmax = generate_together(blocks_runner, PROMPTS, 12)
    release(blocks_runner)
    assert head_calls == [3] * 12  # the prefill step's three rows, then every decode step
    monkeypatch.setattr(runner_module, "argmax_suffices", lambda sampler, rows: False)
    with_logits = generate_together(blocks_runner, PROMPTS, 12)
    release(blocks_runner)
    assert with_argmax == with_logits
    assert len(head_calls) == 12  # no call without the runner's asking


def test_a_row_that_reads_its_logits_keeps_them_for_the_step(
    blocks_runner: ModelRunner, head_calls: list[int]
) -> None:
    plain = generate_together(blocks_runner, PROMPTS, 6)
    release(blocks_runner)
    calls = len(head_calls)
    logprobs = SamplingParams(temperature=0.0, logprobs=2)
    mixed = generate_together(blocks_runner, PROMPTS, 6, {1: logprobs})
    release(blocks_runner)
    assert len(head_calls) == calls  # one row wanted logprobs: every step kept its logits
    assert mixed == plain


def test_verify_rows_accept_the_same_drafts_from_the_heads_argmax(
    blocks_runner: ModelRunner, head_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode row verifying a draft (the plain continuation, then a wrong token) accepts
    the same prefix and picks the same token either way."""
    prompt = PROMPTS[0]
    continuation = generate_together(blocks_runner, {0: prompt}, 5)[0]
    release(blocks_runner)
    draft = (*continuation[1:4], 7)

    def verify() -> tuple[int | None, int]:
        blocks_runner.step(StepBatch((StepRow(0, prompt, 0, True, GREEDY),)))
        row = StepRow(
            0, (continuation[0], *draft), len(prompt), True, GREEDY, num_draft_tokens=len(draft)
        )
        output = blocks_runner.step(StepBatch((row,))).rows[0]
        blocks_runner.release(0)
        return output.token_id, output.num_accepted

    calls = len(head_calls)
    assert verify() == (continuation[4], 3)
    assert head_calls[calls:] == [1, 5]  # the prompt's last position, then the verify row
    monkeypatch.setattr(runner_module, "argmax_suffices", lambda sampler, rows: False)
    assert verify() == (continuation[4], 3)


@pytest.mark.parametrize(
    ("sampling", "suffices"),
    [
        (SamplingParams(temperature=0.0), True),
        (SamplingParams(temperature=0.7, seed=1), False),
        (SamplingParams(temperature=0.0, logprobs=0), False),
        (SamplingParams(temperature=0.0, logit_bias=((5, 1.0),)), False),
        (SamplingParams(temperature=0.0, repetition_penalty=1.2), False),
        (SamplingParams(temperature=0.0, min_tokens=3), False),
    ],
)
def test_the_sampler_says_when_the_argmax_suffices(
    sampling: SamplingParams, suffices: bool
) -> None:
    sampler = Sampler(2, vocab_size=16, eos_token_ids=frozenset({2}))
    sampler.start_sequence(0, sampling.seed, sampling)
    greedy = SampleRequest(1, SamplingParams(temperature=0.0))
    assert sampler.argmax_suffices([greedy, SampleRequest(0, sampling)]) is suffices
    assert sampler.argmax_suffices([greedy])
    assert not sampler.argmax_suffices([])
    assert not Sampler(2).argmax_suffices([greedy])  # no vocabulary: no state to ask
