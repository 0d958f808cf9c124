"""The seed's ``generate`` (app/offline.py): outputs against the one-at-a-time loop, the shape of
every model call, call counts against the continuous and static optima, the edge cases of the
seed's clarifying questions, and the fixed batch shape."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.engine.request import FinishReason
from app.engine.scheduler import Scheduler
from app.offline import ModelStepError, Request, generate
from tests.engine.offline_models import (
    ConstantModel,
    HashModel,
    continuous_calls,
    one_at_a_time,
    static_calls,
)

STOP = 99

prompts = st.lists(st.integers(min_value=0, max_value=60), max_size=6)
workloads = st.tuples(
    st.integers(min_value=1, max_value=5),  # num_slots
    st.lists(st.tuples(prompts, st.integers(min_value=0, max_value=12)), max_size=14),
    st.integers(min_value=2, max_value=9),  # stop_one_in
)
PROPERTY_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def make_requests(specs: list[tuple[list[int], int]]) -> list[Request]:
    return [Request(f"r{i}", prompt, max_tokens) for i, (prompt, max_tokens) in enumerate(specs)]


@PROPERTY_SETTINGS
@given(workloads, st.sampled_from(["continuous", "static"]), st.booleans())
def test_same_outputs_as_one_request_at_a_time(workload, scheduling, pad_to_slots):
    num_slots, specs, stop_one_in = workload
    requests = make_requests(specs)
    model = HashModel(stop_token=STOP, stop_one_in=stop_one_in)
    outputs = generate(
        model, requests, num_slots, STOP, pad_to_slots=pad_to_slots, scheduling=scheduling
    )
    assert outputs == one_at_a_time(model, requests, STOP)
    assert list(outputs) == [request.request_id for request in requests]
    for request in requests:
        tokens = outputs[request.request_id]
        assert len(tokens) <= request.max_tokens
        assert STOP not in tokens[:-1]  # the stop token ends a request and is returned
        if len(tokens) < request.max_tokens:
            assert tokens[-1:] == [STOP]


@PROPERTY_SETTINGS
@given(workloads)
def test_every_call_holds_live_prefixes_only_and_counts_are_optimal(workload):
    num_slots, specs, stop_one_in = workload
    requests = make_requests(specs)
    model = HashModel(stop_token=STOP, stop_one_in=stop_one_in)
    outputs = generate(model, requests, num_slots, STOP)

    assert all(1 <= len(call) <= num_slots for call in model.calls)
    # Every entry of every call is prompt + generated-so-far of a request that was still
    # running, and each such state is sent exactly once: the calls' entries, as a multiset,
    # are exactly {prompt + output[:k] : k < len(output)} over all requests.
    sent = Counter(tuple(entry) for call in model.calls for entry in call)
    expected = Counter(
        tuple(request.prompt + outputs[request.request_id][:k])
        for request in requests
        for k in range(len(outputs[request.request_id]))
    )
    assert sent == expected

    lengths = [len(outputs[request.request_id]) for request in requests]
    assert len(model.calls) == continuous_calls(lengths, num_slots)
    static_model = HashModel(stop_token=STOP, stop_one_in=stop_one_in)
    assert generate(static_model, requests, num_slots, STOP, scheduling="static") == outputs
    assert len(static_model.calls) == static_calls(lengths, num_slots)
    assert len(model.calls) <= len(static_model.calls)
    if lengths and max(lengths) > 0:
        busy = sum(lengths)
        assert len(model.calls) >= max(max(lengths), -(-busy // num_slots))  # lower bounds


@PROPERTY_SETTINGS
@given(workloads)
def test_fifo_admission_no_idle_slot_and_running_requests_in_every_call(workload):
    """Prompts made unique (their first token names the request), so each entry can be traced."""
    num_slots, specs, stop_one_in = workload
    requests = [
        Request(f"r{i}", [1000 + i, *prompt], max_tokens)
        for i, (prompt, max_tokens) in enumerate(specs)
    ]
    model = HashModel(stop_token=STOP, stop_one_in=stop_one_in)
    outputs = generate(model, requests, num_slots, STOP)
    by_tag = {request.prompt[0]: request for request in requests}

    appearances: dict[str, list[int]] = {request.request_id: [] for request in requests}
    for index, call in enumerate(model.calls):
        ids = [by_tag[entry[0]].request_id for entry in call]
        assert len(ids) == len(set(ids))  # one entry per request per call
        for request_id, entry in zip(ids, call, strict=True):
            request = by_tag[entry[0]]
            k = len(appearances[request_id])
            assert entry == request.prompt + outputs[request_id][:k]  # generated so far
            appearances[request_id].append(index)
    for request in requests:
        calls = appearances[request.request_id]
        assert len(calls) == len(outputs[request.request_id])
        assert calls == list(range(calls[0], calls[0] + len(calls))) if calls else True
    firsts = [appearances[r.request_id][0] for r in requests if appearances[r.request_id]]
    assert firsts == sorted(firsts)  # admitted in list order
    for index, call in enumerate(model.calls):  # no slot empty while a request waits
        unfinished = sum(1 for calls in appearances.values() if calls and calls[-1] >= index)
        assert len(call) == min(num_slots, unfinished)


def test_continuous_needs_fewer_calls_than_static_on_skewed_lengths():
    lengths = [40, 2, 3, 2, 2, 40, 3, 2, 2, 2, 40, 3]
    requests = [Request(f"r{i}", [i], n) for i, n in enumerate(lengths)]
    continuous, static = ConstantModel(), ConstantModel()
    generate(continuous, requests, 4, STOP)
    generate(static, requests, 4, STOP, scheduling="static")
    assert len(static.calls) == 3 * 40 == static_calls(lengths, 4)
    # the short requests drain through three slots while one long request holds the fourth;
    # the third long one gets a slot at step 8, so the run ends at 48
    assert len(continuous.calls) == continuous_calls(lengths, 4) == 48
    # the same prefixes are sent either way; continuous packs them into fewer, fuller calls
    assert sorted(map(tuple, sum(continuous.calls, []))) == sorted(
        map(tuple, sum(static.calls, []))
    )


def test_immediate_stop():
    model = HashModel(stop_token=STOP, stop_one_in=1)  # every token is the stop token
    outputs = generate(model, [Request("a", [1, 2], 10), Request("b", [3], 10)], 2, STOP)
    assert outputs == {"a": [STOP], "b": [STOP]}
    assert model.calls == [[[1, 2], [3]]]


def test_max_tokens_zero_returns_empty_without_a_model_call():
    class NeverCall:
        def next_tokens(self, batch):
            raise AssertionError("called")

    assert generate(NeverCall(), [Request("a", [1], 0), Request("b", [], 0)], 1, STOP) == {
        "a": [],
        "b": [],
    }
    assert generate(NeverCall(), [], 3, STOP) == {}


def test_max_tokens_one_makes_exactly_one_call_per_request():
    model = ConstantModel()
    outputs = generate(model, [Request("a", [1], 1), Request("b", [2], 1)], 1, STOP)
    assert outputs == {"a": [7], "b": [7]}
    assert model.calls == [[[1]], [[2]]]


def test_empty_prompt_is_sent_as_an_empty_prefix():
    model = ConstantModel()
    assert generate(model, [Request("a", [], 3)], 1, STOP) == {"a": [7, 7, 7]}
    assert model.calls == [[[]], [[7]], [[7, 7]]]


def test_more_requests_than_slots_each_served_once_in_order():
    model = ConstantModel()
    requests = [Request(f"r{i}", [i], 2 + i % 3) for i in range(7)]
    outputs = generate(model, requests, 2, STOP)
    assert outputs == {r.request_id: [7] * r.max_tokens for r in requests}
    first_seen = []
    for call in model.calls:
        for entry in call:
            if entry[0] not in first_seen:
                first_seen.append(entry[0])
    assert first_seen == list(range(7))


@pytest.mark.parametrize(
    ("requests", "num_slots", "message"),
    [
        ([Request("a", [1], 2), Request("a", [2], 2)], 2, "duplicate request_id 'a'"),
        ([Request("a", [1], 2)], 0, "num_slots must be >= 1"),
        ([Request("a", [1], -1)], 1, "max_tokens must be >= 0"),
    ],
)
def test_invalid_arguments_raise_before_any_call(requests, num_slots, message):
    model = ConstantModel()
    with pytest.raises(ValueError, match=message):
        generate(model, requests, num_slots, STOP)
    assert model.calls == []


def test_unknown_scheduling_is_a_value_error():
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        generate(ConstantModel(), [Request("a", [1], 1)], 1, STOP, scheduling="fastest")


class FailsAtCall:
    """Raises on call ``fail_at`` (1-based); records every call."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at
        self.calls: list[list[list[int]]] = []

    def next_tokens(self, batch):
        self.calls.append(batch)
        if len(self.calls) == self.fail_at:
            raise RuntimeError("device lost")
        return [7] * len(batch)


def test_a_failing_model_propagates_with_step_and_request_ids_and_no_call_after():
    model = FailsAtCall(fail_at=3)
    requests = [Request("a", [1], 1), Request("b", [2], 5), Request("c", [3], 5)]
    with pytest.raises(ModelStepError) as caught:
        generate(model, requests, 2, STOP)
    error = caught.value
    # call 1: a, b; a finishes and c takes its slot (0); call 3, rows in slot order, fails
    assert str(error) == "model step 3 failed (requests 'c', 'b'): RuntimeError: device lost"
    assert (error.step_index, error.request_ids) == (3, ("c", "b"))
    assert isinstance(error.__cause__, RuntimeError)
    assert len(model.calls) == 3  # none after the failure


def test_a_wrong_number_of_tokens_is_a_model_failure():
    class Short:
        def next_tokens(self, batch):
            return [7]

    with pytest.raises(ModelStepError, match="step 1 failed .*'a', 'b'.*1 tokens for 2"):
        generate(Short(), [Request("a", [1], 3), Request("b", [2], 3)], 2, STOP)


def test_a_model_that_changes_its_input_changes_nothing():
    class Scribbler(ConstantModel):
        def next_tokens(self, batch):
            tokens = super().next_tokens(batch)
            for prefix in batch:
                prefix.append(-5)
            return tokens

    assert generate(Scribbler(), [Request("a", [1], 3)], 1, STOP) == {"a": [7, 7, 7]}


def test_runs_on_the_callers_thread_without_an_event_loop():
    seen = []

    class Probe(ConstantModel):
        def next_tokens(self, batch):
            with pytest.raises(RuntimeError):
                asyncio.get_running_loop()
            seen.append(threading.current_thread())
            return super().next_tokens(batch)

    before = threading.active_count()
    generate(Probe(), [Request("a", [1], 3), Request("b", [2], 2)], 2, STOP)
    assert seen and all(thread is threading.current_thread() for thread in seen)
    assert threading.active_count() == before


def test_every_request_ends_through_the_schedulers_finish_funnel(monkeypatch):
    finished: list[tuple[str, FinishReason]] = []
    original = Scheduler.finish

    def recording_finish(self, seq, reason, **kwargs):
        finished.append((seq.request_id, reason))
        return original(self, seq, reason, **kwargs)

    monkeypatch.setattr(Scheduler, "finish", recording_finish)
    model = HashModel(stop_token=STOP, stop_one_in=3)
    requests = [Request("a", [1], 0), Request("b", [2], 6), Request("c", [3], 1)]
    outputs = generate(model, requests, 2, STOP)
    assert sorted(request_id for request_id, _ in finished) == ["a", "b", "c"]
    reasons = dict(finished)
    assert reasons["a"] is FinishReason.LENGTH
    assert reasons["b"] is (
        FinishReason.STOP if outputs["b"][-1:] == [STOP] else FinishReason.LENGTH
    )


# --------------------------------------------------------------------------- fixed batch shape


class FixedShapeOnly(HashModel):
    """Rejects any call that is not exactly ``num_slots`` entries; answers an empty prefix
    (a padded slot) with ``poison``, which must never reach a request."""

    def __init__(self, num_slots: int, poison: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_slots = num_slots
        self.poison = poison

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        if len(batch) != self.num_slots:
            raise ValueError(f"this model runs {self.num_slots} rows, got {len(batch)}")
        self.calls.append([list(prefix) for prefix in batch])
        return [self.poison if prefix == [] else self.next_token(prefix) for prefix in batch]


def test_a_fixed_shape_model_fails_on_compacted_calls():
    model = FixedShapeOnly(3, poison=55, stop_token=STOP)
    with pytest.raises(ModelStepError, match="runs 3 rows, got 1"):
        generate(model, [Request("a", [1], 4)], 3, STOP)


@PROPERTY_SETTINGS
@given(workloads, st.sampled_from(["continuous", "static"]))
def test_padded_calls_have_exactly_num_slots_entries_and_padding_reaches_no_request(
    workload, scheduling
):
    num_slots, specs, stop_one_in = workload
    # non-empty prompts, so that an empty entry is always padding
    requests = [Request(f"r{i}", [1, *prompt], n) for i, (prompt, n) in enumerate(specs)]
    # the poison is the stop token: a padded row's output reaching a request would end it
    model = FixedShapeOnly(num_slots, poison=STOP, stop_token=STOP, stop_one_in=stop_one_in)
    outputs = generate(model, requests, num_slots, STOP, pad_to_slots=True, scheduling=scheduling)
    assert outputs == one_at_a_time(model, requests, STOP)
    assert all(len(call) == num_slots for call in model.calls)
    compacted = HashModel(stop_token=STOP, stop_one_in=stop_one_in)
    generate(compacted, requests, num_slots, STOP, scheduling=scheduling)
    assert len(model.calls) == len(compacted.calls)  # padding adds rows, never calls
    for padded, live in zip(model.calls, compacted.calls, strict=True):
        assert [entry for entry in padded if entry] == live
