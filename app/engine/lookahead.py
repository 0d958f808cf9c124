"""Step N+1 built while step N runs: rows whose token is the one step N is sampling.

A decoding row carries the token sampled the step before (``StepRow.token_ids``). To start
step N+1 the moment step N returns, the loop builds N+1 while N runs, before N's tokens are
known: each such row carries ``PENDING_TOKEN``, and the model thread, which runs the steps
one after another, puts step N's sampled token in its place just before calling the model
(:func:`filled_batch`), so the ``Model`` protocol and every model stay as they are. vLLM v1's
"async scheduling" and SGLang's overlap scheduler do the same with the sampled ids left on the
device; here they stay on the model thread.

Only the part of step N+1 that does not depend on step N's tokens can be built ahead, so a
step is built ahead only when every sequence in step N is a plain sampling row (no draft to
verify, no constraint whose next mask needs the token, no prompt chunk that leaves the
prompt unfinished) and every running sequence is in step N (:func:`following_sequences`).
What step N ends is not known yet when step N+1 is built. What it ends for certain
(``max_tokens``, the context) gets no row. A row whose sequence step N's token ends by itself
(an EOS, a stop token id: :func:`ending_tokens`) is left inert when the model thread fills it
in, and a step left with only inert rows does not call the model. What ends it otherwise (a
stop string, a cancel taken when step N returns) leaves a row that is computed and dropped
(rule R17). Either way the slot is refilled one step later than the non-overlapped loop would.
"""

from __future__ import annotations

import time

from app.engine.kv_blocks import BlockManager
from app.engine.request import Sequence, SequenceStatus, StopCriteria
from app.engine.slot_table import SlotTable
from app.engine.step_rows import (
    ScheduledStep,
    padding_rows,
    plain_decode_row,
    prefill_rows,
    slot_of,
)
from app.models.base import (
    KVBlocks,
    Model,
    ModelCapabilities,
    RowOutput,
    StepBatch,
    StepOutput,
    StepRow,
)

PENDING_TOKEN = -1
"""The token of a row built ahead, until the model thread puts step N's sample there."""


Following = tuple[Sequence, int, KVBlocks | None]
"""A sequence step N+1 continues, the position of its row there, and the block table its
row in step N carried (:func:`pending_row` keeps it when the table did not grow)."""


def following_sequences(
    running: ScheduledStep, slots: SlotTable, context_length: int
) -> list[Following] | None:
    """The sequences of ``running`` (step N) that step N+1 continues, each with the position
    of its row in step N+1 (and step N's block table: :data:`Following`), in step N's order;
    None when step N+1 cannot be built before step N's output is applied.

    None when a live row of step N is not a plain sampling row (a prompt chunk that does not
    end the prompt, a draft, a constraint's mask), or a running sequence has no row in step N
    (its prompt chunk did not fit the token budget). A sequence that step N ends for certain
    (its ``max_tokens``-th token, or the context full) is left out.
    """
    following: list[Following] = []
    in_step = 0
    for seq, row in zip(running.sequences, running.live_rows, strict=True):
        if not slots.holds(row.slot, seq) or seq.status is not SequenceStatus.RUNNING:
            continue
        in_step += 1
        if not row.sample or row.num_draft_tokens or seq.matcher is not None:
            return None
        generated = len(seq.generated) + 1  # with the token step N samples
        if (
            generated >= seq.request.max_tokens
            or seq.num_prompt_tokens + generated >= context_length
        ):
            continue
        following.append((seq, row.position + len(row.token_ids), row.kv_blocks))
    if in_step != slots.num_running:
        return None
    return following


def pending_row(
    seq: Sequence, position: int, kv: BlockManager | None, previous: KVBlocks | None = None
) -> StepRow:
    """The decode row of ``seq`` at ``position`` whose token step N is sampling
    (``PENDING_TOKEN`` until :func:`filled_batch`); its block table must already cover it.
    ``previous``, step N's block table for ``seq``, is reused when the table is the same (15
    decode steps in 16 at 16 positions a block) and it does not start the sequence."""
    blocks = None
    if kv is not None:
        table = kv.table(seq)
        reusable = previous is not None and not previous.starts_sequence
        blocks = previous if reusable and previous.block_ids == table else KVBlocks(table)
    return plain_decode_row(slot_of(seq), (PENDING_TOKEN,), position, seq.request.sampling, blocks)


def ending_tokens(stop: StopCriteria, eos_token_ids: frozenset[int]) -> frozenset[int]:
    """The tokens that end a sequence by themselves (``stop_conditions.token_ending`` for an
    unconstrained one): its stop token ids, and the model's EOS ids unless ``ignore_eos``."""
    if stop.ignore_eos:
        return stop.stop_token_ids
    return stop.stop_token_ids | eos_token_ids if stop.stop_token_ids else eos_token_ids


def ahead_step(
    following: list[Following],
    admitted: list[Sequence],
    kv: BlockManager | None,
    max_num_batched_tokens: int,
    capabilities: ModelCapabilities,
) -> ScheduledStep | None:
    """The step built ahead: a :func:`pending_row` for each of ``following``
    (:func:`following_sequences`), then prompt chunks of ``admitted`` (sequences that entered
    a slot while step N runs, in admission order) within the token budget, then, for a model
    with a fixed batch shape, padding. None when it holds no row."""
    rows = [pending_row(seq, position, kv, previous) for seq, position, previous in following]
    budget = max_num_batched_tokens - len(rows)
    chunks = prefill_rows(admitted, budget, capabilities.max_tokens_per_row, kv)
    if not rows and not chunks:
        return None
    sequences = (*(entry[0] for entry in following), *admitted[: len(chunks)])
    eos = capabilities.eos_token_ids
    pending = tuple(ending_tokens(entry[0].request.stop, eos) for entry in following)
    rows.extend(chunks)
    if capabilities.fixed_batch_shape:
        rows.extend(padding_rows(rows, capabilities.max_num_seqs))
    return ScheduledStep(StepBatch(tuple(rows)), sequences, pending)


def sampled_tokens(batch: StepBatch, output: StepOutput) -> dict[int, int]:
    """Slot -> the token a step sampled there (rows that sampled one)."""
    return {
        row.slot: out.token_id
        for row, out in zip(batch.rows, output.rows, strict=True)
        if out is not None and out.token_id is not None and row.sample
    }


def filled_batch(
    batch: StepBatch, pending: tuple[frozenset[int], ...], sampled: dict[int, int]
) -> StepBatch:
    """``batch`` with the token of each pending row (the first ``len(pending)``) taken from
    ``sampled`` (slot -> token, the previous step's :func:`sampled_tokens`). A row whose slot
    sampled nothing (its row failed, or the previous step raised: ``sampled`` empty) or
    sampled a token that ends its sequence (in its ``pending`` entry) becomes inert
    (``StepRow.padding``): its sequence ends when that step's output is applied, and the
    model leaves the slot alone."""
    rows = list(batch.rows)
    for index, ends in enumerate(pending):
        row = rows[index]
        token = sampled.get(row.slot)
        rows[index] = (
            StepRow.padding(row.slot)
            if token is None or token in ends
            else plain_decode_row(row.slot, (token,), row.position, row.sampling, row.kv_blocks)
        )
    return StepBatch(tuple(rows))


class TimedStepCall:
    """The call the engine runs on the model thread for each step: the model's output and
    its duration in seconds (the model's own time, whatever the loop does meanwhile).

    A step built ahead (``ScheduledStep.pending``) first gets the previous step's tokens in
    its pending rows (:func:`filled_batch`); the model thread runs the steps one after
    another, so the previous step is the one whose tokens are kept here. When every row is
    then inert (each one it continued failed), the model is not called.

    Args:
        model: the model stepped.
        keeps_tokens: keep each step's sampled tokens for a step built ahead (False: steps
            are never built ahead, and a pending row is an error).
    """

    def __init__(self, model: Model, *, keeps_tokens: bool) -> None:
        self._model = model
        self._keeps_tokens = keeps_tokens
        self._sampled: dict[int, int] = {}  # slot -> the last step's token (model thread)

    def __call__(self, step: ScheduledStep) -> tuple[StepOutput, float]:
        batch = step.batch
        if step.pending:
            if not self._keeps_tokens:
                raise RuntimeError("a step built ahead, but no step's tokens were kept")
            batch = filled_batch(batch, step.pending, self._sampled)
        self._sampled = {}  # a step that raises leaves no token to continue from
        started = time.perf_counter()
        if all(row.inert for row in batch.rows):
            output = StepOutput((RowOutput(),) * len(batch.rows))
        else:
            output = self._model.step(batch)
        seconds = time.perf_counter() - started
        if self._keeps_tokens:
            self._sampled = sampled_tokens(batch, output)
        return output, seconds
