"""The fixed batch shape (``ModelCapabilities.fixed_batch_shape``): the scheduler pads every step
to ``max_num_seqs`` rows with inert rows, whose slots are never touched and whose outputs reach
no request; models that do not need the shape treat inert rows as inert."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from app.engine.engine import AsyncEngine
from app.engine.metrics import EngineMetrics
from app.engine.policy import ContinuousBatching, StaticBatching
from app.engine.scheduler import Scheduler
from app.models.base import RowOutput, StepBatch, StepOutput, StepRow
from app.models.mock import MockModelRunner
from tests.engine.conftest import ScriptedModel, make_request, make_scheduler, make_sequence

POISON = ord("!")


def b(text: str) -> list[int]:
    return list(text.encode())


class FixedShapeScripted:
    """A fixed-shape model over ``ScriptedModel``: rejects a step that is not exactly one row
    per slot, answers every inert row with ``POISON`` (never reaching a request, or it would
    show in the text), and hands only the live rows to the scripted model, whose slot states
    assert that each row continues its slot."""

    def __init__(self, scripts: dict[bytes, list[int]], **kwargs) -> None:
        self.inner = ScriptedModel(scripts, **kwargs)
        self.tokenizer = self.inner.tokenizer
        self.capabilities = dataclasses.replace(self.inner.capabilities, fixed_batch_shape=True)
        self.steps: list[StepBatch] = []

    def step(self, batch: StepBatch) -> StepOutput:
        slots = sorted(row.slot for row in batch.rows)
        if slots != list(range(self.capabilities.max_num_seqs)):
            raise ValueError(f"expected one row per slot, got slots {slots}")
        for row in batch.rows:
            if row.inert:
                assert row.token_ids == () and not row.sample
        self.steps.append(batch)
        live = self.inner.step(batch.compacted())
        tokens = batch.expand(live).next_token_ids
        return StepOutput.of_token_ids(
            [POISON if row.inert else token for row, token in zip(batch.rows, tokens, strict=True)]
        )

    def release(self, slot: int) -> None:
        self.inner.release(slot)


def run(scheduler, model) -> None:
    steps = 0
    while scheduler.has_work:
        scheduler.admit_waiting()
        step = scheduler.schedule()
        scheduler.apply(step, model.step(step.batch))
        steps += 1
        assert steps < 1000


SCRIPTS = {b"a": b("xy"), b"b": b("hello"), b"c": b("q"), b"d": b("zzzz"), b"e": b("")}


@pytest.mark.parametrize("policy", [None, StaticBatching()])
def test_every_step_has_one_row_per_slot_and_padding_reaches_no_request(policy):
    model = FixedShapeScripted(SCRIPTS, max_num_seqs=3)
    scheduler = make_scheduler(model, policy=policy)
    sinks = {}
    for key in SCRIPTS:
        seq, sinks[key] = make_sequence(make_request(key.decode(), key))
        scheduler.add(seq)
    run(scheduler, model)
    for key, script in SCRIPTS.items():
        assert sinks[key].final.text == bytes(script).decode()
        assert POISON not in sinks[key].final.token_ids
    assert all(len(batch.rows) == 3 for batch in model.steps)
    assert any(row.inert for batch in model.steps for row in batch.rows)
    # live rows first, padding after: the scheduler's sequences line up with the live rows
    for batch in model.steps:
        flags = [row.inert for row in batch.rows]
        assert flags == sorted(flags)


def test_same_steps_and_tokens_as_without_padding():
    padded = FixedShapeScripted(SCRIPTS, max_num_seqs=2)
    plain = ScriptedModel(SCRIPTS, max_num_seqs=2)
    results = []
    for model in (padded, plain):
        scheduler = make_scheduler(model)
        sinks = []
        for key in SCRIPTS:
            seq, sink = make_sequence(make_request(key.decode(), key))
            scheduler.add(seq)
            sinks.append(sink)
        run(scheduler, model)
        results.append([sink.final.token_ids for sink in sinks])
    assert results[0] == results[1]
    assert [batch.compacted() for batch in padded.steps] == plain.steps


def test_a_busy_slot_left_out_by_the_token_budget_gets_an_inert_row_and_keeps_its_state():
    """Two long prompts, a budget that fits one chunk: the other prefilling sequence's slot is
    padded, so it must not move (the scripted model asserts every live row continues it)."""
    model = FixedShapeScripted(
        {b"L" * 12: b("u"), b"M" * 12: b("v")}, max_num_seqs=3, max_tokens_per_row=4
    )
    scheduler = make_scheduler(model, max_num_batched_tokens=4)
    first, first_sink = make_sequence(make_request("1", b"L" * 12))
    second, second_sink = make_sequence(make_request("2", b"M" * 12))
    scheduler.add(first)
    scheduler.add(second)
    scheduler.admit_waiting()
    step = scheduler.schedule()
    assert [row.slot for row in step.batch.rows if not row.inert] == [first.slot]
    assert sorted(row.slot for row in step.batch.rows if row.inert) == sorted(
        {0, 1, 2} - {first.slot}
    )
    scheduler.apply(step, model.step(step.batch))
    assert (first.num_computed_tokens, second.num_computed_tokens) == (4, 0)
    run(scheduler, model)
    assert (first_sink.final.text, second_sink.final.text) == ("u", "v")


def test_a_model_without_the_capability_gets_no_padding():
    model = ScriptedModel(SCRIPTS, max_num_seqs=4)
    scheduler = make_scheduler(model)
    seq, _ = make_sequence(make_request("1", "a"))
    scheduler.add(seq)
    run(scheduler, model)
    assert all(len(batch.rows) == 1 and not batch.has_inert_rows for batch in model.steps)


def test_batch_size_metric_counts_live_rows_only():
    model = FixedShapeScripted({b"a": b("xyz")}, max_num_seqs=4)
    metrics = EngineMetrics()
    scheduler = Scheduler(
        capabilities=model.capabilities,
        tokenizer=model.tokenizer,
        policy=ContinuousBatching(),
        metrics=metrics,
        release_slot=model.release,
        max_num_batched_tokens=64,
    )
    seq, _ = make_sequence(make_request("1", "a"))
    scheduler.add(seq)
    run(scheduler, model)
    assert len(model.steps) == 4  # x, y, z, EOS
    assert metrics.registry.get_sample_value("slotserve_batch_size_sum") == 4  # 1 row a step
    assert metrics.registry.get_sample_value("slotserve_batch_size_count") == 4


def test_a_failed_padded_step_fails_only_its_live_requests():
    model = FixedShapeScripted({b"a": b("xyz")}, max_num_seqs=3)
    scheduler = make_scheduler(model)
    seq, sink = make_sequence(make_request("1", "a"))
    scheduler.add(seq)
    scheduler.admit_waiting()
    step = scheduler.schedule()
    scheduler.fail(step, "boom")
    assert sink.final.error == "boom" and not scheduler.has_work


# --------------------------------------------------------------------------- inert rows seen
# by models that have no fixed shape


def padded(rows: list[StepRow], num_slots: int) -> StepBatch:
    used = {row.slot for row in rows}
    return StepBatch(
        (*rows, *(StepRow.padding(slot) for slot in range(num_slots) if slot not in used))
    )


def test_padding_row_is_inert_and_empty():
    row = StepRow.padding(5)
    assert (row.slot, row.token_ids, row.position, row.sample, row.inert) == (
        5,
        (),
        0,
        False,
        True,
    )
    assert StepBatch((row,)).num_tokens == 0


def test_expand_aligns_tokens_and_errors_with_the_inert_rows():
    live = StepRow(1, (3,), 0, True, StepRow.padding(0).sampling)
    batch = StepBatch((StepRow.padding(0), live, StepRow.padding(2)))
    assert batch.compacted() == StepBatch((live,))
    assert batch.expand(StepOutput.of_token_ids((9,))) == StepOutput.of_token_ids((None, 9, None))
    assert batch.expand(StepOutput((RowOutput(error="bad"),))) == StepOutput(
        (RowOutput(), RowOutput(error="bad"), RowOutput())
    )
    with pytest.raises(ValueError, match="2 results for 1 live rows"):
        batch.expand(StepOutput.of_token_ids((1, 2)))


def test_mock_runner_leaves_inert_slots_alone():
    runner = MockModelRunner(max_num_seqs=3)
    sampling = StepRow.padding(0).sampling
    # slot 1 holds a sequence that has no row in the padded step below
    runner.step(StepBatch((StepRow(1, tuple(b("held")), 0, True, sampling),)))
    calls = runner.num_model_calls
    rows = [StepRow(0, tuple(b("hi")), 0, True, sampling)]
    output = runner.step(padded(rows, 3))
    assert output.next_token_ids[0] is not None and output.next_token_ids[1:] == (None, None)
    assert runner.num_model_calls == calls + 1
    # slot 1 still holds its 4 tokens: continuing it at position 4 is accepted (a reset slot
    # would raise: "row at position 4, state has 0")
    runner.step(StepBatch((StepRow(1, (ord("!"),), 4, True, sampling),)))
    again = MockModelRunner(max_num_seqs=3)
    assert again.step(StepBatch(tuple(rows))).next_token_ids[0] == output.next_token_ids[0]


async def test_async_engine_serves_a_fixed_shape_model():
    model = FixedShapeScripted(SCRIPTS, max_num_seqs=2)
    engine = AsyncEngine(model)
    await engine.start()
    try:
        handles = [engine.submit(make_request(key.decode(), key)) for key in SCRIPTS]
        finals = [await handle.result() for handle in handles]
    finally:
        await engine.stop()
    assert [final.text for final in finals] == [bytes(s).decode() for s in SCRIPTS.values()]
    assert model.steps and all(len(batch.rows) == 2 for batch in model.steps)


def test_mock_runner_masks_a_constrained_row_with_its_own_prefix():
    """(found by a helper) a constrained row after a row that samples nothing read the prefix
    of another row, or past the list (an IndexError that failed every row of the step): its
    token is now the one it gets alone."""
    sampling = StepRow.padding(0).sampling
    words = torch.zeros(9, dtype=torch.int32)  # 257 tokens: the mock's vocabulary
    for token in b"xyz":  # never EOS, and none of them the mock's own next token here
        words[token // 32] |= 1 << (token % 32)
    constrained = StepRow(2, tuple(b("constrained")), 0, True, sampling, token_mask=words)
    alone = MockModelRunner(max_num_seqs=3).step(StepBatch((constrained,)))
    rows = (
        StepRow(0, tuple(b("plain")), 0, True, sampling),
        StepRow(1, tuple(b("a chunk that samples nothing")), 0, False, sampling),
        constrained,
    )
    together = MockModelRunner(max_num_seqs=3).step(StepBatch(rows))
    assert together.next_token_ids[2] == alone.next_token_ids[0]
    assert chr(alone.next_token_ids[0]) in "xyz"
