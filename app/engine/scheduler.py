"""Continuous batching: a waiting queue, a fixed number of slots, one step at a time.

Synchronous, with nothing of asyncio or HTTP; the engines drive it:
``admit_waiting() -> schedule() -> model.step() -> advance() -> emit_text()``. ``advance``
is what the next step depends on (tokens, the constraint, the KV commit, every finish by
``stop_conditions``); ``emit_text`` is the text side, which ``AsyncEngine`` runs while the next
step runs, and ``schedule_ahead`` builds that next step before ``advance`` when it can
(``docs/ENGINE_LOOP.md``). Every way a sequence ends goes through ``finish()``, which frees
the slot, releases the model's slot state, emits the final event and counts the metrics,
exactly once (rule R16).

A paged model's KV blocks have one owner, ``self.kv`` (``KVAdmission``): admission, growth,
preemption by recompute (``_preempt``, through ``finish``'s ``_release``). A constrained row
carries its matcher's mask; with ``--speculative-ngram`` a decoding row may carry a draft
(:mod:`app.engine.speculation`), and decode-only steps are timed (``draft_costs``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from app.engine.kv_admission import KVAdmission, admission_time
from app.engine.kv_blocks import Admission, AdmitOutcome, BlockManager
from app.engine.lookahead import ahead_step, following_sequences
from app.engine.metrics import EngineMetrics
from app.engine.output_processor import OutputProcessor
from app.engine.policy import AdmissionPolicy
from app.engine.request import FinishReason, GenerationRequest, Sequence, SequenceStatus
from app.engine.slot_table import SlotTable
from app.engine.speculation import NO_SPECULATION, NgramSpeculation
from app.engine.step_rows import (
    RowResult,
    ScheduledStep,
    decode_rows,
    padding_rows,
    prefill_rows,
    row_results,
    whole_groups,
)
from app.engine.stop_conditions import UNDECODABLE, limit_ending, text_ending, token_ending
from app.engine.waiting_queue import WaitingQueue
from app.models.base import ModelCapabilities, StepBatch, StepOutput, Tokenizer

logger = logging.getLogger(__name__)

_UNPAGED = Admission(AdmitOutcome.ADMITTED)  # a model without KV blocks admits into any slot


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
        waiting / slots: the sequences waiting, and those holding a slot (``SlotTable``).
        kv: the KV side of a paged model (admission by blocks, growth, commit), else None.
        outputs: the text side of every sequence's tokens (``OutputProcessor``).

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
            slots = capabilities.max_num_seqs
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) < slots ({slots})")
        self.capabilities = capabilities
        self.policy = policy
        self.max_num_batched_tokens = max_num_batched_tokens
        self._metrics = metrics
        self._release_slot = release_slot
        self._clock = clock
        self.speculation = speculation if capabilities.verifies_drafts else NO_SPECULATION
        self.draft_costs = self.speculation.cost_model()  # timed steps: what a draft costs
        self.waiting = WaitingQueue()
        self.slots = SlotTable(capabilities.max_num_seqs)
        self.kv: KVAdmission | None = None
        self.outputs = OutputProcessor(tokenizer, metrics)
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
        return self.slots.num_free

    @property
    def num_running(self) -> int:
        return self.slots.num_running

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or self.slots.num_running > 0

    def running(self) -> Iterator[Sequence]:
        return iter(self.slots)

    def find(self, request: GenerationRequest) -> Sequence | None:
        """The live sequence made from this very request object (identity, rule R17)."""
        return next((s for s in (*self.running(), *self.waiting) if s.request is request), None)

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
        free = self.slots.free_slots()
        count = self.policy.admit_count(
            free_slots=len(free), running=self.slots.num_running, waiting=len(self.waiting)
        )
        count = whole_groups(self.waiting, count)
        now = self._clock()
        kv = self.kv
        admitted = 0
        for seq in list(self.waiting):
            if admitted == count:
                break
            admission = kv.admit(seq) if kv is not None else _UNPAGED
            if admission.outcome is AdmitOutcome.NO_ROOM:
                break  # its blocks do not fit
            if admission.outcome is AdmitOutcome.PREFIX_IN_FLIGHT:
                continue  # its prefix is being computed: next time
            self.waiting.remove(seq)
            slot = free[admitted]
            admitted += 1
            seq.enter_slot(slot, admission.num_cached_tokens, now)
            self.slots.take(slot, seq)
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
        sequences: list[Sequence] = []  # the decoding ones, then those prefilling
        prefilling: list[Sequence] = []
        for seq in self.slots:
            (prefilling if seq.is_prefilling else sequences).append(seq)
        costs = self.draft_costs
        drafts = self.speculation.drafts(sequences, budget, self.capabilities, self.kv, costs)
        rows = decode_rows(sequences, blocks, drafts)
        budget -= len(rows) + sum(map(len, drafts))
        prefilling.sort(key=admission_time)
        chunks = prefill_rows(prefilling, budget, self.capabilities.max_tokens_per_row, blocks)
        rows.extend(chunks)
        sequences.extend(prefilling[: len(chunks)])
        if not rows:
            return None
        decode_only = len(rows) == len(drafts)
        if self.capabilities.fixed_batch_shape:
            rows.extend(padding_rows(rows, len(self.slots)))
        step = ScheduledStep(StepBatch(tuple(rows)), tuple(sequences))
        drafted = sum(map(len, drafts))
        costs.scheduled(step, started, len(drafts) if decode_only else 0, drafted)
        return step

    def schedule_ahead(self, running: ScheduledStep) -> ScheduledStep | None:
        """The step after ``running``, built while it runs (:mod:`app.engine.lookahead`): a
        ``PENDING_TOKEN`` decode row for each sequence it continues, then prompt chunks of
        sequences admitted now. None when it cannot be built before ``running``'s output
        (drafting, ``following_sequences``, no free KV block: growing would preempt) or is
        empty."""
        if self.speculation.num_draft_tokens:
            return None
        following = following_sequences(running, self.slots, self.capabilities.context_length)
        if following is None or (self.kv is not None and not self.kv.grow_following(following)):
            return None
        self.admit_waiting()
        in_step = {id(seq) for seq in running.sequences}
        admitted = sorted((s for s in self.slots if id(s) not in in_step), key=admission_time)
        budget = self.max_num_batched_tokens
        return ahead_step(following, admitted, self.kv_blocks, budget, self.capabilities)

    def apply(self, step: ScheduledStep, output: StepOutput) -> None:
        """``advance`` then ``emit_text``: a caller that overlaps nothing (``SyncEngine``)."""
        self.advance(step, output)
        self.emit_text(step_in_flight=False)

    def advance(self, step: ScheduledStep, output: StepOutput) -> None:
        """What the next step depends on: tokens appended, every finish ``stop_conditions``
        decides, the KV commit (the text waits for ``emit_text``). A row whose slot no longer
        holds the sequence it was built for (ended meanwhile) is dropped (rule R17); a failure
        while applying one sequence's token fails only it."""
        for seq in self.outputs.take_undecodable():  # their text failed during the last step
            self.finish(seq, FinishReason.ERROR, error=UNDECODABLE)
        results = row_results(step, output)  # ValueError: an output that does not fit
        self._metrics.batch_size.observe(len(step.sequences))
        now = self._clock()
        kv = self.kv
        slots = self.slots
        appended = 0
        for result in results:
            seq, row = result.sequence, result.row
            if not slots.holds(row.slot, seq):
                continue
            if result.error is not None:
                self.finish(seq, FinishReason.ERROR, error=result.error)
                continue
            seq.num_computed_tokens += result.num_computed
            if result.prompt_logprobs is not None:
                seq.add_prompt_logprobs(result.prompt_logprobs)
            if kv is not None:
                kv.commit_filled(seq, result.num_computed, result.token_ids[:-1])
            if not result.token_ids:
                if seq.scores_prompt_only and not seq.is_prefilling:
                    self.finish(seq, FinishReason.LENGTH)  # the prompt is scored: done
                continue
            if row.num_draft_tokens:
                self._metrics.count_draft(row.num_draft_tokens, result.num_accepted)
                self.speculation.record(seq, row.num_draft_tokens, result.num_accepted)
            appended += self._append_tokens(result, now)
            if kv is not None and row.num_draft_tokens:
                kv.rollback(seq)  # the rejected positions' blocks (a no-op once finished)
        if appended:
            self._metrics.generated_tokens.inc(appended)
        self.draft_costs.applied(step, self._clock())

    def emit_text(self, *, step_in_flight: bool) -> None:
        """The text side of the tokens ``advance`` appended (``OutputProcessor.emit_due``),
        run while the next step runs (``step_in_flight=True``). A token whose text fails to
        decode ends its request (ERROR) then, or at the next ``advance`` while a step runs."""
        for seq in self.outputs.emit_due(step_in_flight=step_in_flight):
            self.finish(seq, FinishReason.ERROR, error=UNDECODABLE)

    def fail(self, step: ScheduledStep, message: str) -> None:
        """Ends every sequence of a failed step (still in its slot) with an ERROR."""
        for seq, row in zip(step.sequences, step.live_rows, strict=True):
            if self.slots.holds(row.slot, seq):
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
        last_token_has_text: bool = True,
    ) -> None:
        """The one way a sequence ends. Idempotent: a finished sequence is left alone. The
        text side runs first over the tokens not through it yet (``last_token_has_text``
        False: the last one has none); what it finds (``text_ending``) decides the end."""
        if seq.status is SequenceStatus.FINISHED:
            return
        text_end = text_ending(seq, self.outputs.run_text(seq, last_has_text=last_token_has_text))
        if text_end is not None:
            reason, stop_reason, error = text_end.reason, text_end.stop_reason, text_end.error
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
            self.slots.free(seq.slot)
            self._release_slot(seq.slot)
            seq.slot = None
        if self.kv is not None:
            self.kv.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption of the victim ``KVAdmission`` chose: its blocks and slot go,
        it goes to the head of the waiting queue keeping its generated tokens."""
        tokens = seq.num_computed_tokens
        logger.info("request %s preempted (%d tokens): no free KV block", seq.request_id, tokens)
        self._release(seq)
        seq.back_to_waiting()
        self.waiting.appendleft(seq)
        self._metrics.preemptions.inc()

    # ----------------------------------------------------------------- internals

    def _append_tokens(self, result: RowResult, now: float) -> int:
        """Appends a row's tokens (one, or an accepted draft's and the model's own) one by one,
        up to the one that finishes the sequence; returns how many."""
        seq = result.sequence
        logprobs = result.logprobs
        appended = 0
        for index, token in enumerate(result.token_ids):
            if seq.status is SequenceStatus.FINISHED:
                break
            if logprobs is not None:
                seq.logprobs.append(logprobs[index])
            appended += 1
            try:
                self._append_token(seq, token, now)
            except Exception:
                logger.exception("request %s: applying token %d failed", seq.request_id, token)
                self.finish(seq, FinishReason.ERROR, error=UNDECODABLE)
        return appended

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        """Appends ``token``, then ends the sequence at the first ``stop_conditions`` that
        holds; a request with stop strings runs its text side now (a stop string cannot
        wait for the next step)."""
        seq.generated.append(token)
        self.outputs.token_appended(seq, now)
        ending = token_ending(seq, token, self.capabilities.eos_token_ids)
        if ending is None and seq.request.stop.stop_strings:
            ending = text_ending(seq, self.outputs.run_text(seq))
        if ending is None:
            ending = limit_ending(seq, self.capabilities.context_length)
        if ending is not None:
            self.finish(
                seq,
                ending.reason,
                stop_reason=ending.stop_reason,
                error=ending.error,
                last_token_has_text=ending.last_token_has_text,
            )
