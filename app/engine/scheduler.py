"""Continuous batching: a waiting queue, a fixed number of slots, one step at a time.

The scheduler is synchronous and knows nothing of asyncio or HTTP; ``AsyncEngine`` drives it:

    take new commands -> admit_waiting() -> schedule() -> model.step() -> apply() -> (repeat)

Every way a sequence can end (EOS, stop string, stop token, length, cancel, error, shutdown)
goes through ``finish()``, which frees the slot, releases the model's slot state, emits the
final event and counts the metrics, exactly once (rule R16).

With a paged model (``ModelCapabilities.paged``) the KV blocks' decisions have one owner,
``self.kv`` (:class:`app.engine.kv_admission.KVAdmission`, holding the ``BlockManager``): a
sequence is admitted only when the blocks of what it must prefill fit (its cached prefix
reused); before each step every decoding sequence gets the block its next position needs, and
when none is free the newest running one is preempted by recompute: ``_preempt`` releases its
slot and blocks (through ``_release``, the one cleanup that ``finish`` uses too) and puts it
back at the head of the waiting queue keeping its generated tokens, so it prefills
``prompt + generated`` when readmitted (from the cache, mostly) and its stream goes on where it
stopped. After each step the blocks a row filled are committed to the cache.

A constrained request (structured output) owns a ``ConstraintMatcher`` from admission to
``finish()``: its sampling rows carry the matcher's mask (``StepRow.token_mask``), each sampled
token advances it, and the sequence finishes (``stop``) once its language allows no further
token. Unconstrained rows carry no mask.

With ``--speculative-ngram`` a decoding row may carry a draft (:mod:`app.engine.speculation`);
``apply`` appends its accepted tokens one by one, and the rejected positions' blocks go back.
Each decode-only step is timed from ``schedule`` to the end of ``apply`` (``draft_costs``):
what a drafted token costs is measured on the steps themselves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from app.engine.kv_admission import KVAdmission
from app.engine.kv_blocks import PREFIX_IN_FLIGHT, BlockManager
from app.engine.metrics import EngineMetrics
from app.engine.policy import AdmissionPolicy
from app.engine.request import FinishReason, GenerationRequest, Sequence, SequenceStatus, TokenEvent
from app.engine.speculation import NO_SPECULATION, NgramSpeculation
from app.engine.step_rows import (
    RowResult,
    ScheduledStep,
    decode_row,
    padding_rows,
    prefill_row,
    row_results,
    whole_groups,
)
from app.engine.waiting_queue import WaitingQueue
from app.models.base import ModelCapabilities, StepBatch, StepOutput, Tokenizer

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns the waiting queue and the slots, and advances sequences by model outputs.

    Args:
        capabilities: the model's declared limits (slots, context length, EOS ids).
        tokenizer: used to turn generated ids into bytes.
        policy: decides how many waiting sequences to admit before a step.
        metrics: where counters and histograms go.
        release_slot: the model's ``release``; called when a slot is freed.
        max_num_batched_tokens: most tokens (decode rows + prompt chunks) in one step; must be
            >= the number of slots so every running decode fits.
        clock: seconds, monotonic (``time.perf_counter``); injectable for tests.
        prefix_caching: with a paged model, reuse cached full KV blocks of a prompt's prefix.
        speculation: n-gram speculative decoding (``--speculative-ngram``); off by default
            and for a model that does not declare ``verifies_drafts``.

    Attributes:
        kv: the KV side of a paged model (admission by blocks, growth, commit), else None.

    Raises:
        ValueError: ``max_num_batched_tokens`` smaller than the number of slots, or a paged
            model's pool smaller than one sequence of its context length.
    """

    def __init__(
        self,
        *,
        capabilities: ModelCapabilities,
        tokenizer: Tokenizer,
        policy: AdmissionPolicy,
        metrics: EngineMetrics,
        release_slot: Callable[[int], None],
        max_num_batched_tokens: int,
        clock: Callable[[], float] = time.perf_counter,
        prefix_caching: bool = True,
        speculation: NgramSpeculation = NO_SPECULATION,
    ) -> None:
        if max_num_batched_tokens < capabilities.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= the number of "
                f"slots ({capabilities.max_num_seqs})"
            )
        self.capabilities = capabilities
        self.policy = policy
        self.max_num_batched_tokens = max_num_batched_tokens
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._release_slot = release_slot
        self._clock = clock
        self.speculation = speculation if capabilities.verifies_drafts else NO_SPECULATION
        self.draft_costs = self.speculation.cost_model()  # timed steps: what a draft costs
        self.waiting = WaitingQueue()
        self.slots: list[Sequence | None] = [None] * capabilities.max_num_seqs
        self.kv: KVAdmission | None = None
        if capabilities.paged:
            self.kv = KVAdmission.for_model(capabilities, metrics, prefix_caching=prefix_caching)

    # ----------------------------------------------------------------- read-only views

    @property
    def kv_blocks(self) -> BlockManager | None:
        """The block manager of a paged model (read it; ``kv`` changes it), else None."""
        return self.kv.blocks if self.kv is not None else None

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def waiting_prompt_tokens(self) -> int:
        return self.waiting.prompt_tokens

    @property
    def num_free_slots(self) -> int:
        return sum(seq is None for seq in self.slots)

    @property
    def num_running(self) -> int:
        return sum(seq is not None for seq in self.slots)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or self.num_running > 0

    def running(self) -> Iterator[Sequence]:
        return (seq for seq in self.slots if seq is not None)

    def find(self, request: GenerationRequest) -> Sequence | None:
        """The live sequence made from this very request object (identity, rule R17)."""
        for seq in (*self.running(), *self.waiting):
            if seq.request is request:
                return seq
        return None

    # ----------------------------------------------------------------- commands

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence; ``max_tokens == 0`` finishes at once and never takes a slot,
        unless it asks for prompt logprobs (the prompt must then be run through the model)."""
        if seq.request.max_tokens == 0 and not seq.scores_prompt_only:
            self.finish(seq, FinishReason.LENGTH)
            return
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def cancel(self, seq: Sequence) -> bool:
        """Ends a waiting or running sequence as CANCELLED; False if it had already finished."""
        if seq.status is SequenceStatus.FINISHED:
            return False
        self.finish(seq, FinishReason.CANCELLED)
        return True

    # ----------------------------------------------------------------- the loop's steps

    def admit_waiting(self) -> int:
        """Moves waiting sequences into free slots, FIFO, as many as the policy allows.

        With a paged model a sequence enters only when the blocks of what it must prefill fit
        (admission stops at the first that does not); one whose next uncached prompt block is
        being computed by a running sequence waits for it (it is passed over, keeping its
        place), so a shared prefix is computed once.
        """
        free = [index for index, seq in enumerate(self.slots) if seq is None]
        count = self.policy.admit_count(
            free_slots=len(free), running=len(self.slots) - len(free), waiting=len(self.waiting)
        )
        count = whole_groups(self.waiting, count)
        now = self._clock()
        kv = self.kv
        admitted = 0
        for seq in list(self.waiting):
            if admitted == count:
                break
            computed = kv.admit(seq) if kv is not None else 0
            if computed is None:
                break  # its blocks do not fit
            if computed == PREFIX_IN_FLIGHT:
                continue  # its prefix is being computed: next time
            self.waiting.remove(seq)
            slot = free[admitted]
            admitted += 1
            seq.status = SequenceStatus.RUNNING
            seq.slot = slot
            seq.num_computed_tokens = seq.num_cached_tokens = computed
            seq.admitted_at = now
            if seq.request.constraint is not None and seq.matcher is None:
                # a preempted sequence keeps its matcher: its generated tokens stay
                seq.matcher = seq.request.constraint.new_matcher()
            self.slots[slot] = seq
        return admitted

    def schedule(self) -> ScheduledStep | None:
        """Builds the next step: every decoding sequence, then prompt chunks within the budget.

        Decode rows carry the one token sampled last step (and ``self.speculation``'s draft).
        Prompt chunks go to sequences in admission order, each at most
        ``capabilities.max_tokens_per_row`` tokens, until the step holds
        ``max_num_batched_tokens`` tokens. A model with a fixed batch shape gets an inert row
        after those for every slot without one, so the step has exactly ``max_num_seqs``
        rows. Returns None when no slot is busy.
        """
        started = self._clock()
        if self.kv is not None:
            self.kv.grow_decoding(self.running(), preempt=self._preempt)
        blocks = self.kv_blocks
        budget = self.max_num_batched_tokens
        sequences = [seq for seq in self.running() if not seq.is_prefilling]
        costs = self.draft_costs
        drafts = self.speculation.drafts(sequences, budget, self.capabilities, self.kv, costs)
        rows = [decode_row(s, blocks, d) for s, d in zip(sequences, drafts, strict=True)]
        budget -= sum(len(row.token_ids) for row in rows)
        waiting_prompt = (seq for seq in self.running() if seq.is_prefilling)
        prefilling = sorted(waiting_prompt, key=lambda seq: seq.admitted_at or 0.0)
        for seq in prefilling:
            if budget <= 0:
                break
            row = prefill_row(seq, budget, self.capabilities.max_tokens_per_row, blocks)
            rows.append(row)
            sequences.append(seq)
            budget -= len(row.token_ids)
        if not rows:
            return None
        decode_only = len(rows) == len(drafts)
        if self.capabilities.fixed_batch_shape:
            rows.extend(padding_rows(rows, len(self.slots)))
        step = ScheduledStep(StepBatch(tuple(rows)), tuple(sequences))
        drafted = sum(map(len, drafts))
        costs.scheduled(step, started, len(drafts) if decode_only else 0, drafted)
        return step

    def apply(self, step: ScheduledStep, output: StepOutput) -> None:
        """Applies one step's output: advances state, appends tokens, finishes what is done.

        A row whose slot no longer holds the sequence it was built for (cancelled meanwhile)
        is dropped (rule R17). A failure while applying one sequence's token fails only it.
        """
        results = row_results(step, output)  # ValueError: an output that does not fit
        self._metrics.batch_size.observe(len(step.sequences))
        now = self._clock()
        kv = self.kv
        for result in results:
            seq, row = result.sequence, result.row
            if self.slots[row.slot] is not seq:
                continue
            if result.error is not None:
                self.finish(seq, FinishReason.ERROR, error=result.error)
                continue
            seq.num_computed_tokens += result.num_computed
            if result.prompt_logprobs is not None:
                # the prompt's own positions only: a preempted sequence recomputes from 0,
                # its generated tokens after the prompt (scored once, when sampled)
                room = seq.num_prompt_tokens - len(seq.prompt_logprobs)
                seq.prompt_logprobs.extend(result.prompt_logprobs[: max(0, room)])
            if kv is not None:
                kv.commit_filled(seq, result.num_computed, result.token_ids[:-1])
            if not result.token_ids:
                if seq.scores_prompt_only and not seq.is_prefilling:
                    self.finish(seq, FinishReason.LENGTH)  # the prompt is scored: done
                continue
            if row.num_draft_tokens:
                self._metrics.count_draft(row.num_draft_tokens, result.num_accepted)
                self.speculation.record(seq, row.num_draft_tokens, result.num_accepted)
            self._append_tokens(result, now)
            if kv is not None and row.num_draft_tokens:
                kv.rollback(seq)  # the rejected positions' blocks (a no-op once finished)
        self.draft_costs.applied(step, self._clock())

    def fail(self, step: ScheduledStep, message: str) -> None:
        """Ends every sequence of a failed step (still in its slot) with an ERROR."""
        for seq, row in zip(step.sequences, step.live_rows, strict=True):
            if self.slots[row.slot] is seq:
                self.finish(seq, FinishReason.ERROR, error=message)

    def finish_all(self, reason: FinishReason, *, error: str | None = None) -> None:
        """Ends every waiting and running sequence (shutdown, or the loop failing)."""
        for seq in [*self.waiting, *self.running()]:
            self.finish(seq, reason, error=error)

    # ----------------------------------------------------------------- the finish funnel

    def finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        *,
        stop_reason: str | int | None = None,
        error: str | None = None,
    ) -> None:
        """The one way a sequence ends. Idempotent: a finished sequence is left alone."""
        if seq.status is SequenceStatus.FINISHED:
            return
        was_waiting = seq.status is SequenceStatus.WAITING
        seq.status = SequenceStatus.FINISHED
        seq.matcher = None  # the constraint's state ends with the request
        self._release(seq)
        if was_waiting and seq in self.waiting:
            self.waiting.remove(seq)

        now = self._clock()
        seq.emit_final(reason, now, stop_reason=stop_reason, error=error)
        self._metrics.requests_finished.labels(finish_reason=reason.value).inc()
        self._metrics.prompt_tokens.inc(seq.num_prompt_tokens)
        self._metrics.request_latency.observe(now - seq.request.arrived_at)

    def _release(self, seq: Sequence) -> None:
        """Gives back what ``seq`` holds: its slot (and the model's state of it) and its KV
        blocks. The cleanup shared by ``finish`` and preemption; a no-op for what it lacks."""
        if seq.slot is not None:
            self.slots[seq.slot] = None
            self._release_slot(seq.slot)
            seq.slot = None
        if self.kv is not None:
            self.kv.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption of a running sequence (the victim ``KVAdmission`` chose): it
        gives back its blocks and slot and goes to the head of the waiting queue, keeping its
        generated tokens (``num_prefill_tokens``)."""
        logger.info(
            "request %s preempted (%d tokens): no free KV block",
            seq.request_id,
            seq.num_computed_tokens,
        )
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.prompt_logprobs.clear()  # computed again with the prompt
        self.waiting.appendleft(seq)
        self._metrics.preemptions.inc()

    # ----------------------------------------------------------------- internals

    def _append_tokens(self, result: RowResult, now: float) -> None:
        """A row's tokens (one, or an accepted draft and the model's own), each appended as if
        generated alone; those after the one that finishes the sequence are dropped."""
        seq = result.sequence
        for index, token in enumerate(result.token_ids):
            if seq.status is SequenceStatus.FINISHED:
                return
            if result.logprobs is not None:
                seq.logprobs.append(result.logprobs[index])
                seq.unsent_logprobs.append(result.logprobs[index])
            try:
                self._append_token(seq, token, now)
            except Exception:
                logger.exception("request %s: applying token %d failed", seq.request_id, token)
                self.finish(seq, FinishReason.ERROR, error="failed to decode generated tokens")

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        seq.generated.append(token)
        seq.unsent_token_ids.append(token)
        self._metrics.generated_tokens.inc()
        if seq.first_token_at is None:
            seq.first_token_at = now
            self._metrics.time_to_first_token.observe(now - seq.request.arrived_at)
        elif seq.last_token_at is not None:
            self._metrics.inter_token_latency.observe(now - seq.last_token_at)
        seq.last_token_at = now
        if seq.matcher is not None and not seq.matcher.advance(token):
            logger.error(
                "request %s: token %d is outside its constraint (%s)",
                seq.request_id,
                token,
                seq.matcher.error or "the mask was not applied",
            )
            self.finish(seq, FinishReason.ERROR, error="the output left the request's constraint")
            return

        stop = seq.request.stop
        if token in stop.stop_token_ids:
            self.finish(seq, FinishReason.STOP, stop_reason=token)
            return
        if not stop.ignore_eos and token in self.capabilities.eos_token_ids:
            self.finish(seq, FinishReason.STOP)
            return
        new_text = seq.text.append(self._tokenizer.decode_bytes((token,)))
        if new_text:
            seq.emit(TokenEvent(new_text, tuple(seq.unsent_token_ids), tuple(seq.unsent_logprobs)))
            seq.unsent_token_ids.clear()
            seq.unsent_logprobs.clear()
        if seq.text.matched_stop is not None:
            self.finish(seq, FinishReason.STOP, stop_reason=seq.text.matched_stop)
        elif seq.matcher is not None and seq.matcher.is_finished:
            self.finish(seq, FinishReason.STOP)  # the language allows no further token
        elif (
            len(seq.generated) >= seq.request.max_tokens
            or seq.num_prompt_tokens + len(seq.generated) >= self.capabilities.context_length
        ):
            self.finish(seq, FinishReason.LENGTH)
