"""N-gram speculative decoding in the batched step (issue 32), on the mock.

The mock is deterministic, so a verified draft is accepted exactly where the mock would have
produced the same tokens one step at a time: the oracle is the same run with speculation off.
``order=3`` makes the mock a Markov chain over its last 3 bytes, whose text soon repeats, so
drafts are found and accepted (each test checks that some were, so it can fail).
"""

from __future__ import annotations

import random

import pytest

from app.engine.metrics import EngineMetrics
from app.engine.policy import ContinuousBatching
from app.engine.request import FinishReason, GenerationRequest, StopCriteria
from app.engine.scheduler import Scheduler
from app.engine.speculation import (
    COST_SAMPLES,
    HOLD_PATIENCE,
    MIN_COST_SAMPLES,
    MIN_PLAIN_SAMPLES,
    NO_SPECULATION,
    PLAIN_EVERY,
    DraftCosts,
    NgramSpeculation,
    draft_length,
    propose,
)
from app.models.base import SamplingParams
from app.models.mock import MockModelRunner
from tests.engine.conftest import ScriptedModel, make_sequence, run_until_idle

FREE = ((1, 0.0),)  # a drafted token costs nothing: every eligible row drafts


def _always(k: int) -> NgramSpeculation:
    """Every eligible row drafts up to ``k`` tokens (no step is timed: the mock is free)."""
    return NgramSpeculation(k, draft_token_cost=FREE, measure=False)


def _request(
    request_id: str,
    prompt: bytes,
    *,
    max_tokens: int = 60,
    stop: tuple[str, ...] = (),
    logprobs: int | None = None,
    sampling: SamplingParams | None = None,
) -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id,
        prompt_token_ids=tuple(prompt),
        max_tokens=max_tokens,
        sampling=sampling or SamplingParams(temperature=0.0, seed=0, logprobs=logprobs),
        stop=StopCriteria(stop_strings=stop),
    )


def _scheduler(
    speculation: NgramSpeculation,
    *,
    slots: int = 4,
    kv_blocks: int | None = 200,
    chunk: int | None = None,
    budget: int | None = None,
    context: int = 512,
) -> tuple[Scheduler, MockModelRunner, EngineMetrics]:
    model = MockModelRunner(
        max_num_seqs=slots,
        context_length=context,
        kv_blocks=kv_blocks,
        eos_one_in=1000,
        max_tokens_per_row=chunk,
        order=3,
    )
    metrics = EngineMetrics()
    caps = model.capabilities
    scheduler = Scheduler(
        capabilities=caps,
        tokenizer=model.tokenizer,
        policy=ContinuousBatching(),
        metrics=metrics,
        release_slot=model.release,
        max_num_batched_tokens=budget or max(caps.max_num_seqs, caps.max_tokens_per_row),
        speculation=speculation,
    )
    return scheduler, model, metrics


def _run(requests: list[GenerationRequest], speculation: NgramSpeculation, **options):
    """Runs ``requests`` to the end; returns their finals, the model steps and the metrics."""
    scheduler, model, metrics = _scheduler(speculation, **options)
    sinks = []
    for request in requests:
        seq, sink = make_sequence(request)
        scheduler.add(seq)
        sinks.append(sink)
    steps = 0
    while scheduler.has_work:
        scheduler.admit_waiting()
        step = scheduler.schedule()
        assert step is not None
        scheduler.apply(step, model.step(step.batch))
        steps += 1
        assert steps < 20_000
    if scheduler.kv_blocks is not None:
        scheduler.kv_blocks.check()
        assert scheduler.kv_blocks.num_used_blocks == 0, "leaked blocks"
    return [sink.final for sink in sinks], [sink.streamed_ids for sink in sinks], steps, metrics


def _accepted(metrics: EngineMetrics) -> float:
    return metrics.registry.get_sample_value("slotserve_spec_decode_num_accepted_tokens_total")


def _prompts(count: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    words = [b"alpha", b"beta", b"gamma", b"delta", "中文".encode(), b"x"]
    return [b" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))) for _ in range(count)]


# ----------------------------------------------------------------------- the proposer


def test_propose_takes_the_longest_suffix_and_its_latest_occurrence():
    tokens = [1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3]
    # suffix (1, 2, 3) occurred at 0: what followed it
    assert propose(tokens, 3, 4, 2) == (9, 2, 3)
    # only (2, 3) of length 2 allowed: the latest occurrence before the suffix, at 4
    assert propose(tokens, 2, 2, 2) == (7, 8)
    assert propose([1, 2, 3, 4], 3, 4, 2) == ()  # nothing repeats
    assert propose([5, 5], 3, 4, 1) == (5, 5, 5)  # a loop of one token goes on


def test_propose_continues_a_repeating_run_past_the_end_of_the_tokens():
    # period 3: the latest occurrence of the suffix is 3 tokens back, and 3 tokens follow it;
    # the draft goes on cycling them instead of stopping at 3
    tokens = [1, 5, 6, 7, 5, 6, 7, 5, 6]
    assert propose(tokens, 7, 4, 2) == (7, 5, 6, 7, 5, 6, 7)
    assert propose(tokens, 2, 4, 2) == (7, 5)
    # a continuation that does not reach the end is not cycled
    assert propose([1, 2, 3, 4, 9, 1, 2], 5, 4, 2) == (3, 4, 9, 1, 2)


def test_propose_matches_token_boundaries_only():
    # 256 packs as bytes 00 01 00 00: a misaligned byte match must not count
    tokens = [1, 256, 0, 7, 256, 0]
    assert propose(tokens, 2, 2, 2) == (7, 256)


def test_settings_out_of_range_are_refused():
    with pytest.raises(ValueError):
        NgramSpeculation(num_draft_tokens=-1)
    with pytest.raises(ValueError):
        NgramSpeculation(num_draft_tokens=2, min_ngram=3, max_ngram=2)


# ----------------------------------------------------------------------- greedy identity


@pytest.mark.parametrize(
    ("options", "k"),
    [
        ({"slots": 1}, 4),
        ({"slots": 4}, 3),
        ({"slots": 8, "chunk": 7}, 5),
        ({"slots": 3, "kv_blocks": None}, 4),
        ({"slots": 4, "budget": 6, "chunk": 6}, 8),
    ],
)
def test_greedy_output_is_the_same_with_speculation_on_and_off(options, k):
    requests = [
        _request(f"r{i}", prompt, max_tokens=20 + 7 * (i % 5), stop=("ab",) if i % 4 == 0 else ())
        for i, prompt in enumerate(_prompts(12, seed=len(options) + k))
    ]
    off, off_ids, off_steps, _ = _run(requests, NO_SPECULATION, **options)
    speculation = _always(k)
    on, on_ids, on_steps, metrics = _run(requests, speculation, **options)
    for a, b, streamed_a, streamed_b in zip(off, on, off_ids, on_ids, strict=True):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert streamed_b == streamed_a
    assert _accepted(metrics) > 0, "no draft was ever accepted: the test proves nothing"
    if "budget" not in options and "chunk" not in options:  # drafts never compete with prompts
        assert on_steps < off_steps


def test_logprobs_are_those_of_each_token_with_speculation():
    requests = [_request(f"r{i}", p, logprobs=2) for i, p in enumerate(_prompts(4, seed=3))]
    off, *_ = _run(requests, NO_SPECULATION)
    on, _, _, metrics = _run(requests, _always(4))
    assert _accepted(metrics) > 0
    for a, b in zip(off, on, strict=True):
        assert len(b.logprobs) == len(b.token_ids)
        assert b.logprobs == a.logprobs


def test_a_penalised_row_never_drafts_and_min_tokens_waits_until_met():
    penalised = SamplingParams(temperature=0.0, seed=0, presence_penalty=0.5)
    held = SamplingParams(temperature=0.0, seed=0, min_tokens=30)
    biased = SamplingParams(temperature=0.0, seed=0, logit_bias=((97, 1.0),))
    speculation = _always(4)
    rows = {}
    for name, sampling in (("penalised", penalised), ("held", held), ("biased", biased)):
        seq, _ = make_sequence(_request(name, b"abcabcabc", sampling=sampling))
        rows[name] = seq
    rows["held"].generated.extend([97] * 29)
    for seq in rows.values():
        seq.generated.append(97)
    assert not speculation.eligible(rows["penalised"])
    assert speculation.eligible(rows["held"])  # 30 generated: min_tokens is met
    rows["held"].generated.pop()
    assert not speculation.eligible(rows["held"])
    assert speculation.eligible(rows["biased"])  # the same bias at every position


def test_drafting_backs_off_when_a_drafted_token_costs_more_than_it_earns():
    """Without measurements the table's cost holds: a row drafts the tokens whose chance of
    acceptance (``q**j``, q its running acceptance, 0.5 to start) is at least the cost times
    ``DRAFT_MARGIN`` (1.5)."""
    caps = MockModelRunner(max_num_seqs=8).capabilities
    speculation = NgramSpeculation(4, draft_token_cost=((1, 0.08), (4, 0.6)))
    sequences = []
    for index in range(6):
        seq, _ = make_sequence(_request(f"r{index}", b"ab ab ab a"))
        seq.generated.append(ord("b"))  # "...ab" occurred before: a draft is found
        seq.num_computed_tokens = seq.num_prompt_tokens
        sequences.append(seq)
    few = speculation.drafts(sequences[:3], 100, caps, None)
    assert few == [(ord(" "), ord("a"), ord("b"))] * 3  # 0.5, 0.25, 0.125 >= 0.12
    many = speculation.drafts(sequences, 100, caps, None)  # dear from 4 rows on
    assert many == [()] * 6
    assert sequences[5].draft_acceptance > 0.5  # it creeps back up, to try again later
    assert speculation.drafts(sequences[:1], 2, caps, None) == [(ord(" "),)]  # the budget


def test_draft_length_is_the_tokens_whose_chance_beats_the_cost():
    assert draft_length(0.5, 0.1, 8) == 3
    assert draft_length(0.5, 0.1, 2) == 2
    assert draft_length(0.9, 0.0, 5) == 5
    assert draft_length(0.3, 0.31, 4) == 0
    assert draft_length(0.95, 0.5, 16) == 13  # 0.95**13 = 0.51, 0.95**14 = 0.49


def test_a_row_whose_drafts_are_rejected_stops_drafting():
    speculation = NgramSpeculation(4, draft_token_cost=((1, 0.3),))
    seq, _ = make_sequence(_request("r", b"ab ab ab"))
    assert speculation.worth(seq, 0.3) == 1  # 0.5 to start
    for _ in range(4):
        speculation.record(seq, 4, 0)
    assert seq.draft_acceptance == pytest.approx(0.5 * 0.8**4)
    assert speculation.worth(seq, 0.3) == 0
    for _ in range(8):
        speculation.record(seq, 4, 4)
    assert speculation.worth(seq, 0.3) == 4
    before = seq.draft_acceptance
    speculation.record(seq, 4, 2)  # two accepted, then the rejected third
    assert seq.draft_acceptance == pytest.approx((1 - 0.8**2 * (1 - before)) * 0.8)


# ----------------------------------------------------------------------- the measured cost


def test_the_cost_is_measured_from_plain_and_drafted_steps_at_the_same_row_count():
    costs = DraftCosts(((1, 0.05), (16, 0.9)))
    assert costs.plain_due(4)  # its plain time is unknown
    costs.observe(4, 8, 0.2)  # a drafted step before any plain one: nothing to compare
    for _ in range(MIN_PLAIN_SAMPLES):
        costs.observe(4, 0, 0.100)
    assert not costs.plain_due(4)
    for seconds in (0.130, 0.130, 0.130, 5.0):  # a spike of the shared machine
        costs.observe(4, 8, seconds)
    # (0.13 / 0.1 - 1) * 4 rows / 8 drafted: a drafted token costs 0.15 of a plain row
    assert costs.cost(4) == pytest.approx(0.15)
    assert costs.cost(7) == pytest.approx(0.15)  # the same row class
    assert costs.cost(8) == 0.05 and costs.cost(16) == 0.9  # not measured: the table
    for _ in range(PLAIN_EVERY - 4):
        costs.observe(4, 8, 0.130)
    assert costs.plain_due(4)  # time to measure the plain step again
    costs.observe(4, 0, 0.1)
    assert not costs.plain_due(4)


def test_one_plain_step_that_spiked_is_not_taken_for_the_plain_time():
    """A shared machine's spike on the one plain step measured would make every drafted step
    look free until the next plain one, ``PLAIN_EVERY`` drafted steps later: a row count's
    plain time needs ``MIN_PLAIN_SAMPLES`` plain steps, their median."""
    costs = DraftCosts(((1, 0.05),))
    costs.observe(1, 0, 2.0)  # the spike
    assert costs.plain_due(1)
    for _ in range(MIN_COST_SAMPLES):
        costs.observe(1, 4, 0.2)  # not compared with the spike
    assert costs.cost(1) == 0.05
    for _ in range(MIN_PLAIN_SAMPLES - 1):
        costs.observe(1, 0, 0.1)
    assert not costs.plain_due(1)
    for _ in range(MIN_COST_SAMPLES):
        costs.observe(1, 4, 0.2)  # twice a plain step, 4 drafted: each costs a quarter of it
    assert costs.cost(1) == pytest.approx(0.25)


def test_an_unmeasured_cost_model_never_asks_for_a_plain_step():
    costs = NgramSpeculation(4, draft_token_cost=((1, 0.2),), measure=False).cost_model()
    costs.observe(2, 0, 0.1)
    costs.observe(2, 4, 10.0)
    assert not costs.plain_due(3) and costs.cost(2) == 0.2
    assert not NO_SPECULATION.cost_model().measure


class _ClockedModel:
    """The mock, whose steps advance a fake clock by ``base + per_position * positions``
    seconds (the scheduler times its steps with that clock)."""

    def __init__(self, model: MockModelRunner, base: float, per_position: float) -> None:
        self.model = model
        self.now = 0.0
        self.base = base
        self.per_position = per_position

    def clock(self) -> float:
        return self.now

    def step(self, batch):
        self.now += self.base + self.per_position * batch.num_tokens
        return self.model.step(batch)


def _clocked_scheduler(model: MockModelRunner, clocked: _ClockedModel, speculation):
    """A scheduler over ``model`` that times its steps with ``clocked``'s clock, and its
    metrics."""
    metrics = EngineMetrics()
    scheduler = Scheduler(
        capabilities=model.capabilities,
        tokenizer=model.tokenizer,
        policy=ContinuousBatching(),
        metrics=metrics,
        release_slot=model.release,
        max_num_batched_tokens=512,
        clock=clocked.clock,
        speculation=speculation,
    )
    return scheduler, metrics


def _timed_run(requests, speculation, base: float, per_position: float, slots: int):
    """``requests`` to the end with steps timed by a ``_ClockedModel``: their tokens, the
    fake seconds it took, the drafted tokens and the scheduler's measured costs."""
    model = MockModelRunner(
        max_num_seqs=slots, context_length=512, kv_blocks=400, eos_one_in=1000, order=3
    )
    clocked = _ClockedModel(model, base, per_position)
    scheduler, metrics = _clocked_scheduler(model, clocked, speculation)
    sinks = []
    for request in requests:
        seq, sink = make_sequence(request)
        scheduler.add(seq)
        sinks.append(sink)
    run_until_idle(scheduler, clocked)
    drafted = metrics.registry.get_sample_value("slotserve_spec_decode_num_draft_tokens_total")
    tokens = [sink.final.token_ids for sink in sinks]
    return tokens, clocked.now, drafted or 0.0, scheduler.draft_costs


def test_drafting_stops_where_the_measured_cost_beats_what_it_earns():
    """A step whose every position costs as much as a row (compute-bound) against a table that
    says drafts are cheap (the 0.87x at 16 free-form streams): the measurement wins, drafting
    all but stops, and the run is no slower than without speculation. (All but: a cost that
    holds every row back ages out, ``HOLD_PATIENCE``, and the table stands in again for the
    few steps it takes to measure it anew: 250 drafted tokens here against 23 before that
    rule and 1,506 on the table alone.)"""
    requests = [_request(f"r{i}", p, max_tokens=150) for i, p in enumerate(_prompts(16, 4))]
    cheap_table = NgramSpeculation(4, draft_token_cost=((1, 0.05),))
    off, off_time, _, _ = _timed_run(requests, NO_SPECULATION, 0.0, 0.001, 16)
    on, on_time, drafted, costs = _timed_run(requests, cheap_table, 0.0, 0.001, 16)
    assert on == off
    assert costs.cost(16) == pytest.approx(1.0)  # a drafted position costs a row
    unmeasured = NgramSpeculation(4, draft_token_cost=((1, 0.05),), measure=False)
    _, table_time, table_drafted, _ = _timed_run(requests, unmeasured, 0.0, 0.001, 16)
    assert table_drafted > 5 * drafted  # the table alone keeps drafting
    assert on_time <= off_time * 1.03


def test_drafting_goes_on_where_the_step_is_bound_by_reading_the_weights():
    """Positions nearly free (a fixed step time): the rows draft, the run takes fewer steps'
    time, and the output is the same."""
    requests = [_request(f"r{i}", p, max_tokens=150) for i, p in enumerate(_prompts(2, 6))]
    dear_table = NgramSpeculation(4, draft_token_cost=((1, 0.45),))
    off, off_time, _, _ = _timed_run(requests, NO_SPECULATION, 0.05, 0.0001, 2)
    on, on_time, drafted, costs = _timed_run(requests, dear_table, 0.05, 0.0001, 2)
    assert on == off
    assert costs.cost(2) < 0.01
    assert drafted > 50
    assert on_time < 0.8 * off_time


def test_drafted_tokens_count_against_the_step_budget():
    requests = [_request(f"r{i}", b"ab ab ab ab ab ab " * 3) for i in range(4)]
    speculation = _always(8)
    scheduler, model, _ = _scheduler(speculation, slots=4, budget=10, chunk=10)
    for request in requests:
        scheduler.add(make_sequence(request)[0])
    for _ in range(30):
        scheduler.admit_waiting()
        step = scheduler.schedule()
        if step is None:
            break
        assert step.batch.num_tokens <= 10
        scheduler.apply(step, model.step(step.batch))


# ----------------------------------------------------------------------- the KV cache


def test_rollback_under_preemption_keeps_outputs_and_blocks_consistent():
    """A pool too small for every sequence: preemptions happen between speculative steps; the
    outputs equal speculation off (and no block leaks or stays half-registered)."""
    requests = [_request(f"r{i}", p, max_tokens=120) for i, p in enumerate(_prompts(6, seed=9))]
    options = {"slots": 6, "kv_blocks": 40}
    off, _, _, off_metrics = _run(requests, NO_SPECULATION, **options)
    on, _, _, metrics = _run(requests, _always(6), **options)
    assert metrics.registry.get_sample_value("slotserve_preemptions_total") > 0
    assert _accepted(metrics) > 0
    assert [f.token_ids for f in on] == [f.token_ids for f in off]


def test_rejected_positions_give_their_blocks_back():
    scheduler, model, _ = _scheduler(_always(8), slots=1)
    seq, _ = make_sequence(_request("r", b"xy " * 9, max_tokens=100))
    scheduler.add(seq)
    blocks = scheduler.kv_blocks
    assert blocks is not None
    drafted = False
    while scheduler.has_work:
        scheduler.admit_waiting()
        step = scheduler.schedule()
        assert step is not None
        drafted |= any(row.num_draft_tokens for row in step.batch.rows)
        scheduler.apply(step, model.step(step.batch))
        if seq.slot is not None:
            # nothing past the next position is held once a step is applied
            assert len(blocks.table(seq)) <= blocks.blocks_for(seq.num_computed_tokens + 1)
            blocks.check()
    assert drafted


def test_cancel_while_a_draft_is_in_flight_drops_its_output_and_frees_its_blocks():
    scheduler, model, metrics = _scheduler(_always(6), slots=2)
    target, sink = make_sequence(_request("t", b"ab ab ab ab ab ", max_tokens=200))
    scheduler.add(target)
    while True:
        scheduler.admit_waiting()
        step = scheduler.schedule()
        assert step is not None
        if any(row.num_draft_tokens for row in step.batch.rows):
            break
        scheduler.apply(step, model.step(step.batch))
    output = model.step(step.batch)  # the model ran the draft ...
    generated = len(target.generated)
    assert scheduler.cancel(target)  # ... and the cancel arrived meanwhile: it wins
    scheduler.apply(step, output)
    assert sink.final.finish_reason is FinishReason.CANCELLED
    assert len(sink.final.token_ids) == generated
    blocks = scheduler.kv_blocks
    assert blocks is not None and blocks.num_used_blocks == 0
    blocks.check()
    # the slot serves the next request exactly as a fresh scheduler would
    follower = _request("f", b"gamma gamma gamma", max_tokens=50)
    seq, follow_sink = make_sequence(follower)
    scheduler.add(seq)
    while scheduler.has_work:
        scheduler.admit_waiting()
        step = scheduler.schedule()
        assert step is not None
        scheduler.apply(step, model.step(step.batch))
    (alone,), *_ = _run([follower], NO_SPECULATION, slots=2)
    assert follow_sink.final.token_ids == alone.token_ids


def test_metrics_count_drafts_under_vllms_names_too():
    requests = [_request(f"r{i}", p) for i, p in enumerate(_prompts(3, seed=1))]
    _, _, _, metrics = _run(requests, _always(4))
    drafted = metrics.registry.get_sample_value("slotserve_spec_decode_num_draft_tokens_total")
    assert drafted > 0
    assert metrics.spec_decode_acceptance_rate == pytest.approx(_accepted(metrics) / drafted)
    text = metrics.render(model_name="m").decode()
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        assert f'vllm:spec_decode_num_{name}_total{{model_name="m"}}' in text


def test_a_model_that_does_not_verify_drafts_never_gets_one():
    model = ScriptedModel({b"ab ab ab ab": list(b" ab ab ab ab ab ab")}, max_num_seqs=2)
    assert not model.capabilities.verifies_drafts
    scheduler = Scheduler(
        capabilities=model.capabilities,
        tokenizer=model.tokenizer,
        policy=ContinuousBatching(),
        metrics=EngineMetrics(),
        release_slot=model.release,
        max_num_batched_tokens=64,
        speculation=_always(4),
    )
    seq, sink = make_sequence(_request("r", b"ab ab ab ab", max_tokens=12))
    scheduler.add(seq)
    run_until_idle(scheduler, model)
    assert len(sink.final.token_ids) == 12
    assert all(row.num_draft_tokens == 0 for step in model.steps for row in step.rows)


def test_a_cost_that_spiked_ages_out_instead_of_holding_drafts_back_for_good():
    """The failing input: a fresh server's first drafted steps at one row spiked (a shared
    machine), so the median cost (1.19) beat a copying row's acceptance (1.0), no row drafted,
    no new sample came, and drafting was off for the server's life. Held steps now age the
    samples out: the oldest goes after ``HOLD_PATIENCE`` of them."""
    costs = DraftCosts(((1, 0.04),))
    for _ in range(MIN_PLAIN_SAMPLES):
        costs.observe(1, 0, 0.010)
    for seconds in (0.1728, 0.0148, 0.0236, 0.0916):  # 4.07, 0.12, 0.34, 2.04 a token
        costs.observe(1, 4, seconds)
    assert costs.measured(1) and costs.cost(1) > 1.0
    speculation = NgramSpeculation(4)
    seq, _ = make_sequence(_request("r", b"ab ab ab ab ab ab ab "))
    seq.draft_acceptance = 1.0
    for _ in range(HOLD_PATIENCE - 1):
        assert speculation.worth(seq, costs.cost(1)) == 0
        costs.drafted_at_cost(1, drafted=False)
    assert costs.cost(1) > 1.0
    costs.drafted_at_cost(1, drafted=False)  # the HOLD_PATIENCE-th: the oldest spike goes
    assert costs.cost(1) == pytest.approx(0.34)
    assert speculation.worth(seq, costs.cost(1)) == 4


def test_a_cost_that_is_really_high_is_probed_more_and_more_rarely():
    costs = DraftCosts(((1, 0.04),))
    for _ in range(MIN_PLAIN_SAMPLES):
        costs.observe(8, 0, 0.010)
    for _ in range(COST_SAMPLES):
        costs.observe(8, 8, 0.020)  # each drafted token costs a row
    drops = []
    for step in range(1, 16 * HOLD_PATIENCE):
        before = len(costs._samples[costs.row_class(8)])
        costs.drafted_at_cost(8, drafted=False)
        if len(costs._samples[costs.row_class(8)]) < before:
            drops.append(step)
    assert drops[:4] == [HOLD_PATIENCE, 3 * HOLD_PATIENCE, 7 * HOLD_PATIENCE, 15 * HOLD_PATIENCE]
    costs.drafted_at_cost(8, drafted=True)  # drafting resumed: the wait starts over
    for _ in range(HOLD_PATIENCE):
        costs.drafted_at_cost(8, drafted=False)
    assert len(costs._samples[costs.row_class(8)]) == COST_SAMPLES - 5


class _SpikedModel(_ClockedModel):
    """A ``_ClockedModel`` whose drafted steps numbered in ``spiked`` take ``spike`` seconds
    more (a shared machine's burst while a fresh server first measures the cost)."""

    def __init__(self, model: MockModelRunner, spiked: set[int], spike: float) -> None:
        super().__init__(model, base=0.01, per_position=0.0001)
        self.spiked = spiked
        self.spike = spike
        self.drafted_steps = 0

    def step(self, batch):
        if any(row.num_draft_tokens for row in batch.rows):
            if self.drafted_steps in self.spiked:
                self.now += self.spike
            self.drafted_steps += 1
        return super().step(batch)


def test_one_row_drafts_again_after_its_first_drafted_steps_spiked():
    """Through the scheduler: two of the first three drafted steps spike, so the measured
    cost (samples 4.96, 0.01, 9.91) is above any acceptance. Before the ageing rule the row
    drafted 3 times in 300 steps; now it drafts again once the spikes age out."""
    model = MockModelRunner(
        max_num_seqs=1, context_length=512, kv_blocks=400, eos_one_in=1000, order=3
    )
    clocked = _SpikedModel(model, spiked={0, 2}, spike=0.2)
    scheduler, _ = _clocked_scheduler(model, clocked, NgramSpeculation(4))
    seq, sink = make_sequence(_request("r", b"ab ab ab ab ab ab ab ", max_tokens=300))
    scheduler.add(seq)
    steps = run_until_idle(scheduler, clocked)
    assert len(sink.final.token_ids) == 300
    assert clocked.drafted_steps > 20, "drafting stopped for good after the spikes"
    assert steps < 200


def test_only_a_step_whose_every_eligible_row_the_cost_held_back_ages_the_cost():
    """One row held back by the cost beside one that would draft but finds no n-gram: the
    cost did not hold that step back, so its samples stay."""
    costs = DraftCosts(((1, 0.04),))
    for _ in range(MIN_PLAIN_SAMPLES):
        costs.observe(2, 0, 0.010)
    for _ in range(MIN_COST_SAMPLES):
        costs.observe(2, 4, 0.015)  # a drafted token costs a quarter of a row
    speculation = NgramSpeculation(4)
    capabilities = MockModelRunner(max_num_seqs=2).capabilities
    unmatched, _ = make_sequence(_request("a", bytes(range(65, 91))))  # no token repeats
    unmatched.draft_acceptance = 0.9
    doubtful, _ = make_sequence(_request("b", b"ab ab ab ab ab ab ab "))
    doubtful.draft_acceptance = 0.1
    for _ in range(2 * HOLD_PATIENCE):
        drafts = speculation.drafts([unmatched, doubtful], 64, capabilities, None, costs)
        assert drafts == [(), ()]
    assert costs.cost(2) == pytest.approx(0.25)
    for _ in range(HOLD_PATIENCE):  # both held back by the cost: now it ages
        speculation.drafts([doubtful, doubtful], 64, capabilities, None, costs)
    assert len(costs._samples[costs.row_class(2)]) == MIN_COST_SAMPLES - 1
