"""The scheduler's KV side: which sequence's blocks fit, grow, are committed, and who yields.

A paged model (``ModelCapabilities.paged``) makes KV blocks a second resource beside the slots,
and this module is the one owner of the scheduler's decisions about them (rule R12 keeps the
logical KV state on the scheduler's side, apart from the model's tensors):

* **admission by blocks**: a waiting sequence enters only when the blocks of what it must
  prefill fit, its cached prefix reused; the prefix-cache metrics are counted here, at the
  admission that looked the prefix up;
* **growth**: before each step every decoding sequence, oldest first, gets the block its next
  position needs; while none is free the newest running sequence is chosen to yield
  (preemption by recompute, vLLM's default);
* **commit**: after a step that filled a block, the now-full blocks are registered in the cache
  (never before the step completed);
* **release**: a sequence's blocks are let go.

Why a class of its own and not more methods on :class:`app.engine.kv_blocks.BlockManager`: the
block manager is the mechanism (free list, reference counts, tables, hash chains) over owners
of any kind and knows nothing of sequences, metrics or scheduling; keeping it so keeps it
testable on its own (``tests/engine/test_kv_blocks.py``) and keeps policy apart from resource
operations (rule R04). What this class adds is exactly the policy that reads a ``Sequence``:
which tokens it must prefill, its salt, which sequence grows first and which one yields.

It does not suspend a victim itself: the queue transition and the cleanup stay with the
scheduler, whose ``_preempt`` it is handed (``grow_decoding(..., preempt=...)``); that goes
through the scheduler's one ``_release`` (shared with ``finish``, rule R16), which calls back
:meth:`KVAdmission.free`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from app.engine.kv_blocks import Admission, BlockManager
from app.engine.metrics import EngineMetrics
from app.engine.request import Sequence, SequenceStatus
from app.engine.step_rows import prefix_salt
from app.models.base import ModelCapabilities

if TYPE_CHECKING:
    from app.engine.lookahead import Following


class KVAdmission:
    """Admission, growth, commit and release of a paged model's KV blocks, for the scheduler.

    Args:
        blocks: the block manager of the model's pool (owned from here on).
        metrics: where the prefix-cache counters go (``slotserve_prefix_cache_*``).

    Attributes:
        blocks: the block manager; the scheduler's rows read its tables (``table``), metrics
            its ``usage``; only this class changes it.
    """

    __slots__ = ("_block_size", "_metrics", "blocks")

    def __init__(self, blocks: BlockManager, metrics: EngineMetrics) -> None:
        self.blocks = blocks
        self._metrics = metrics
        self._block_size = blocks.block_size

    @classmethod
    def for_model(
        cls, capabilities: ModelCapabilities, metrics: EngineMetrics, *, prefix_caching: bool
    ) -> KVAdmission:
        """The KV side of a paged model's scheduler; also registers the KV usage gauge.

        Raises:
            ValueError: the pool cannot hold one sequence of the model's context length.
        """
        blocks = BlockManager.for_model(capabilities, prefix_caching=prefix_caching)
        metrics.track_kv_cache(lambda: blocks.usage)
        return cls(blocks, metrics)

    def admit(self, seq: Sequence) -> Admission:
        """Blocks for what waiting ``seq`` must prefill (``seq.num_prefill_tokens``: its prompt,
        plus what it generated before a preemption but the last token).

        Returns:
            ``BlockManager.admit``'s outcome: admitted with the positions already computed
            (counted in the prefix-cache metrics), ``NO_ROOM`` (admission should stop, FIFO)
            or ``PREFIX_IN_FLIGHT`` (it keeps its place and tries after the running sequence
            computing its prefix); nothing changes unless admitted.
        """
        blocks = self.blocks
        tokens = seq.all_token_ids()[: seq.num_prefill_tokens]
        admission = blocks.admit(seq, tokens, prefix_salt(seq))
        if admission.admitted and blocks.prefix_caching:
            self._metrics.prefix_cache_queries.inc(len(tokens))
            self._metrics.prefix_cache_hits.inc(admission.num_cached_tokens)
        return admission

    def grow_decoding(
        self, running: Iterable[Sequence], *, preempt: Callable[[Sequence], None]
    ) -> None:
        """Gives each decoding sequence of ``running``, oldest admitted first, the block its
        next position (``num_computed_tokens``) needs. While no block is free the newest
        running sequence yields, possibly the one growing: ``preempt(victim)`` must release
        its blocks (through :meth:`free`) and take it out of the running ones (its status no
        longer ``RUNNING``)."""
        grow = self.blocks.grow
        by_age = sorted(running, key=admission_time)
        for seq in by_age:
            if seq.is_prefilling or seq.status is not SequenceStatus.RUNNING:
                continue
            while not grow(seq, seq.num_computed_tokens + 1):
                victim = next(s for s in reversed(by_age) if s.status is SequenceStatus.RUNNING)
                preempt(victim)
                if victim is seq:
                    break

    def grow_following(self, following: list[Following]) -> bool:
        """Blocks for the rows of a step built ahead (``following_sequences``: each sequence
        with its row's position), from free blocks only; False when they do not all fit
        (those that did keep their blocks: the next step needs them anyway)."""
        grow = self.blocks.grow
        return all(grow(seq, position + 1) for seq, position, _ in following)

    def grow_draft(self, seq: Sequence, num_draft_tokens: int) -> int:
        """Blocks for a speculative row of decoding ``seq`` (its next position and
        ``num_draft_tokens`` after it), from free blocks only: a draft never preempts.

        Returns:
            The drafted tokens that fit (the table's room after the next position when the
            free blocks do not cover all of them).
        """
        blocks = self.blocks
        needed = seq.num_computed_tokens + 1 + num_draft_tokens
        if blocks.grow(seq, needed):
            return num_draft_tokens
        room = len(blocks.table(seq)) * self._block_size - seq.num_computed_tokens - 1
        return max(0, min(num_draft_tokens, room))

    def rollback(self, seq: Sequence) -> None:
        """After a speculative row: the blocks past what ``seq``'s next position needs (those
        of rejected drafted positions) are let go. The positions themselves are stale and
        never read (the next row starts at ``num_computed_tokens``); no block holding them
        was registered, since ``commit_filled`` counts accepted positions only."""
        self.blocks.shrink(seq, seq.num_computed_tokens + 1)

    def commit_filled(
        self, seq: Sequence, new_tokens: int, accepted_draft: tuple[int, ...] = ()
    ) -> None:
        """After a completed step that computed ``new_tokens`` positions of ``seq`` (its
        ``num_computed_tokens`` already advanced): registers its blocks that step filled, if
        any. ``accepted_draft``: the drafted tokens the step accepted, computed but not yet
        appended to ``seq`` (a rejected position is never committed). A cheap test first,
        inline: it runs for every row of every step."""
        computed = seq.num_computed_tokens
        size = self._block_size
        if computed // size > (computed - new_tokens) // size:  # a block boundary was crossed
            self.blocks.commit(seq, seq.all_token_ids() + accepted_draft, computed)

    def free(self, seq: Sequence) -> None:
        """Lets go of ``seq``'s blocks and prompt hashes; a no-op when it holds none."""
        self.blocks.free(seq)


def admission_time(seq: Sequence) -> float:
    """The key that orders sequences oldest admitted first (never admitted: first of all)."""
    return seq.admitted_at or 0.0
