"""Steps built ahead: step N+1 scheduled while step N runs, its decode rows' tokens filled in on
the model thread (``Scheduler.schedule_ahead``, ``app.engine.lookahead``).

The outputs must be exactly those of the loop that schedules after applying each step: the
paged mock checks every row's position against its slot and every block table against the
positions it covers, and raises on any mismatch; its tokens depend on the whole prefix.
"""

from __future__ import annotations

import asyncio

from app.engine.engine import AsyncEngine
from app.engine.lookahead import PENDING_TOKEN, TimedStepCall, ending_tokens, filled_batch
from app.engine.request import FinishReason, GenerationRequest, StopCriteria
from app.engine.step_rows import ScheduledStep
from app.models.base import (
    ModelCapabilities,
    RowOutput,
    SamplingParams,
    StepBatch,
    StepOutput,
    StepRow,
)
from app.models.mock import MockModelRunner
from tests.engine.conftest import (
    EOS,
    Collected,
    ScriptedModel,
    make_request,
    make_scheduler,
    make_sequence,
    run_until_idle,
)


def workload() -> list[GenerationRequest]:
    """Requests of several lengths, some ending on EOS, some on a stop string, some on
    ``max_tokens``; more than the slots, so slots are refilled throughout."""
    requests = []
    for index in range(48):
        stop = ["q"] if index % 5 == 0 else []
        prompt = f"request {index}: " + "xyz" * (index % 4)
        requests.append(make_request(f"r{index}", prompt, max_tokens=3 + index % 37, stop=stop))
    return requests


def paged_mock() -> MockModelRunner:
    # a pool that cannot hold every slot's longest sequence: admissions wait for blocks
    return MockModelRunner(max_num_seqs=6, context_length=128, kv_blocks=12, eos_one_in=12)


def run_without_ahead(requests: list[GenerationRequest]) -> dict[str, tuple]:
    model = paged_mock()
    scheduler = make_scheduler(model)
    sinks = add_all(scheduler, requests)
    run_until_idle(scheduler, model)
    return outcomes(sinks)


def run_ahead_in_order(requests: list[GenerationRequest]) -> tuple[dict[str, tuple], int, int]:
    """The async engine's order on one thread: step N+1 scheduled before step N's output is
    applied, and a slot's release made after the next model call (the model thread runs it
    behind the step built ahead). Returns the outcomes, the steps built ahead, all steps."""
    model = paged_mock()
    released: list[int] = []
    in_flight = False  # a step built ahead is "queued on the model thread"

    def release_slot(slot: int) -> None:  # the engine's hook: behind the step in flight
        (released.append if in_flight else model.release)(slot)

    scheduler = make_scheduler(model)
    scheduler._release_slot = release_slot
    call = TimedStepCall(model, keeps_tokens=True)
    sinks = add_all(scheduler, requests)
    step, built_ahead, calls = None, 0, 0
    while scheduler.has_work or step is not None:
        if step is None:
            scheduler.admit_waiting()
            step = scheduler.schedule()
            if step is None:
                break
        output, _ = call(step)
        calls += 1
        for slot in released:
            model.release(slot)
        released.clear()
        ahead = scheduler.schedule_ahead(step)
        built_ahead += ahead is not None
        in_flight = ahead is not None
        scheduler.apply(step, output)
        step = ahead
        assert calls < 10_000
    for slot in released:
        model.release(slot)
    return outcomes(sinks), built_ahead, calls


def add_all(scheduler, requests: list[GenerationRequest]) -> dict[str, Collected]:
    sinks = {}
    for request in requests:
        seq, sink = make_sequence(request)
        scheduler.add(seq)
        sinks[request.request_id] = sink
    return sinks


def outcomes(sinks: dict[str, Collected]) -> dict[str, tuple]:
    return {
        rid: (sink.final.finish_reason, sink.final.token_ids, sink.streamed_ids)
        for rid, sink in sinks.items()
    }


def test_steps_built_ahead_give_the_outputs_of_steps_built_after() -> None:
    requests = workload()
    expected = run_without_ahead(requests)
    got, built_ahead, calls = run_ahead_in_order(requests)
    assert got == expected
    reasons = {reason for reason, _, _ in expected.values()}
    assert {FinishReason.STOP, FinishReason.LENGTH} <= reasons
    assert not any(reason is FinishReason.ERROR for reason in reasons)
    assert built_ahead > calls // 2  # the overlap is the common case, not the exception


async def test_the_engine_with_steps_built_ahead_gives_the_same_outputs() -> None:
    requests = workload()
    expected = run_without_ahead(requests)
    for schedule_ahead in (True, False):
        engine = AsyncEngine(paged_mock(), schedule_ahead=schedule_ahead)
        await engine.start()
        try:
            handles = [engine.submit(request) for request in requests]
            finals = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 30)
        finally:
            await engine.stop()
        got = {
            r.request_id: (f.finish_reason, f.token_ids)
            for r, f in zip(requests, finals, strict=True)
        }
        assert got == {rid: outcome[:2] for rid, outcome in expected.items()}, schedule_ahead


def scripted_scheduler(**kwargs):
    model = ScriptedModel({b"a": [1, 2, 3, 4], b"b": [5, 6]}, **kwargs)
    return model, make_scheduler(model)


def start(scheduler, *requests: GenerationRequest):
    for request in requests:
        scheduler.add(make_sequence(request)[0])
    scheduler.admit_waiting()
    return scheduler.schedule()


def test_a_step_built_ahead_continues_each_row_and_fills_a_free_slot() -> None:
    model, scheduler = scripted_scheduler(max_num_seqs=3)
    first = start(scheduler, make_request("a", "a", max_tokens=4), make_request("b", "b"))
    late = make_sequence(make_request("late", "b", max_tokens=1))[0]
    scheduler.add(late)  # waits: a slot is free, so the step built ahead admits it
    ahead = scheduler.schedule_ahead(first)
    assert ahead is not None and ahead.pending == (frozenset({EOS}),) * 2
    rows = [(row.slot, row.token_ids, row.position) for row in ahead.batch.rows]
    assert rows == [(0, (PENDING_TOKEN,), 1), (1, (PENDING_TOKEN,), 1), (2, tuple(b"b"), 0)]
    assert ahead.sequences[2] is late
    output = model.step(first.batch)
    filled = filled_batch(ahead.batch, ahead.pending, {0: 1, 1: 5})
    assert [row.token_ids for row in filled.rows] == [(1,), (5,), tuple(b"b")]
    scheduler.apply(first, output)
    scheduler.apply(ahead, model.step(filled))
    assert [seq.generated for seq in ahead.sequences] == [[1, 2], [5, 6], [5]]


def test_a_sequence_its_step_ends_for_certain_gets_no_row_ahead() -> None:
    _, scheduler = scripted_scheduler()
    first = start(scheduler, make_request("one", "a", max_tokens=1), make_request("b", "b"))
    ahead = scheduler.schedule_ahead(first)
    assert ahead is not None
    assert [seq.request_id for seq in ahead.sequences] == ["b"]  # "one" has its 1 token


def test_no_step_is_built_ahead_of_a_prompt_chunk_that_leaves_the_prompt_unfinished() -> None:
    _, scheduler = scripted_scheduler(max_tokens_per_row=2)
    first = start(scheduler, make_request("long", "abcdef"))
    assert not first.batch.rows[0].sample
    assert scheduler.schedule_ahead(first) is None


def test_no_step_is_built_ahead_while_a_running_sequence_has_no_row() -> None:
    model = ScriptedModel({}, max_num_seqs=2)
    scheduler = make_scheduler(model, max_num_batched_tokens=4)
    first = start(scheduler, make_request("x", "xyz"), make_request("y", "long prompt"))
    assert len(first.sequences) == 2 and not first.batch.rows[1].sample  # a cut chunk
    assert scheduler.schedule_ahead(first) is None


def test_a_row_whose_previous_token_is_missing_becomes_inert() -> None:
    sampling = SamplingParams()
    batch = StepBatch(
        (StepRow(0, (PENDING_TOKEN,), 5, True, sampling), StepRow(1, (7,), 0, True, sampling))
    )
    filled = filled_batch(batch, (frozenset(),), {})  # the previous step raised: no token
    assert filled.rows[0].inert and filled.rows[1] == batch.rows[1]
    ended = filled_batch(batch, (frozenset({9}),), {0: 9})  # its sequence's EOS: it ended
    assert ended.rows[0].inert
    assert filled_batch(batch, (frozenset({9}),), {0: 4}).rows[0].token_ids == (4,)


def test_the_tokens_that_end_a_row_ahead_are_its_stop_ids_and_eos_unless_ignored() -> None:
    eos = frozenset({2})
    assert ending_tokens(StopCriteria(), eos) is eos
    assert ending_tokens(StopCriteria(stop_token_ids=frozenset({5})), eos) == {2, 5}
    assert ending_tokens(StopCriteria(stop_token_ids=frozenset({5}), ignore_eos=True), eos) == {5}


async def test_a_finish_by_eos_costs_no_model_call_and_the_next_request_its_slot_at_once() -> None:
    """Found: with steps built ahead, a request ending on EOS left its row in the step built
    ahead, which the model thread ran as a whole step (the only row of a one-slot engine):
    one wasted model call per request, and the next request's first token one step later."""
    counts = {}
    for schedule_ahead in (False, True):
        model = ScriptedModel({b"a": [1, 2, 3], b"b": [4, 5]}, max_num_seqs=1)
        engine = AsyncEngine(model, schedule_ahead=schedule_ahead)
        await engine.start()
        try:
            for prompt in ("a", "b", "a"):  # each ends on EOS, one after another
                request = make_request(f"{prompt}{len(model.steps)}", prompt, max_tokens=10)
                final = await asyncio.wait_for(engine.submit(request).result(), 10)
                assert final.finish_reason is FinishReason.STOP
        finally:
            await engine.stop()
        counts[schedule_ahead] = len(model.steps)
        finished_rows = [
            row
            for step in model.steps
            for row in step.rows
            if row.token_ids == (EOS,) or row.inert  # a row fed the EOS: after the end
        ]
        assert finished_rows == [], schedule_ahead
    assert counts[True] == counts[False]


class _CountingModel:
    capabilities = ModelCapabilities(
        name="counting",
        backend="test",
        context_length=64,
        max_num_seqs=2,
        vocab_size=8,
        eos_token_ids=frozenset({7}),
        keeps_kv_cache=True,
        max_tokens_per_row=64,
    )

    def __init__(self) -> None:
        self.calls = 0

    def step(self, batch: StepBatch) -> StepOutput:
        self.calls += 1
        return StepOutput(tuple(RowOutput(3) for _ in batch.rows))

    def release(self, slot: int) -> None:
        pass


def test_a_step_left_with_only_inert_rows_does_not_call_the_model() -> None:
    model = _CountingModel()
    call = TimedStepCall(model, keeps_tokens=True)
    pending = StepBatch((StepRow(0, (PENDING_TOKEN,), 3, True, SamplingParams()),))
    step = ScheduledStep(pending, (), pending=(frozenset({7}),))  # no token kept: inert
    output, _ = call(step)
    assert model.calls == 0 and output.rows == (RowOutput(),)
    first = ScheduledStep(StepBatch((StepRow(0, (1,), 2, True, SamplingParams()),)), ())
    call(first)
    output, _ = call(step)  # now the previous step sampled 3 in slot 0
    assert model.calls == 2 and output.rows == (RowOutput(3),)
