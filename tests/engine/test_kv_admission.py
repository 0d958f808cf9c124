"""KVAdmission, the scheduler's KV side, on its own: admission with the prefix-cache metrics,
commit only when a step filled a block, and growth that makes the newest running sequence
yield through the callback it is handed (the scheduler's ``_preempt``)."""

from __future__ import annotations

from app.engine.kv_admission import KVAdmission
from app.engine.kv_blocks import PREFIX_IN_FLIGHT, Admission, AdmitOutcome, BlockManager
from app.engine.metrics import EngineMetrics
from app.engine.request import Sequence, SequenceStatus
from tests.engine.conftest import make_request, make_sequence

BS = 4


def _kv(usable_blocks: int) -> tuple[KVAdmission, EngineMetrics]:
    metrics = EngineMetrics()
    blocks = BlockManager(num_blocks=1 + usable_blocks, block_size=BS, prefix_caching=True)
    return KVAdmission(blocks, metrics), metrics


def _counter(metrics: EngineMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    return 0.0 if value is None else value


def _running(kv: KVAdmission, name: str, prompt: bytes, admitted_at: float) -> Sequence:
    """A sequence admitted, its prompt computed, one token sampled: decoding."""
    seq, _ = make_sequence(make_request(name, prompt))
    assert kv.admit(seq) == Admission(AdmitOutcome.ADMITTED, 0)
    seq.status = SequenceStatus.RUNNING
    seq.admitted_at = admitted_at
    seq.num_computed_tokens = len(prompt)
    seq.generated.append(65)
    return seq


def test_admission_counts_the_prefix_cache_and_reuses_what_was_committed() -> None:
    kv, metrics = _kv(usable_blocks=8)
    first, _ = make_sequence(make_request("a", b"abcdefghi"))  # 9 tokens: 3 blocks
    assert kv.admit(first) == Admission(AdmitOutcome.ADMITTED, 0)
    assert kv.blocks.table(first) and len(kv.blocks.table(first)) == 3
    assert _counter(metrics, "slotserve_prefix_cache_queries_total") == 9
    assert _counter(metrics, "slotserve_prefix_cache_hits_total") == 0
    # Its first block is being computed: a second sequence with the same prompt waits for it.
    second, _ = make_sequence(make_request("b", b"abcdefghi"))
    assert kv.admit(second) == PREFIX_IN_FLIGHT
    assert not kv.blocks.holds(second)
    assert _counter(metrics, "slotserve_prefix_cache_queries_total") == 9  # not counted

    first.num_computed_tokens = 9
    kv.commit_filled(first, 9)
    assert kv.blocks.num_cached_blocks == 2  # the two full blocks; the third holds one token
    assert kv.admit(second) == Admission(AdmitOutcome.ADMITTED, 2 * BS)
    assert _counter(metrics, "slotserve_prefix_cache_queries_total") == 18
    assert _counter(metrics, "slotserve_prefix_cache_hits_total") == 8
    kv.free(first)
    kv.free(second)
    kv.blocks.check()
    assert kv.blocks.num_used_blocks == 0


def test_commit_only_when_the_step_crossed_a_block_boundary() -> None:
    kv, _ = _kv(usable_blocks=8)
    seq, _ = make_sequence(make_request("a", b"abcdefghijkl"))  # 12 tokens
    assert kv.admit(seq) == Admission(AdmitOutcome.ADMITTED, 0)
    for computed, new_tokens, cached in ((3, 3, 0), (5, 2, 1), (7, 2, 1), (8, 1, 2), (12, 4, 3)):
        seq.num_computed_tokens = computed
        kv.commit_filled(seq, new_tokens)
        assert kv.blocks.num_cached_blocks == cached, (computed, new_tokens)
    kv.blocks.check()


def test_growth_makes_the_newest_running_sequence_yield() -> None:
    kv, _ = _kv(usable_blocks=4)
    old = _running(kv, "old", b"abcd", admitted_at=1.0)
    new = _running(kv, "new", b"wxyz", admitted_at=2.0)
    preempted: list[Sequence] = []

    def preempt(victim: Sequence) -> None:
        kv.free(victim)
        victim.status = SequenceStatus.WAITING
        preempted.append(victim)

    kv.grow_decoding([new, old], preempt=preempt)  # position 4: a second block each
    assert preempted == [] and kv.blocks.num_free_blocks == 0
    old.num_computed_tokens = new.num_computed_tokens = 8  # position 8: a third block each
    kv.grow_decoding([new, old], preempt=preempt)
    assert preempted == [new], "the newest yields, the oldest grows first"
    assert len(kv.blocks.table(old)) == 3 and not kv.blocks.holds(new)
    kv.blocks.check()


def test_a_sequence_that_is_itself_the_newest_yields_itself() -> None:
    kv, _ = _kv(usable_blocks=3)
    other, _ = make_sequence(make_request("other", b"0123456"))
    # 2 blocks, held by a sequence that is not running
    assert kv.admit(other) == Admission(AdmitOutcome.ADMITTED, 0)
    solo = _running(kv, "solo", b"abcd", admitted_at=1.0)  # the last block
    preempted: list[Sequence] = []

    def preempt(victim: Sequence) -> None:
        kv.free(victim)
        victim.status = SequenceStatus.WAITING
        preempted.append(victim)

    kv.grow_decoding([solo], preempt=preempt)
    assert preempted == [solo]
    assert kv.blocks.table(other) and not kv.blocks.holds(solo)
    kv.blocks.check()
