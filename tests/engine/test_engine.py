"""``AsyncEngine`` without HTTP: cancels against the loop's steps, shutdown and loop failure.

The model here holds each step until the test lets it go (``GatedModel``), so a test can act
while a step is on the model thread, and waits on events, never on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

import pytest

from app.engine.engine import AsyncEngine, EngineState, EngineUnavailable
from app.engine.request import FinishReason
from app.models.base import StepBatch, StepOutput
from tests.engine.conftest import ScriptedModel, make_request

STEP_WAIT_S = 10.0  # a bound on waiting for the loop, never reached when the code is right


class GatedModel(ScriptedModel):
    """A scripted model whose every step starts, tells the test (``stepping``) and waits until
    the test calls ``let_go``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, **kwargs) -> None:
        super().__init__({b"a": [1, 2, 3], b"b": [4, 5], b"c": [6]}, **kwargs)
        self._loop = loop
        self.stepping = asyncio.Event()
        self._go = threading.Event()

    def step(self, batch: StepBatch) -> StepOutput:
        self._loop.call_soon_threadsafe(self.stepping.set)
        assert self._go.wait(STEP_WAIT_S), "the test never released the step"
        self._go.clear()
        return super().step(batch)

    async def in_step(self) -> None:
        """Returns once a step is running on the model thread (and waits for ``let_go``)."""
        await asyncio.wait_for(self.stepping.wait(), STEP_WAIT_S)
        self.stepping.clear()

    def let_go(self, *, every_step: bool = False) -> None:
        if every_step:
            self.step = super().step  # type: ignore[method-assign]
        self._go.set()


@contextlib.asynccontextmanager
async def gated_engine(
    max_num_seqs: int, *, schedule_ahead: bool = True
) -> AsyncIterator[tuple[AsyncEngine, GatedModel]]:
    """A started engine over a :class:`GatedModel` of ``max_num_seqs`` slots; stopped after
    every step is let go."""
    model = GatedModel(asyncio.get_running_loop(), max_num_seqs=max_num_seqs)
    engine = AsyncEngine(model, schedule_ahead=schedule_ahead)
    await engine.start()
    try:
        yield engine, model
    finally:
        model.let_go(every_step=True)
        await engine.stop()


@pytest.fixture
async def gated() -> AsyncIterator[tuple[AsyncEngine, GatedModel]]:
    async with gated_engine(2) as pair:
        yield pair


def metric(engine: AsyncEngine, name: str, **labels: str) -> float:
    return engine.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_cancel_during_a_step_wins_over_its_output(gated) -> None:
    engine, model = gated
    handle = engine.submit(make_request("r1", "a", max_tokens=3))
    await model.in_step()  # the prompt's step, which samples the first token
    engine.abort(handle)
    model.let_go(every_step=True)
    final = await asyncio.wait_for(handle.result(), STEP_WAIT_S)
    assert final.finish_reason is FinishReason.CANCELLED
    assert final.token_ids == () and final.text == ""  # the step's token was dropped (R17)
    # its slot is free, and the model's state of it released once the step built ahead
    # (which the cancel found queued behind this one) returned
    await engine.wait_model_thread()
    assert model.released == [0]
    assert metric(engine, "slotserve_cancel_to_slot_free_seconds_count") == 1
    assert engine.cancel("r1") is False  # a second cancel is a miss


async def test_cancel_before_the_loop_took_the_request(gated) -> None:
    engine, model = gated
    handle = engine.submit(make_request("r1", "a", max_tokens=3))
    engine.abort(handle)  # the same tick: Submit and Cancel are both still in the inbox
    assert engine.num_in_flight == 0
    final = await asyncio.wait_for(handle.result(), STEP_WAIT_S)
    assert final.finish_reason is FinishReason.CANCELLED
    assert final.timings.ttft_ms is None and final.completion_tokens == 0
    assert model.steps == []  # it never reached the model
    again = engine.submit(make_request("r1", "b", max_tokens=2))  # the id is free again
    model.let_go(every_step=True)
    assert (await asyncio.wait_for(again.result(), STEP_WAIT_S)).token_ids == (4, 5)


async def test_stop_ends_requests_in_a_step_and_in_the_inbox(gated) -> None:
    engine, model = gated
    running = engine.submit(make_request("r1", "a", max_tokens=3))
    await model.in_step()
    queued = [engine.submit(make_request(f"q{i}", "b", max_tokens=2)) for i in range(3)]
    stopping = asyncio.ensure_future(engine.stop())  # while the step is on the model thread
    await asyncio.sleep(0.05)
    assert not stopping.done()  # it waits for the step: a release never races a step
    model.let_go(every_step=True)
    await asyncio.wait_for(stopping, STEP_WAIT_S)
    for handle in (running, *queued):
        final = await asyncio.wait_for(handle.result(), STEP_WAIT_S)
        assert final.finish_reason is FinishReason.CANCELLED, handle.request_id
    assert engine.state is EngineState.STOPPED and engine.num_in_flight == 0
    with pytest.raises(EngineUnavailable):
        engine.submit(make_request("late", "c"))


class ReleaseRecordingModel(GatedModel):
    """A gated model that records every ``release`` made while one of its steps runs."""

    def __init__(self, loop: asyncio.AbstractEventLoop, **kwargs) -> None:
        super().__init__(loop, **kwargs)
        self.in_model_step = threading.Event()
        self.released_during_a_step: list[int] = []

    def step(self, batch: StepBatch) -> StepOutput:
        self.in_model_step.set()
        try:
            return super().step(batch)
        finally:
            self.in_model_step.clear()

    def release(self, slot: int) -> None:
        if self.in_model_step.is_set():
            self.released_during_a_step.append(slot)
        super().release(slot)


async def test_stop_waits_for_the_step_before_releasing_its_slots() -> None:
    """Found: ``stop`` cancelled the loop and released every slot while the step it left still
    ran on the model thread (``Model``: ``step`` never runs concurrently with ``release``)."""
    model = ReleaseRecordingModel(asyncio.get_running_loop(), max_num_seqs=2)
    engine = AsyncEngine(model)
    await engine.start()
    handles = [engine.submit(make_request(f"r{i}", "a", max_tokens=3)) for i in range(2)]
    await model.in_step()  # held on the model thread
    stopping = asyncio.ensure_future(engine.stop())
    await asyncio.sleep(0.05)  # the old order released both slots here, during the step
    model.let_go(every_step=True)
    await asyncio.wait_for(stopping, STEP_WAIT_S)
    assert model.released_during_a_step == []
    assert sorted(model.released) == [0, 1]  # released once the step returned
    for handle in handles:
        final = await asyncio.wait_for(handle.result(), STEP_WAIT_S)
        assert final.finish_reason is FinishReason.CANCELLED


async def test_loop_failure_ends_the_scheduled_the_queued_and_the_one_being_applied(
    gated, monkeypatch
) -> None:
    """Found: a command whose application raised (here ``scheduler.add``) was taken for a model
    failure; its request was neither in the scheduler nor in the inbox, and its client waited
    forever. Now the loop fails, and every request it knew ends with an error."""
    engine, model = gated
    running = engine.submit(make_request("r1", "a", max_tokens=3))
    await model.in_step()
    poisoned = engine.submit(make_request("poisoned", "b"))
    behind = engine.submit(make_request("behind", "c"))
    add = engine.scheduler.add

    def failing_add(seq) -> None:
        if seq.request_id == "poisoned":
            raise RuntimeError("scheduler bug")
        add(seq)

    monkeypatch.setattr(engine.scheduler, "add", failing_add)
    model.let_go(every_step=True)
    for handle in (running, poisoned, behind):
        final = await asyncio.wait_for(handle.result(), STEP_WAIT_S)
        assert final.finish_reason is FinishReason.ERROR, handle.request_id
        assert final.error == "the server's scheduler failed"
    assert engine.state is EngineState.FAILED and not engine.is_alive
    assert engine.num_in_flight == 0
    with pytest.raises(EngineUnavailable):
        engine.submit(make_request("late", "c"))


async def test_a_failing_step_fails_its_rows_and_the_loop_goes_on(gated, monkeypatch) -> None:
    engine, model = gated
    first = engine.submit(make_request("r1", "a", max_tokens=3))
    await model.in_step()
    monkeypatch.setattr(model, "_split", lambda tokens: 1 / 0)  # the model raises
    model.let_go()
    final = await asyncio.wait_for(first.result(), STEP_WAIT_S)
    assert final.finish_reason is FinishReason.ERROR
    assert final.error == "the model failed on this request"
    monkeypatch.undo()
    second = engine.submit(make_request("r2", "b", max_tokens=2))
    model.let_go(every_step=True)
    assert (await asyncio.wait_for(second.result(), STEP_WAIT_S)).token_ids == (4, 5)
    assert engine.is_alive


async def test_an_output_that_fails_to_apply_fails_its_rows_and_the_loop_goes_on(
    gated, monkeypatch
) -> None:
    """One failure rule for both drivers (``EngineCore``): any error while applying a step's
    output fails that step's rows, as in ``SyncEngine``; it used to end the loop here unless it
    was a ValueError."""
    engine, model = gated
    first = engine.submit(make_request("r1", "a", max_tokens=3))
    await model.in_step()
    advance = engine.scheduler.advance

    def failing_advance(step, output) -> None:
        raise RuntimeError("applying failed")

    monkeypatch.setattr(engine.scheduler, "advance", failing_advance)
    model.let_go()
    final = await asyncio.wait_for(first.result(), STEP_WAIT_S)
    assert final.finish_reason is FinishReason.ERROR
    assert final.error == "the model failed on this request"
    monkeypatch.setattr(engine.scheduler, "advance", advance)
    second = engine.submit(make_request("r2", "b", max_tokens=2))
    model.let_go(every_step=True)
    assert (await asyncio.wait_for(second.result(), STEP_WAIT_S)).token_ids == (4, 5)
    assert engine.is_alive


async def test_drain_returns_when_the_last_request_ends_not_on_a_tick(gated) -> None:
    engine, model = gated
    handle = engine.submit(make_request("r1", "a", max_tokens=3))
    await model.in_step()  # the prompt's step
    drain = asyncio.create_task(engine.drain(STEP_WAIT_S))
    model.let_go()
    await model.in_step()  # the first decode step: the drain task has run by now
    assert not drain.done() and engine.state is EngineState.DRAINING
    with pytest.raises(EngineUnavailable):
        engine.submit(make_request("late", "b"))
    model.let_go(every_step=True)
    await asyncio.wait_for(drain, STEP_WAIT_S)  # woken by the last final event
    assert handle.is_finished and (await handle.result()).token_ids == (1, 2, 3)


async def test_drain_gives_up_after_its_timeout(gated) -> None:
    engine, model = gated
    handle = engine.submit(make_request("r1", "a", max_tokens=3))
    await model.in_step()
    await asyncio.wait_for(engine.drain(0.05), STEP_WAIT_S)
    assert not handle.is_finished  # still in its step: drain does not end requests, stop does
