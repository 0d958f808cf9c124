"""The rows the scheduler hands the model for its sequences, and which waiting ones go together.

Pure functions of a sequence's state (and the block manager's tables): the scheduler decides
who runs; these say what each row carries (tokens, position, sampling, the constraint's mask,
the block table). See ``app.engine.scheduler``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from app.engine.kv_blocks import BlockManager
from app.engine.kv_hash_chain import SALT_ANY, SALT_EXACT
from app.engine.request import Sequence
from app.models.base import (
    KVBlocks,
    SamplingParams,
    StepBatch,
    StepOutput,
    StepRow,
    TokenLogprobs,
)


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    """A batch handed to the model plus the sequences it was built for.

    ``sequences[i]`` is the sequence of ``batch.rows[i]``. For a model with a fixed batch
    shape the rows after ``len(sequences)`` are inert padding (``StepRow.padding``): no
    sequence stands behind them, so their outputs can reach no request. ``pending``: one
    entry for each row built before the previous step's tokens were known (they come first:
    ``pending[i]`` is row i's), whose token the model thread fills in; the entry is the set of
    tokens that end the row's sequence if the previous step sampled one (the row is then
    left inert, :mod:`app.engine.lookahead`). Empty for a step built after the previous one.
    """

    batch: StepBatch
    sequences: tuple[Sequence, ...]
    pending: tuple[frozenset[int], ...] = ()

    @property
    def live_rows(self) -> tuple[StepRow, ...]:
        """The rows built for ``sequences`` (every row but the padding), same order."""
        return self.batch.rows[: len(self.sequences)]


class RowResult(NamedTuple):
    """What one live row of a step produced, for its sequence.

    Attributes:
        sequence / row: the sequence the row was built for, and the row.
        token_ids: the tokens to append, in order: none (a prompt chunk that samples
            nothing, or a failed row), the one sampled, or an accepted draft's tokens followed
            by the model's own.
        logprobs: one entry per ``token_ids`` entry when the request asked, else None.
        prompt_logprobs: the chunk's prompt logprobs, when asked.
        error: a client-safe message when the row failed.
        num_accepted: drafted tokens accepted (0 without a draft).
    """

    sequence: Sequence
    row: StepRow
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None
    error: str | None
    num_accepted: int

    @property
    def num_computed(self) -> int:
        """Positions of the row the sequence keeps: its tokens less the rejected draft."""
        return len(self.row.token_ids) - self.row.num_draft_tokens + self.num_accepted


def row_results(step: ScheduledStep, output: StepOutput) -> list[RowResult]:
    """``output`` read row by row for the step's sequences (the padding's outputs dropped).

    Raises:
        ValueError: ``output`` does not have one result per row, or a row accepted more
            drafted tokens than it had (or fewer than none).
    """
    if len(output.rows) != len(step.batch.rows):
        raise ValueError(
            f"model returned {len(output.rows)} results for {len(step.batch.rows)} rows"
        )
    results = []
    append = results.append
    live = zip(step.sequences, step.live_rows, output.rows[: len(step.sequences)], strict=True)
    for index, (seq, row, out) in enumerate(live):
        token, accepted, logprobs = out.token_id, out.num_accepted, out.logprobs
        if row.num_draft_tokens:
            if not 0 <= accepted <= row.num_draft_tokens:
                raise ValueError(f"row {index}: {accepted} accepted of {row.num_draft_tokens}")
            token_ids = () if token is None else (*row.draft_token_ids[:accepted], token)
            if logprobs is not None:
                logprobs = (*(out.draft_logprobs or ()), logprobs)
        elif accepted:
            raise ValueError(f"row {index}: {accepted} accepted of 0")
        else:  # an ordinary row (positional fields: a row's result is built every step)
            token_ids = () if token is None else (token,)
            if logprobs is not None:
                logprobs = (logprobs,)
        append(RowResult(seq, row, token_ids, logprobs, out.prompt_logprobs, out.error, accepted))
    return results


def _plain_decode_row_constructor() -> Callable[..., StepRow]:
    """A constructor of ordinary decode rows that sets ``StepRow``'s slots directly.

    The frozen dataclass's ``__init__`` sets each of its nine fields through
    ``object.__setattr__``, about 1.1 us a row on the AMD EPYC; this costs 0.6. A decode row
    is built once a step for every running sequence (twice for a step built ahead, once on
    each thread), so at 256 slots that is ~0.25 ms of the loop's GIL a step. The row is as
    frozen as any other.

    Raises:
        TypeError: ``StepRow``'s fields are not the nine this sets (a field was added), or
            it gained a ``__post_init__`` this would skip.
    """
    names = ("slot", "token_ids", "position", "sample", "sampling", "inert", "token_mask")
    names += ("kv_blocks", "num_draft_tokens")
    if tuple(f.name for f in fields(StepRow)) != names or hasattr(StepRow, "__post_init__"):
        raise TypeError("StepRow's fields or checks changed: update _plain_decode_row_constructor")
    setters = tuple(StepRow.__dict__[name].__set__ for name in names)
    set_slot, set_tokens, set_position, set_sample, set_sampling = setters[:5]
    set_inert, set_mask, set_blocks, set_drafts = setters[5:]
    new = object.__new__

    def plain_decode_row(
        slot: int,
        token_ids: tuple[int, ...],
        position: int,
        sampling: SamplingParams,
        kv_blocks: KVBlocks | None,
    ) -> StepRow:
        row = new(StepRow)
        set_slot(row, slot)
        set_tokens(row, token_ids)
        set_position(row, position)
        set_sample(row, True)
        set_sampling(row, sampling)
        set_inert(row, False)
        set_mask(row, None)
        set_blocks(row, kv_blocks)
        set_drafts(row, 0)
        return row

    return plain_decode_row


plain_decode_row = _plain_decode_row_constructor()
"""``plain_decode_row(slot, token_ids, position, sampling, kv_blocks)`` equals
``StepRow(slot, token_ids, position, True, sampling, kv_blocks=kv_blocks)``: a row that
samples, without a constraint's mask or a draft, built at half the cost."""


def decode_row(seq: Sequence, kv: BlockManager | None, draft: tuple[int, ...] = ()) -> StepRow:
    """The row of a decoding sequence: the one token sampled last step, sampled again; with
    a speculative ``draft``, those tokens after it, to verify (``num_draft_tokens``). Looks
    up only what the row has (a mask when constrained, a table when paged): it runs once per
    decoding row and step, on the loop's critical path."""
    matcher = seq.matcher
    if matcher is None and not draft:
        kv_blocks = None if kv is None else kv_blocks_of(seq, kv)
        return plain_decode_row(
            slot_of(seq),
            (seq.generated[-1],),
            seq.num_computed_tokens,
            seq.request.sampling,
            kv_blocks,
        )
    return StepRow(
        slot_of(seq),
        (seq.generated[-1], *draft) if draft else (seq.generated[-1],),
        seq.num_computed_tokens,
        True,
        seq.request.sampling,
        token_mask=None if matcher is None else matcher.next_mask(),
        kv_blocks=None if kv is None else kv_blocks_of(seq, kv),
        num_draft_tokens=len(draft),
    )


def decode_rows(
    sequences: list[Sequence], kv: BlockManager | None, drafts: list[tuple[int, ...]]
) -> list[StepRow]:
    """``decode_row`` of each decoding sequence with its draft (``drafts[i]`` for
    ``sequences[i]``, () for none), in order: the step's decode rows."""
    return [decode_row(seq, kv, draft) for seq, draft in zip(sequences, drafts, strict=True)]


def prefill_row(
    seq: Sequence, budget: int, max_tokens_per_row: int, kv: BlockManager | None
) -> StepRow:
    """The next prompt chunk of a prefilling sequence, at most ``budget`` and
    ``max_tokens_per_row`` tokens; it samples when it ends the prompt (not for a request that
    only scores its prompt, nor after a preemption, whose last generated token the next decode
    row feeds)."""
    start = seq.num_computed_tokens
    target = seq.num_prefill_tokens
    length = min(target - start, budget, max_tokens_per_row)
    sample = start + length == target and not seq.generated and not seq.scores_prompt_only
    return StepRow(
        slot=slot_of(seq),
        token_ids=seq.all_token_ids()[start : start + length],
        position=start,
        sample=sample,
        sampling=seq.request.sampling,
        token_mask=next_token_mask(seq) if sample else None,
        kv_blocks=kv_blocks_of(seq, kv),
    )


def prefill_rows(
    prefilling: list[Sequence], budget: int, max_tokens_per_row: int, kv: BlockManager | None
) -> list[StepRow]:
    """The next prompt chunk of each of ``prefilling``, in order, while ``budget`` tokens
    last (``prefill_row``); ``rows[i]`` is ``prefilling[i]``'s."""
    rows = []
    for seq in prefilling:
        if budget <= 0:
            break
        row = prefill_row(seq, budget, max_tokens_per_row, kv)
        rows.append(row)
        budget -= len(row.token_ids)
    return rows


def padding_rows(rows: list[StepRow], num_slots: int) -> list[StepRow]:
    """An inert row for every slot of ``num_slots`` without one (a fixed batch shape)."""
    scheduled = {row.slot for row in rows}
    return [StepRow.padding(slot) for slot in range(num_slots) if slot not in scheduled]


def kv_blocks_of(seq: Sequence, kv: BlockManager | None) -> KVBlocks | None:
    """The row's block table (None without a paged model). A row that starts the sequence in
    its slot also carries what the model's per-sequence state must know of what it will not
    see fed: the cached prefix's tokens and the tokens generated before a preemption."""
    if kv is None:
        return None
    table = kv.table(seq)
    if seq.num_computed_tokens != seq.num_cached_tokens:
        return KVBlocks(table)
    return KVBlocks(
        table,
        starts_sequence=True,
        prefix_token_ids=seq.all_token_ids()[: seq.num_cached_tokens],
        generated_token_ids=tuple(seq.generated),
    )


def prefix_salt(seq: Sequence) -> bytes:
    """The salt of the sequence's block hashes: seeded (batch-invariant) and other requests
    never share blocks; a request for prompt logprobs has one of its own, since every prompt
    position must be computed to be scored (no cached prefix is found for it, and none it
    writes is found by others)."""
    if seq.request.sampling.prompt_logprobs is not None:
        return b"scored:" + seq.request_id.encode()
    return SALT_EXACT if seq.request.sampling.batch_invariant else SALT_ANY


def whole_groups(waiting: Iterable[Sequence], count: int) -> int:
    """``count`` cut back so that no group (the ``n`` choices of one prompt, queued one after
    another with one ``GenerationRequest.group_id``) is split between slots now and later: the
    first ``count`` waiting sequences, less a trailing group cut short."""
    taken = 0
    sequences = iter(waiting)
    pending = next(sequences, None)
    while pending is not None and taken < count:
        group = pending.request.group_id
        size = 1
        pending = next(sequences, None)
        while group is not None and pending is not None and pending.request.group_id == group:
            size += 1
            pending = next(sequences, None)
        if taken + size > count:
            break
        taken += size
    return taken


def next_token_mask(seq: Sequence) -> torch.Tensor | None:
    """The constraint's mask for the sequence's next token (None when unconstrained)."""
    return None if seq.matcher is None else seq.matcher.next_mask()


def slot_of(seq: Sequence) -> int:
    """The slot of a running sequence.

    Raises:
        RuntimeError: the sequence holds no slot.
    """
    if seq.slot is None:
        raise RuntimeError(f"request {seq.request_id} has no slot")
    return seq.slot
