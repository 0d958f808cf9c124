"""The eager decode attention's working set is bounded: decode rows are gathered from the KV
pool ``DECODE_KEY_BUDGET`` positions at a time, with the same results as one call."""

from __future__ import annotations

import pytest
import torch

import app.models.forward.attention as attention
from app.models.forward.attention import decode_row_chunks
from app.models.forward.forward_plan import ForwardPlan, RowSpec
from app.models.forward.kv_cache import KVCache
from app.models.runner import ModelRunner


@pytest.mark.parametrize(
    ("count", "key_length", "budget"),
    [(64, 704, 16384), (64, 2048, 16384), (1, 4096, 1024), (5, 16, 16384), (7, 32, 64)],
)
def test_row_chunks_cover_every_row_once_within_the_budget(
    count: int, key_length: int, budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention, "DECODE_KEY_BUDGET", budget)
    chunks = decode_row_chunks(count, key_length)
    assert [row for start, stop in chunks for row in range(start, stop)] == list(range(count))
    for start, stop in chunks:
        assert stop > start
        assert (stop - start) * key_length <= budget or stop - start == 1


def _decode_plan(runner: ModelRunner, cache: KVCache) -> ForwardPlan:
    """Six slots prefilled with prompts of different lengths, then one decode row each."""
    model = runner.model
    prompts = {
        slot: list(range(100 + 40 * slot, 100 + 40 * slot + 9 + 7 * slot)) for slot in range(6)
    }
    with torch.inference_mode():
        plan = ForwardPlan.build([RowSpec(s, p, 0, True) for s, p in prompts.items()], cache=cache)
        first = model.forward(plan, cache).argmax(dim=-1).tolist()
    rows = [
        RowSpec(slot, [token], len(prompts[slot]), True)
        for slot, token in zip(prompts, first, strict=True)
    ]
    return ForwardPlan.build(rows, cache=cache)


def test_chunked_decode_attention_equals_one_call_and_gathers_within_the_budget(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = runner.model
    cache = KVCache(
        model.hparams, max_num_seqs=6, max_model_len=128, dtype=model.dtype, device=model.device
    )
    plan = _decode_plan(runner, cache)
    assert plan.decode is not None and plan.decode.count == 6
    key_length = plan.decode.key_length
    gathered: list[int] = []
    gather = cache.gather

    def recording_gather(layer: int, positions: torch.Tensor, rows: int):
        gathered.append(positions.numel())
        return gather(layer, positions, rows)

    monkeypatch.setattr(cache, "gather", recording_gather)
    with torch.inference_mode():
        monkeypatch.setattr(attention, "DECODE_KEY_BUDGET", 6 * key_length)
        whole = model.forward(plan, cache)
        assert set(gathered) == {6 * key_length}  # one call per layer
        gathered.clear()
        monkeypatch.setattr(attention, "DECODE_KEY_BUDGET", 2 * key_length)
        chunked = model.forward(plan, cache)
    assert gathered and max(gathered) <= 2 * key_length
    assert len(gathered) == 3 * model.hparams.block_count
    assert torch.equal(whole, chunked)
