"""The warm-up step (``ModelRunner.warm_up``, ``--warmup``) runs the largest step's shape and
leaves nothing a request could see: no slot state, no block of the pool but its own."""

from __future__ import annotations

import pytest
import torch

from app.config import ServerConfig
from app.models.forward.forward_plan import ForwardPlan, RowSpec
from app.models.forward.kv_cache import KV_BLOCK_SIZE
from app.models.runner import WARM_UP_BLOCK, ModelRunner
from tests.models.conftest import MAX_MODEL_LEN, MAX_NUM_SEQS
from tests.models.stepping import generate_alone

PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is" in SmolLM2's vocabulary


def _blocks(runner: ModelRunner, blocks: range) -> tuple[torch.Tensor, torch.Tensor]:
    rows = slice(blocks.start * KV_BLOCK_SIZE, blocks.stop * KV_BLOCK_SIZE)
    return runner.cache.keys[:, :, rows].clone(), runner.cache.values[:, :, rows].clone()


@pytest.mark.parametrize("fixture", ["runner", "bf16_runner"])
def test_warm_up_changes_nothing_a_request_sees(fixture: str, request: pytest.FixtureRequest):
    runner: ModelRunner = request.getfixturevalue(fixture)
    before = generate_alone(runner, 0, PROMPT, 6)
    others = range(WARM_UP_BLOCK + 1, runner.cache.num_blocks)
    untouched = _blocks(runner, others)

    warm = runner.warm_up(runner.capabilities.default_max_num_batched_tokens)

    # every slot but one decoding at the end of the (capped) context, beside a chunk filling
    # the rest of the step budget
    assert warm.decode_rows == MAX_NUM_SEQS - 1
    assert warm.chunk_tokens == runner.capabilities.max_tokens_per_row - (MAX_NUM_SEQS - 1)
    assert warm.context == MAX_MODEL_LEN and warm.seconds > 0
    assert all(runner.slot_length(slot) == 0 for slot in range(MAX_NUM_SEQS))
    for a, b in zip(untouched, _blocks(runner, others), strict=True):
        assert torch.equal(a, b)  # only WARM_UP_BLOCK was written
    # slot 0's fixed blocks start with WARM_UP_BLOCK: the request writes before it reads
    assert runner.cache.slot_blocks(0).start == WARM_UP_BLOCK
    assert generate_alone(runner, 0, PROMPT, 6) == before


def test_small_budgets_and_one_slot(runner: ModelRunner) -> None:
    warm = runner.warm_up(MAX_NUM_SEQS)  # a budget of one token a slot: decode rows only
    assert (warm.decode_rows, warm.chunk_tokens) == (MAX_NUM_SEQS - 1, 1)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        runner.warm_up(0)


def test_the_server_warms_up_unless_told_not_to() -> None:
    assert ServerConfig().warmup is True
    assert ServerConfig(warmup=False).warmup is False


def test_the_mixed_step_runs_one_layer_of_each_kind(runner: ModelRunner) -> None:
    """The warm-up's chunk step stops after the leading layers that cover every kind of layer
    (one for a Llama): a forward with ``num_layers`` writes K/V of those layers only, and the
    decode step after it reaches every layer."""
    assert runner._warm_up_layers() == 1
    cache = runner.cache
    rows = slice(WARM_UP_BLOCK * KV_BLOCK_SIZE, (WARM_UP_BLOCK + 1) * KV_BLOCK_SIZE)
    cache.keys[:, :, rows].zero_()
    spec = RowSpec(0, PROMPT, 0, True, False, [WARM_UP_BLOCK])
    with torch.inference_mode():
        runner.model.forward(ForwardPlan.build([spec], cache=cache), cache, num_layers=1)
    written = cache.keys[:, :, rows].flatten(1).abs().sum(dim=1) > 0  # per layer
    assert written.tolist() == [True] + [False] * (len(written) - 1)
    runner.warm_up(MAX_NUM_SEQS)
    assert bool((cache.keys[:, :, rows].flatten(1).abs().sum(dim=1) > 0).all())
