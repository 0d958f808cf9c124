"""Our forward against transformers loaded from the same GGUF, and bfloat16 against float32."""

from __future__ import annotations

import pytest
import torch

from app.models.base import StepBatch, StepRow
from app.models.forward.forward_plan import ForwardPlan, RowSpec
from app.models.forward.kv_cache import KVCache
from app.models.load.smollm2 import smollm2_gguf_path
from app.models.runner import ModelRunner
from tests.checkpoints import load_transformers_model
from tests.models.stepping import GREEDY, generate_alone

PROMPT = "The capital of France is"
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def hf_model():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    return load_transformers_model(smollm2_gguf_path())


def _last_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    model = runner.model
    cache = KVCache(
        model.hparams, max_num_seqs=1, max_model_len=64, dtype=model.dtype, device=model.device
    )
    plan = ForwardPlan.build([RowSpec(0, ids, 0, True)], cache=cache)
    with torch.inference_mode():
        return model.forward(plan, cache)[0]


@pytest.mark.slow
def test_greedy_tokens_and_logits_match_transformers(runner: ModelRunner, hf_model) -> None:
    ids = runner.tokenizer.encode(PROMPT)
    with torch.inference_mode():
        hf_logits = hf_model(torch.tensor([ids])).logits[0, -1]
        hf_tokens = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NUM_TOKENS,
            do_sample=False,
        )[0, len(ids) :].tolist()
    ours = generate_alone(runner, 0, ids, NUM_TOKENS)
    difference = (_last_logits(runner, ids) - hf_logits).abs().max().item()
    print(f"max |logit difference| vs transformers: {difference:.2e}")
    assert ours == hf_tokens
    assert difference < 1e-3


AGREEMENT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
)


def _greedy_agreement(reference: ModelRunner, candidate: ModelRunner) -> float:
    """Teacher-forced: at every position both models have seen the reference's tokens; the
    share of positions where the candidate's greedy token equals the reference's."""
    agreed = total = 0
    for text in AGREEMENT_PROMPTS:
        ids = reference.tokenizer.encode(text)
        expected = generate_alone(reference, 0, ids, NUM_TOKENS)
        row = StepRow(0, tuple(ids), 0, True, GREEDY)
        for position, want in enumerate(expected, start=len(ids)):
            got = candidate.step(StepBatch((row,))).next_token_ids[0]
            agreed, total = agreed + (got == want), total + 1
            row = StepRow(0, (want,), position, True, GREEDY)
        candidate.release(0)
    return agreed / total


@pytest.mark.slow
def test_bfloat16_mostly_agrees_with_float32(runner: ModelRunner, bf16_runner: ModelRunner) -> None:
    bf16 = bf16_runner
    assert bf16.capabilities.backend == "torch-cpu-bfloat16"
    rate = _greedy_agreement(runner, bf16)
    print(f"bfloat16 vs float32 greedy agreement (teacher-forced): {rate:.1%}")
    assert rate >= 0.75


@pytest.mark.slow
def test_int8_mostly_agrees_with_float32(runner: ModelRunner, int8_runner: ModelRunner) -> None:
    int8 = int8_runner
    assert int8.capabilities.backend == "torch-cpu-bfloat16-int8"
    chunk = int8.step(StepBatch((StepRow(0, (5, 6), 0, False, GREEDY),)))  # no logits wanted
    assert chunk.next_token_ids == (None,)
    int8.release(0)
    rate = _greedy_agreement(runner, int8)
    print(f"int8 vs float32 greedy agreement (teacher-forced): {rate:.1%}")
    assert rate >= 0.75
