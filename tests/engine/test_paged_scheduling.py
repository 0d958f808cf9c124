"""The scheduler over a paged model: admission by blocks, prefix caching, preemption, cleanup.

The paged mock (``MockModelRunner(kv_blocks=...)``) keeps the tokens of every block and reads a
cached prefix back from the blocks a row names, and its next token depends only on the prefix it
read: a wrong block table, a stale block or a half-written cached block changes its output. So
"same outputs with caching on, off, and without paging at all" is the oracle here.
"""

from __future__ import annotations

import random

import pytest

from app.engine.metrics import EngineMetrics
from app.engine.policy import ContinuousBatching
from app.engine.request import FinishReason, SequenceStatus
from app.engine.scheduler import Scheduler
from app.models.mock import MOCK_KV_BLOCK_SIZE, MockModelRunner
from tests.engine.conftest import make_request, make_sequence

BS = MOCK_KV_BLOCK_SIZE


def _scheduler(
    *,
    kv_blocks: int | None,
    caching: bool = True,
    slots: int = 8,
    chunk: int | None = None,
    context: int = 512,
) -> tuple[Scheduler, MockModelRunner, EngineMetrics]:
    model = MockModelRunner(
        max_num_seqs=slots,
        context_length=context,
        kv_blocks=kv_blocks,
        eos_one_in=1000,
        max_tokens_per_row=chunk,
    )
    metrics = EngineMetrics()
    caps = model.capabilities
    scheduler = Scheduler(
        capabilities=caps,
        tokenizer=model.tokenizer,
        policy=ContinuousBatching(),
        metrics=metrics,
        release_slot=model.release,
        max_num_batched_tokens=max(caps.max_num_seqs, caps.max_tokens_per_row),
        prefix_caching=caching,
    )
    return scheduler, model, metrics


def _drive(scheduler: Scheduler, model: MockModelRunner, max_steps: int = 20_000) -> list[int]:
    """Runs until idle; returns the prompt tokens fed in each step (prefill rows only)."""
    fed: list[int] = []
    while scheduler.has_work:
        scheduler.admit_waiting()
        step = scheduler.schedule()
        assert step is not None, "work left but nothing scheduled"
        fed.append(sum(len(r.token_ids) for r in step.live_rows if len(r.token_ids) > 1))
        scheduler.apply(step, model.step(step.batch))
        assert len(fed) < max_steps, "loop does not terminate"
    return fed


def _run(prompts: list[bytes], max_tokens: int = 40, **options) -> tuple[list, list[int], object]:
    scheduler, model, metrics = _scheduler(**options)
    sinks = []
    for index, prompt in enumerate(prompts):
        seq, sink = make_sequence(make_request(f"r{index}", prompt, max_tokens=max_tokens))
        scheduler.add(seq)
        sinks.append(sink)
    fed = _drive(scheduler, model)
    if scheduler.kv_blocks is not None:
        scheduler.kv_blocks.check()
        assert scheduler.kv_blocks.num_used_blocks == 0, "leaked blocks"
    return [sink.final.token_ids for sink in sinks], fed, metrics


def _counter(metrics: EngineMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    return 0.0 if value is None else value


SYSTEM = b"You are a careful assistant. Answer briefly and cite nothing you cannot check. " * 2


def test_same_outputs_with_caching_on_off_and_unpaged() -> None:
    rng = random.Random(7)
    prompts = [SYSTEM + f"question {i}: {rng.random():.6f}".encode() for i in range(12)]
    prompts += [SYSTEM[: BS * 3], SYSTEM[: BS * 3 + 1], b"x"]  # on and around block boundaries
    unpaged, _, _ = _run(prompts, kv_blocks=None)
    off, fed_off, _ = _run(prompts, kv_blocks=400, caching=False)
    on, fed_on, metrics = _run(prompts, kv_blocks=400)
    assert on == off == unpaged
    assert sum(fed_on) < sum(fed_off)
    hits = _counter(metrics, "slotserve_prefix_cache_hits_total")
    queries = _counter(metrics, "slotserve_prefix_cache_queries_total")
    assert queries == sum(len(p) for p in prompts)
    assert hits >= 11 * (len(SYSTEM) // BS) * BS  # every request after the first


def test_multi_turn_reuses_the_conversation_so_far() -> None:
    scheduler, model, metrics = _scheduler(kv_blocks=200)
    history = SYSTEM
    cached = []
    for turn in range(4):
        history += f"\nuser: turn {turn}, go on\nassistant:".encode()
        seq, sink = make_sequence(make_request(f"t{turn}", history, max_tokens=24))
        scheduler.add(seq)
        _drive(scheduler, model)
        cached.append(seq.num_cached_tokens)
        reference, _, _ = _run([history], max_tokens=24, kv_blocks=None)
        assert list(sink.final.token_ids) == list(reference[0])
        history += bytes(t for t in sink.final.token_ids if t < 256)
    assert cached[0] == 0
    # Each later turn hits the previous prompt and most of its answer (the answer's last
    # token was sampled, never computed; the last partial block is not cached).
    assert all(hit >= len(SYSTEM) // BS * BS for hit in cached[1:])
    assert scheduler.kv_blocks is not None and scheduler.kv_blocks.num_used_blocks == 0


def test_a_shared_prefix_of_concurrent_requests_is_computed_once() -> None:
    prefix = bytes(range(65, 65 + 26)) * 4  # 104 bytes: 6 full blocks and a part
    prompts = [prefix + f"#{i}".encode() for i in range(8)]
    on, fed_on, _ = _run(prompts, kv_blocks=400)
    off, fed_off, _ = _run(prompts, kv_blocks=400, caching=False)
    assert on == off
    assert sum(fed_off) == sum(len(p) for p in prompts)
    full = len(prefix) // BS * BS
    assert sum(fed_on) == sum(len(p) for p in prompts) - 7 * full


def test_preemption_under_a_tiny_pool_loses_and_repeats_nothing() -> None:
    """8 sequences that each grow to ~6 blocks in a pool of 24: decode runs out of blocks, the
    newest sequences go back to the queue and recompute; every output is the same as with a
    pool that never runs out, and every stream carries each token exactly once."""
    prompts = [f"prompt number {i} ".encode() * 2 for i in range(8)]
    roomy, _, _ = _run(prompts, max_tokens=60, kv_blocks=None)
    for caching in (True, False):
        scheduler, model, metrics = _scheduler(kv_blocks=25, caching=caching, context=128)
        sinks = []
        for index, prompt in enumerate(prompts):
            seq, sink = make_sequence(make_request(f"r{index}", prompt, max_tokens=60))
            scheduler.add(seq)
            sinks.append(sink)
        _drive(scheduler, model)
        assert _counter(metrics, "slotserve_preemptions_total") > 0
        for sink, expected in zip(sinks, roomy, strict=True):
            assert sink.final.token_ids == expected
            assert sink.streamed_ids == list(expected)  # no token lost or sent twice
        assert scheduler.kv_blocks is not None
        scheduler.kv_blocks.check()
        assert scheduler.kv_blocks.num_used_blocks == 0


def test_admission_waits_for_blocks_and_the_pool_must_hold_one_sequence() -> None:
    scheduler, model, _ = _scheduler(kv_blocks=9, context=128)  # 8 usable = one sequence
    first, _ = make_sequence(make_request("a", b"a" * 100, max_tokens=8))
    second, _ = make_sequence(make_request("b", b"b" * 100, max_tokens=8))
    scheduler.add(first)
    scheduler.add(second)
    assert scheduler.admit_waiting() == 1
    assert second.status is SequenceStatus.WAITING
    with pytest.raises(ValueError, match="less than one sequence"):
        _scheduler(kv_blocks=8, context=128)


def test_a_step_cancelled_mid_prefill_leaves_nothing_half_valid() -> None:
    """The cancel lands while the step runs: its output is dropped, its blocks are freed
    unregistered, and the next request with that prompt recomputes what that step wrote."""
    scheduler, model, _ = _scheduler(kv_blocks=100, chunk=32)
    prompt = bytes(range(97, 123)) * 4  # 104 bytes: four chunks of 32
    seq, sink = make_sequence(make_request("a", prompt))
    scheduler.add(seq)
    scheduler.admit_waiting()
    step = scheduler.schedule()
    assert step is not None
    scheduler.apply(step, model.step(step.batch))  # chunk 1 completed: 2 blocks committed
    step = scheduler.schedule()
    assert step is not None
    output = model.step(step.batch)  # chunk 2 written...
    scheduler.cancel(seq)  # ...but cancelled before its output is applied
    scheduler.apply(step, output)
    assert sink.final.finish_reason is FinishReason.CANCELLED
    again, _ = make_sequence(make_request("a", prompt))  # the same id, a new request
    scheduler.add(again)
    scheduler.admit_waiting()
    assert again.num_cached_tokens == 32
    _drive(scheduler, model)
    expected, _, _ = _run([prompt], kv_blocks=None, max_tokens=16)
    assert again.generated == list(expected[0])
    assert scheduler.kv_blocks is not None and scheduler.kv_blocks.num_used_blocks == 0


def test_random_submit_cancel_finish_never_leaks_blocks() -> None:
    rng = random.Random(11)
    scheduler, model, metrics = _scheduler(kv_blocks=40, slots=6, chunk=24, context=128)
    stems = [SYSTEM[:40], SYSTEM[10:60], b"zz" * 20]
    live = []
    for number in range(300):
        action = rng.random()
        if action < 0.3:
            prompt = rng.choice(stems)[: rng.randint(1, 40)] + bytes([97 + number % 26])
            seq, _ = make_sequence(make_request(f"r{number % 7}", prompt, max_tokens=30))
            scheduler.add(seq)
            live.append(seq)
        elif action < 0.4 and live:
            scheduler.cancel(live.pop(rng.randrange(len(live))))
        scheduler.admit_waiting()
        step = scheduler.schedule()
        if step is not None:
            output = model.step(step.batch)
            if action > 0.95 and live:
                scheduler.cancel(rng.choice(live))  # during the step
            scheduler.apply(step, output)
        assert scheduler.kv_blocks is not None
        scheduler.kv_blocks.check()
    _drive(scheduler, model)
    assert scheduler.kv_blocks.num_used_blocks == 0
    assert _counter(metrics, "slotserve_kv_cache_usage_ratio") == 0.0
