"""Scheduler behaviour with scripted and mock models, no HTTP, no asyncio."""

from __future__ import annotations

import random

from app.engine.policy import StaticBatching
from app.engine.request import FinishReason, SequenceStatus, TokenEvent
from app.models.mock import MockModelRunner
from tests.engine.conftest import (
    EOS,
    ScriptedModel,
    make_request,
    make_scheduler,
    make_sequence,
    run_until_idle,
)


def b(text: str) -> list[int]:
    return list(text.encode())


def test_uneven_lengths_each_request_gets_its_own_output():
    model = ScriptedModel({b"a": b("x"), b"b": b("yyyyy"), b"c": b("zzz")}, max_num_seqs=3)
    scheduler = make_scheduler(model)
    sinks = {}
    for rid, prompt in [("1", "a"), ("2", "b"), ("3", "c")]:
        seq, sinks[rid] = make_sequence(make_request(rid, prompt))
        scheduler.add(seq)
    run_until_idle(scheduler, model)
    assert sinks["1"].final.text == "x"
    assert sinks["2"].final.text == "yyyyy"
    assert sinks["3"].final.text == "zzz"
    for sink in sinks.values():
        assert sink.final.finish_reason is FinishReason.STOP
        assert sink.final.stop_reason is None
        assert sink.final.token_ids[-1] == EOS
        assert sink.streamed_text == sink.final.text
        assert sink.streamed_ids == list(sink.final.token_ids)
    assert scheduler.num_running == 0 and scheduler.num_waiting == 0


def test_immediate_stop_on_first_token():
    model = ScriptedModel({b"a": []})
    scheduler = make_scheduler(model)
    seq, sink = make_sequence(make_request("1", "a"))
    scheduler.add(seq)
    calls = run_until_idle(scheduler, model)
    assert calls == 1
    assert sink.final.text == "" and sink.final.token_ids == (EOS,)
    assert sink.final.finish_reason is FinishReason.STOP
    assert sink.final.completion_tokens == 1


def test_max_tokens_zero_finishes_at_once_without_a_slot():
    model = ScriptedModel({b"a": b("hello")})
    scheduler = make_scheduler(model)
    seq, sink = make_sequence(make_request("1", "a", max_tokens=0))
    scheduler.add(seq)
    assert seq.status is SequenceStatus.FINISHED
    assert sink.final.finish_reason is FinishReason.LENGTH
    assert sink.final.text == "" and sink.final.token_ids == ()
    assert not scheduler.has_work and model.steps == []
    assert sink.final.timings.ttft_ms is None


def test_max_tokens_one():
    model = ScriptedModel({b"a": b("hello")})
    scheduler = make_scheduler(model)
    seq, sink = make_sequence(make_request("1", "a", max_tokens=1))
    scheduler.add(seq)
    assert run_until_idle(scheduler, model) == 1
    assert sink.final.text == "h" and sink.final.finish_reason is FinishReason.LENGTH


def test_more_requests_than_slots_fifo_each_once_and_no_idle_slot():
    rng = random.Random(3)
    prompts = {f"r{i}".encode(): b("t" * rng.randint(1, 9)) for i in range(11)}
    model = ScriptedModel(prompts, max_num_seqs=3)
    scheduler = make_scheduler(model)
    order = list(prompts)
    sinks = []
    for key in order:
        seq, sink = make_sequence(make_request(key.decode(), key))
        scheduler.add(seq)
        sinks.append(sink)
    admitted: list[str] = []
    while scheduler.has_work:
        scheduler.admit_waiting()
        # no slot idle while work waits
        assert scheduler.num_waiting == 0 or scheduler.num_running == 3
        for seq in scheduler.running():
            if seq.request_id not in admitted:
                admitted.append(seq.request_id)
        step = scheduler.schedule()
        scheduler.apply(step, model.step(step.batch))
    assert admitted == [key.decode() for key in order]  # FIFO
    for key, sink in zip(order, sinks, strict=True):
        assert sink.final.text == bytes(prompts[key]).decode()  # served exactly once, right output
    assert all(len(batch.rows) <= 3 for batch in model.steps)


def test_cancel_while_waiting_never_runs():
    model = ScriptedModel({b"a": b("xxxx"), b"b": b("yy")}, max_num_seqs=1)
    scheduler = make_scheduler(model)
    first, _ = make_sequence(make_request("1", "a"))
    second, sink = make_sequence(make_request("2", "b"))
    scheduler.add(first)
    scheduler.add(second)
    assert scheduler.cancel(second)
    run_until_idle(scheduler, model)
    assert sink.final.finish_reason is FinishReason.CANCELLED
    assert sink.final.token_ids == () and sink.final.timings.ttft_ms is None
    assert all(row.token_ids != tuple(b"b") for batch in model.steps for row in batch.rows)


def test_cancel_while_running_frees_slot_and_no_more_tokens():
    model = ScriptedModel({b"a": b("x" * 50), b"b": b("yy")}, max_num_seqs=1)
    scheduler = make_scheduler(model)
    long_seq, long_sink = make_sequence(make_request("1", "a", max_tokens=50))
    waiting_seq, waiting_sink = make_sequence(make_request("2", "b"))
    scheduler.add(long_seq)
    scheduler.add(waiting_seq)
    for _ in range(3):
        scheduler.admit_waiting()
        step = scheduler.schedule()
        scheduler.apply(step, model.step(step.batch))
    assert scheduler.cancel(long_seq)
    assert model.released == [0]
    count = len(long_sink.events)
    run_until_idle(scheduler, model)
    assert len(long_sink.events) == count  # nothing after the final event
    assert long_sink.final.finish_reason is FinishReason.CANCELLED
    assert long_sink.final.text == "xxx"
    assert waiting_sink.final.text == "yy"  # the freed slot was reused by the next step


def test_cancel_just_finished_and_twice():
    model = ScriptedModel({b"a": b("x")})
    scheduler = make_scheduler(model)
    seq, sink = make_sequence(make_request("1", "a"))
    scheduler.add(seq)
    run_until_idle(scheduler, model)
    assert not scheduler.cancel(seq)  # already finished
    assert sink.final.finish_reason is FinishReason.STOP

    seq2, sink2 = make_sequence(make_request("2", "a"))
    scheduler.add(seq2)
    assert scheduler.cancel(seq2)
    assert not scheduler.cancel(seq2)  # twice: the second is a no-op
    assert sink2.final.finish_reason is FinishReason.CANCELLED


def test_result_for_a_cancelled_row_is_dropped():
    """A step built before a cancel must not give the cancelled sequence a token (R17)."""
    model = ScriptedModel({b"a": b("xyz"), b"b": b("q")}, max_num_seqs=1)
    scheduler = make_scheduler(model)
    seq, sink = make_sequence(make_request("1", "a"))
    scheduler.add(seq)
    scheduler.admit_waiting()
    step = scheduler.schedule()
    output = model.step(step.batch)
    scheduler.cancel(seq)
    # the slot is reused before the stale output arrives
    other, other_sink = make_sequence(make_request("2", "b"))
    scheduler.add(other)
    scheduler.admit_waiting()
    scheduler.apply(step, output)
    assert sink.final.token_ids == ()
    assert other.generated == []


def test_stop_string_spanning_tokens_is_trimmed_and_never_streamed():
    model = ScriptedModel({b"a": b("hello world, bye")})
    scheduler = make_scheduler(model)
    seq, sink = make_sequence(make_request("1", "a", stop=["o w"]))
    scheduler.add(seq)
    run_until_idle(scheduler, model)
    assert sink.final.text == "hell"
    assert sink.final.finish_reason is FinishReason.STOP and sink.final.stop_reason == "o w"
    assert sink.streamed_text == "hell"
    assert "o" not in sink.streamed_text[4:]


def test_stop_token_id_and_ignore_eos():
    model = ScriptedModel({b"a": [*b("ab"), EOS, *b("cd")]})
    scheduler = make_scheduler(model)
    stop_seq, stop_sink = make_sequence(make_request("1", "a", stop_token_ids=[ord("b")]))
    scheduler.add(stop_seq)
    run_until_idle(scheduler, model)
    assert stop_sink.final.text == "a" and stop_sink.final.stop_reason == ord("b")

    eos_seq, eos_sink = make_sequence(make_request("2", "a", ignore_eos=True, max_tokens=5))
    scheduler.add(eos_seq)
    run_until_idle(scheduler, model)
    assert eos_sink.final.text == "abcd"
    assert eos_sink.final.finish_reason is FinishReason.LENGTH
    assert eos_sink.final.completion_tokens == 5


def test_multibyte_characters_never_split_in_events():
    text = "é中😀"
    model = ScriptedModel({b"a": b(text)})
    scheduler = make_scheduler(model)
    seq, sink = make_sequence(make_request("1", "a"))
    scheduler.add(seq)
    run_until_idle(scheduler, model)
    texts = [e.text for e in sink.events if isinstance(e, TokenEvent) and e.text]
    assert texts == ["é", "中", "😀"]
    assert sink.final.text == text


def test_chunked_prefill_keeps_decodes_running():
    model = ScriptedModel(
        {b"a": b("x" * 10), b"L" * 40: b("y")}, max_num_seqs=2, max_tokens_per_row=8
    )
    scheduler = make_scheduler(model, max_num_batched_tokens=9)
    short, short_sink = make_sequence(make_request("1", "a"))
    scheduler.add(short)
    scheduler.admit_waiting()
    step = scheduler.schedule()
    scheduler.apply(step, model.step(step.batch))
    long_seq, long_sink = make_sequence(make_request("2", b"L" * 40))
    scheduler.add(long_seq)
    run_until_idle(scheduler, model)
    assert long_sink.final.text == "y" and short_sink.final.text == "x" * 10
    for batch in model.steps:
        assert batch.num_tokens <= 9
    prefill_rows = [
        r for batch in model.steps for r in batch.rows if r.slot == long_seq_slot(model)
    ]
    assert len([r for r in prefill_rows if len(r.token_ids) > 1]) >= 5  # 40 tokens in chunks
    # the short request decoded in every step while the long prompt was being prefilled
    steps_with_chunk = [b for b in model.steps if any(len(r.token_ids) > 1 for r in b.rows)]
    assert all(len(b.rows) == 2 for b in steps_with_chunk[: len(steps_with_chunk) - 1])


def long_seq_slot(model: ScriptedModel) -> int:
    for batch in model.steps:
        for row in batch.rows:
            if row.token_ids and row.token_ids[0] == ord("L"):
                return row.slot
    raise AssertionError("long prompt never scheduled")


def test_continuous_batching_needs_fewer_model_calls_than_static():
    """Skewed lengths: one long request per batch holds a static batch hostage."""
    lengths = [40, 2, 3, 2, 40, 3, 2, 2, 40, 2, 3, 2]
    prompts = {f"r{i:02d}".encode(): b("t" * n) for i, n in enumerate(lengths)}

    def calls_with(policy) -> int:
        model = ScriptedModel(prompts, max_num_seqs=4)
        scheduler = make_scheduler(model, policy=policy)
        for key in prompts:
            seq, _ = make_sequence(make_request(key.decode(), key, max_tokens=64))
            scheduler.add(seq)
        return run_until_idle(scheduler, model)

    continuous = calls_with(None)
    static = calls_with(StaticBatching())
    # static: 3 batches of 4, each as long as its longest member (40 tokens + EOS) = 123
    assert static == 3 * 41
    # continuous: ~ total tokens / slots, bounded below by the longest request
    total = sum(n + 1 for n in lengths)
    assert continuous < static
    assert continuous >= max(lengths) + 1 and continuous <= total // 4 + 41


def test_mock_model_deterministic_and_uneven():
    runner = MockModelRunner(max_num_seqs=4)
    scheduler = make_scheduler(runner)
    sinks = []
    for i in range(8):
        seq, sink = make_sequence(make_request(str(i), f"prompt {i} 中文", max_tokens=200))
        scheduler.add(seq)
        sinks.append(sink)
    run_until_idle(scheduler, runner)
    lengths = {sink.final.completion_tokens for sink in sinks}
    assert len(lengths) > 3
    for sink in sinks:
        assert "\ufffd" not in sink.final.text
        assert sink.streamed_text == sink.final.text
    # same prompt alone gives the same text
    runner2 = MockModelRunner(max_num_seqs=1)
    scheduler2 = make_scheduler(runner2)
    seq, alone = make_sequence(make_request("x", "prompt 3 中文", max_tokens=200))
    scheduler2.add(seq)
    run_until_idle(scheduler2, runner2)
    assert alone.final.text == sinks[3].final.text
