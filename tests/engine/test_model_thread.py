"""The model thread: every call into the model (loading, then every step) on one OS thread, so
that torch's OpenMP keeps a single team of workers (app/engine/model_thread.py)."""

from __future__ import annotations

import asyncio
import gc
import threading

import httpx
import pytest

import app.api.server as server_module
from app.api.server import create_app
from app.config import ServerConfig
from app.engine.model_thread import ModelThread
from app.models.base import StepBatch, StepOutput
from app.models.mock import MockModelRunner


async def test_calls_run_in_order_on_one_thread_off_the_loop() -> None:
    model_thread = ModelThread()
    order: list[int] = []

    def record(index: int, *, delay_s: float = 0.0) -> int:
        if delay_s:
            threading.Event().wait(delay_s)
        order.append(index)
        return threading.get_ident()

    try:
        idents = await asyncio.gather(
            model_thread.run(record, 0, delay_s=0.02),
            model_thread.run(record, 1),
            model_thread.run(record, 2),
        )
    finally:
        model_thread.shutdown()
    assert order == [0, 1, 2]
    assert len(set(idents)) == 1
    assert idents[0] != threading.get_ident()


async def test_an_exception_reaches_the_caller_and_the_thread_goes_on() -> None:
    model_thread = ModelThread()

    def fail() -> None:
        raise ValueError("bad row")

    try:
        with pytest.raises(ValueError, match="bad row"):
            await model_thread.run(fail)
        assert await model_thread.run(lambda: 7) == 7
    finally:
        model_thread.shutdown()


class ThreadRecordingMock(MockModelRunner):
    """The mock, noting the thread it was built on and the threads its steps ran on."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.built_on = threading.get_ident()
        self.stepped_on: set[int] = set()

    def step(self, batch: StepBatch) -> StepOutput:
        self.stepped_on.add(threading.get_ident())
        return super().step(batch)


async def test_the_app_loads_and_steps_its_model_on_the_same_thread(monkeypatch) -> None:
    built: list[ThreadRecordingMock] = []

    def load_model(config: ServerConfig) -> ThreadRecordingMock:
        built.append(ThreadRecordingMock(max_num_seqs=config.max_num_seqs, step_ms=0.0))
        return built[0]

    monkeypatch.setattr(server_module, "load_model", load_model)
    app = create_app(ServerConfig(model="mock", max_num_seqs=2))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for _ in range(3):
                response = await client.post("/generate", json={"prompt": "hi", "max_tokens": 4})
                assert response.status_code == 200
    (model,) = built
    assert model.stepped_on == {model.built_on}
    assert model.built_on != threading.get_ident()


async def test_queued_calls_run_in_order_and_drain_waits_for_them() -> None:
    """``queue`` (a slot's release behind the steps in flight) does not wait; ``drain`` returns
    once everything queued before it ran, and at once after ``shutdown``."""
    model_thread = ModelThread()
    gate = threading.Event()
    order: list[str] = []
    running = model_thread.start(lambda: (gate.wait(10), order.append("step")))
    released = model_thread.queue(order.append, "release")
    assert not released.done()  # queued behind the held step
    gate.set()
    await model_thread.drain()
    await running
    assert order == ["step", "release"] and released.done()
    model_thread.shutdown()
    await asyncio.wait_for(model_thread.drain(), 1)


async def test_shutdown_lets_the_running_call_end_and_drops_the_queued_ones() -> None:
    model_thread = ModelThread()
    gate, started = threading.Event(), threading.Event()
    ran: list[str] = []

    def held() -> str:
        started.set()
        gate.wait(10)
        ran.append("held")
        return "done"

    running = model_thread.start(held)
    queued = model_thread.start(ran.append, "queued")
    release = model_thread.queue(ran.append, "release")
    await asyncio.to_thread(started.wait, 10)
    model_thread.shutdown()
    gate.set()
    assert await running == "done"
    with pytest.raises(asyncio.CancelledError):
        await queued
    assert release.cancelled() and ran == ["held"]
    with pytest.raises(RuntimeError, match="shut down"):
        model_thread.start(ran.append, "late")
    with pytest.raises(RuntimeError, match="shut down"):
        model_thread.queue(ran.append, "late")


async def test_a_call_cancelled_before_it_started_is_skipped() -> None:
    """As ``run_in_executor``'s: the caller gave up on it, so it never runs; the calls after
    it still do, in order."""
    model_thread = ModelThread()
    gate, started = threading.Event(), threading.Event()
    ran: list[str] = []
    try:
        running = model_thread.start(lambda: (started.set(), gate.wait(10)))
        skipped = model_thread.start(ran.append, "skipped")
        kept = model_thread.start(ran.append, "kept")
        await asyncio.to_thread(started.wait, 10)
        skipped.cancel()
        gate.set()
        await running
        await kept
        assert ran == ["kept"]
    finally:
        model_thread.shutdown()


def test_a_model_thread_dropped_without_shutdown_ends_its_thread() -> None:
    """Found by a review: the thread held its ``ModelThread`` (a bound method as its target),
    so one never shut down (an engine built and never stopped) kept a thread for good."""
    model_thread = ModelThread(name="dropped-model-thread")
    thread = model_thread._thread  # noqa: SLF001 (the thread under test)
    del model_thread
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


async def test_a_call_raising_stop_iteration_still_reaches_its_caller() -> None:
    """A future cannot hold a StopIteration (asyncio raises TypeError): it comes as a
    RuntimeError caused by it, instead of a future that never settles."""
    model_thread = ModelThread()

    def exhausted() -> None:
        raise StopIteration

    try:
        with pytest.raises(RuntimeError) as raised:
            await asyncio.wait_for(model_thread.run(exhausted), 5)
        assert isinstance(raised.value.__cause__, StopIteration)
    finally:
        model_thread.shutdown()
