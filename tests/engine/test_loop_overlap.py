"""The loop's overlap: step N's text and events go out while step N+1 runs, and nothing the
seed guarantees moves (docs/ENGINE_LOOP.md).

Each test holds the model's steps (``GatedModel``) so it can act while a step runs and the
previous step's text is being emitted; it waits on events, never on time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from app.engine.engine import AsyncEngine
from app.engine.handle import RequestHandle
from app.engine.request import FinalEvent, FinishReason, StreamEvent, TokenEvent
from tests.engine.conftest import make_request
from tests.engine.test_engine import STEP_WAIT_S, GatedModel, gated_engine


@pytest.fixture
async def one_slot() -> AsyncIterator[tuple[AsyncEngine, GatedModel]]:
    async with gated_engine(1) as pair:
        yield pair


def collect(handle: RequestHandle) -> asyncio.Task[list[StreamEvent]]:
    """A consumer of the handle's events, as an SSE answer reads them."""

    async def read() -> list[StreamEvent]:
        return [event async for event in handle.events()]

    return asyncio.ensure_future(read())


def finals_of(events: list[StreamEvent]) -> list[FinalEvent]:
    return [event for event in events if isinstance(event, FinalEvent)]


def streamed_ids(events: list[StreamEvent]) -> list[int]:
    return [t for event in events if isinstance(event, TokenEvent) for t in event.token_ids]


async def test_the_previous_steps_events_go_out_while_the_next_step_runs(one_slot) -> None:
    engine, model = one_slot
    handle = engine.submit(make_request("r1", "a", max_tokens=3))
    stream = handle.events()
    await model.in_step()  # step 1: the prompt, which samples token 1
    model.let_go()
    await model.in_step()  # step 2 is held on the model thread ...
    first = await asyncio.wait_for(anext(stream), STEP_WAIT_S)  # ... and step 1's token is out
    assert isinstance(first, TokenEvent) and first.token_ids == (1,)
    model.let_go(every_step=True)
    got = [first, *[event async for event in stream]]
    assert streamed_ids(got) == [1, 2, 3]
    (final,) = finals_of(got)
    assert got[-1] is final and final.finish_reason is FinishReason.LENGTH
    assert final.token_ids == (1, 2, 3)


async def test_a_cancel_while_step_n_runs_and_n_minus_1_is_emitted_wins_over_step_n(
    one_slot,
) -> None:
    engine, model = one_slot
    handle = engine.submit(make_request("r1", "a", max_tokens=3))
    events = collect(handle)
    await model.in_step()  # step 1 samples token 1
    model.let_go()
    await model.in_step()  # step 2 runs; step 1's token went out meanwhile
    engine.abort(handle)  # the DELETE is answered now: step 2's token must never show
    model.let_go(every_step=True)
    got = await asyncio.wait_for(events, STEP_WAIT_S)
    (final,) = finals_of(got)
    assert final.finish_reason is FinishReason.CANCELLED
    assert final.token_ids == (1,) and streamed_ids(got) == [1]  # step 2's token dropped (R17)
    assert got[-1] is final
    await engine.wait_model_thread()  # releases queued behind a step built ahead
    assert model.released == [0]


async def test_a_cancel_before_step_n_minus_1_text_went_out_still_gets_that_text(
    one_slot,
) -> None:
    """A request cancelled after its token was applied but before the text side ran: the
    final event still carries the token and its text (as before the overlap), once."""
    engine, model = one_slot
    handle = engine.submit(make_request("r1", "a", max_tokens=3))
    events = collect(handle)
    await model.in_step()  # step 1 samples token 1 (applied when the step returns)
    engine.abort(handle)  # arrives during step 1: wins over its token
    model.let_go(every_step=True)
    got = await asyncio.wait_for(events, STEP_WAIT_S)
    (final,) = finals_of(got)
    assert final.finish_reason is FinishReason.CANCELLED and final.token_ids == ()
    assert streamed_ids(got) == []


async def test_a_slot_freed_by_a_finish_in_step_n_is_refilled_for_step_n_plus_1(
    one_slot,
) -> None:
    engine, model = one_slot
    first = engine.submit(make_request("first", "c", max_tokens=1))  # ends at its 1st token
    second = engine.submit(make_request("second", "b", max_tokens=2))  # waits for the slot
    first_events, second_events = collect(first), collect(second)
    await model.in_step()  # step 1: first's prompt; it finishes (length) when applied
    model.let_go()
    await model.in_step()  # step 2: the freed slot already holds second
    model.let_go(every_step=True)
    got_first = await asyncio.wait_for(first_events, STEP_WAIT_S)
    got_second = await asyncio.wait_for(second_events, STEP_WAIT_S)
    (row,) = model.steps[1].rows
    assert (row.slot, row.position, row.token_ids) == (0, 0, tuple(b"b"))
    (final,) = finals_of(got_first)
    assert final.finish_reason is FinishReason.LENGTH and final.token_ids == (6,)
    assert got_first[-1] is final and streamed_ids(got_first) == [6]
    (final,) = finals_of(got_second)
    assert final.token_ids == (4, 5) and got_second[-1] is final
    await engine.wait_model_thread()  # releases queued behind a step built ahead
    assert model.released[:1] == [0]


@pytest.mark.parametrize("schedule_ahead", [False, True])
async def test_a_stop_string_ends_the_request_before_the_next_step(schedule_ahead) -> None:
    """A request with stop strings runs its text side with the step's output (not one step
    later), so the slot it frees is refilled by the first step built after that output:
    the next call (steps built after the output), or the one after the step that was built
    ahead of it and already runs (its row for the finished request is dropped)."""
    async with gated_engine(1, schedule_ahead=schedule_ahead) as (engine, model):
        first = engine.submit(make_request("first", "a", max_tokens=3, stop=["\x02"]))
        second = engine.submit(make_request("second", "b", max_tokens=2))
        first_events, second_events = collect(first), collect(second)
        model.let_go(every_step=True)
        got_first = await asyncio.wait_for(first_events, STEP_WAIT_S)
        got_second = await asyncio.wait_for(second_events, STEP_WAIT_S)
    (final,) = finals_of(got_first)
    assert final.finish_reason is FinishReason.STOP and final.stop_reason == "\x02"
    assert final.token_ids == (1, 2) and final.text == "\x01"
    assert finals_of(got_second)[0].token_ids == (4, 5)
    # steps: first's prompt, first's decode (samples the stop string), [built ahead: first's
    # next decode, dropped], second's prompt
    rows = [[(row.position, row.token_ids) for row in step.rows] for step in model.steps]
    dropped = [[(2, (2,))]] if schedule_ahead else []
    expected = [[(0, tuple(b"a"))], [(1, (1,))], *dropped, [(0, tuple(b"b"))]]
    assert rows[: len(expected)] == expected


async def test_an_undecodable_token_fails_its_request_once_after_the_step(
    one_slot, monkeypatch
) -> None:
    """The text side fails while a step runs: the request ends (ERROR) once that step has
    returned (the step still used its slot), with exactly one final event."""
    engine, model = one_slot
    decode = model.tokenizer.decode_bytes

    def failing(token_ids):
        if 2 in token_ids:
            raise ValueError("undecodable")
        return decode(token_ids)

    monkeypatch.setattr(model.tokenizer, "decode_bytes", failing)
    handle = engine.submit(make_request("r1", "a", max_tokens=3))
    events = collect(handle)
    model.let_go(every_step=True)
    got = await asyncio.wait_for(events, STEP_WAIT_S)
    (final,) = finals_of(got)
    assert final.finish_reason is FinishReason.ERROR
    assert final.error == "failed to decode generated tokens"
    assert got[-1] is final
    await engine.wait_model_thread()  # releases queued behind a step built ahead
    assert model.released == [0]
