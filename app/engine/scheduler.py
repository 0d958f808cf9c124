"""Continuous batching: a waiting queue, a fixed number of slots, one step at a time.

The scheduler is synchronous and knows nothing of asyncio or HTTP; ``AsyncEngine`` drives it:

    take new commands -> admit_waiting() -> schedule() -> model.step() -> apply() -> (repeat)

``apply`` is ``advance`` (what the next step depends on: tokens, finishes, the constraint, the
KV commit) then ``emit_text`` (detokenizing and token events); ``AsyncEngine`` calls the two
apart and runs ``emit_text`` while the next step runs (``docs/ENGINE_LOOP.md``).

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
Each decode-only step is timed from ``schedule`` to the end of ``advance`` (``draft_costs``):
what a drafted token costs is measured on the steps themselves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from app.engine.kv_admission import KVAdmission
from app.engine.kv_blocks import Admission, AdmitOutcome, BlockManager
from app.engine.metrics import EngineMetrics
from app.engine.policy import AdmissionPolicy
from app.engine.request import (
    FinishReason,
    GenerationRequest,
    PendingToken,
    Sequence,
    SequenceStatus,
    TokenEvent,
)
from app.engine.speculation import NO_SPECULATION, NgramSpeculation
from app.engine.step_rows import (
    RowResult,
    ScheduledStep,
    decode_rows,
    padding_rows,
    prefill_row,
    row_results,
    whole_groups,
)
from app.engine.waiting_queue import WaitingQueue
from app.models.base import ModelCapabilities, StepBatch, StepOutput, Tokenizer, TokenLogprobs

logger = logging.getLogger(__name__)

_UNDECODABLE = "failed to decode generated tokens"
_UNPAGED = Admission(AdmitOutcome.ADMITTED)  # a model without KV blocks admits into any slot


def _admission_order(seq: Sequence) -> float:
    return seq.admitted_at or 0.0


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
        # how many of ``slots`` hold a sequence: changed only where a slot is taken
        # (admit_waiting) or freed (_release), read per submit and per loop turn
        self._num_running = 0
        self.kv: KVAdmission | None = None
        # the text side's backlog, from one step's ``advance`` to the ``emit_text`` after it:
        # the sequences with untexted tokens (in the order they got them), the latencies of
        # their tokens, and those whose text failed to decode while a step was in flight
        self._text_due: list[Sequence] = []
        self._first_token_latencies: list[float] = []
        self._inter_token_latencies: list[float] = []
        self._undecodable: list[Sequence] = []
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
        return len(self.slots) - self._num_running

    @property
    def num_running(self) -> int:
        return self._num_running

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or self._num_running > 0

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
            admission = kv.admit(seq) if kv is not None else _UNPAGED
            if admission.outcome is AdmitOutcome.NO_ROOM:
                break  # its blocks do not fit
            if admission.outcome is AdmitOutcome.PREFIX_IN_FLIGHT:
                continue  # its prefix is being computed: next time
            self.waiting.remove(seq)
            slot = free[admitted]
            admitted += 1
            seq.status = SequenceStatus.RUNNING
            seq.slot = slot
            seq.num_computed_tokens = seq.num_cached_tokens = admission.num_cached_tokens
            seq.admitted_at = now
            if seq.request.constraint is not None and seq.matcher is None:
                # a preempted sequence keeps its matcher: its generated tokens stay
                seq.matcher = seq.request.constraint.new_matcher()
            self.slots[slot] = seq
        self._num_running += admitted
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
            if seq is not None:
                (prefilling if seq.is_prefilling else sequences).append(seq)
        costs = self.draft_costs
        drafts = self.speculation.drafts(sequences, budget, self.capabilities, self.kv, costs)
        rows = decode_rows(sequences, blocks, drafts)
        budget -= len(rows) + sum(map(len, drafts))
        prefilling.sort(key=_admission_order)
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
        """Applies one step's output whole: ``advance`` and then ``emit_text`` (the order of a
        caller that overlaps nothing, such as ``SyncEngine``)."""
        self.advance(step, output)
        self.emit_text(step_in_flight=False)

    def advance(self, step: ScheduledStep, output: StepOutput) -> None:
        """The part of a step's output the next step depends on: advances state, appends
        tokens, finishes what is done (EOS, stop token, length, the constraint, and a stop
        string: a request with stop strings runs its text side here). The text and events of
        the other requests' new tokens wait for ``emit_text``.

        A row whose slot no longer holds the sequence it was built for (cancelled meanwhile)
        is dropped (rule R17). A failure while applying one sequence's token fails only it.
        """
        self._finish_undecodable()
        results = row_results(step, output)  # ValueError: an output that does not fit
        self._metrics.batch_size.observe(len(step.sequences))
        now = self._clock()
        kv = self.kv
        slots = self.slots
        appended = 0
        for result in results:
            seq, row = result.sequence, result.row
            if slots[row.slot] is not seq:
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
            appended += self._append_tokens(result, now)
            if kv is not None and row.num_draft_tokens:
                kv.rollback(seq)  # the rejected positions' blocks (a no-op once finished)
        if appended:
            self._metrics.generated_tokens.inc(appended)
        self.draft_costs.applied(step, self._clock())

    def emit_text(self, *, step_in_flight: bool) -> None:
        """The text side of the tokens ``advance`` appended: detokenizes them, puts their
        ``TokenEvent`` on each request's stream and observes their latencies. The engine
        runs it while the next step runs (``step_in_flight=True``).

        It ends no sequence while a step is in flight (that step may still use its slot):
        a token whose text fails to decode there ends its request (ERROR) at the next
        ``advance``; with ``step_in_flight=False`` it ends at once.
        """
        due, self._text_due = self._text_due, []
        for seq in due:
            if seq.untexted and not self._emit_text_of(seq):
                if step_in_flight:
                    self._undecodable.append(seq)
                else:
                    self.finish(seq, FinishReason.ERROR, error=_UNDECODABLE)
        first_token, self._first_token_latencies = self._first_token_latencies, []
        between, self._inter_token_latencies = self._inter_token_latencies, []
        for seconds in first_token:
            self._metrics.time_to_first_token.observe(seconds)
        for seconds in between:
            self._metrics.inter_token_latency.observe(seconds)

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
        if seq.untexted and not self._emit_text_of(seq):
            reason, stop_reason, error = FinishReason.ERROR, None, _UNDECODABLE
        if seq.status is SequenceStatus.FINISHED:
            return  # its text side ended it (a stop string matched)
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
            self._num_running -= 1
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

    def _append_tokens(self, result: RowResult, now: float) -> int:
        """A row's tokens (one, or an accepted draft and the model's own), each appended as if
        generated alone; those after the one that finishes the sequence are dropped. Returns
        how many were appended."""
        seq = result.sequence
        logprobs = result.logprobs
        appended = 0
        for index, token in enumerate(result.token_ids):
            if seq.status is SequenceStatus.FINISHED:
                break
            entry = () if logprobs is None else (logprobs[index],)
            if logprobs is not None:
                seq.logprobs.append(logprobs[index])
            appended += 1
            try:
                self._append_token(seq, token, entry, now)
            except Exception:
                logger.exception("request %s: applying token %d failed", seq.request_id, token)
                self.finish(seq, FinishReason.ERROR, error=_UNDECODABLE)
        return appended

    def _append_token(
        self,
        seq: Sequence,
        token: int,
        logprobs: tuple[TokenLogprobs | None, ...],
        now: float,
    ) -> None:
        seq.generated.append(token)
        if seq.first_token_at is None:
            seq.first_token_at = now
            self._first_token_latencies.append(now - seq.request.arrived_at)
        elif seq.last_token_at is not None:
            self._inter_token_latencies.append(now - seq.last_token_at)
        seq.last_token_at = now
        stop = seq.request.stop
        # A token that ends the sequence here has no text of its own (it is pending all the
        # same, so its logprobs and usage go out with the final event).
        ending: tuple[FinishReason, dict[str, object]] | None = None
        if seq.matcher is not None and not seq.matcher.advance(token):
            logger.error(
                "request %s: token %d is outside its constraint (%s)",
                seq.request_id,
                token,
                seq.matcher.error or "the mask was not applied",
            )
            ending = FinishReason.ERROR, {"error": "the output left the request's constraint"}
        elif token in stop.stop_token_ids:
            ending = FinishReason.STOP, {"stop_reason": token}
        elif not stop.ignore_eos and token in self.capabilities.eos_token_ids:
            ending = FinishReason.STOP, {}
        if ending is not None:
            seq.untexted.append(PendingToken(token, logprobs, False))
            reason, details = ending
            self.finish(seq, reason, **details)  # type: ignore[arg-type]
            return
        seq.untexted.append(PendingToken(token, logprobs, True))
        if stop.stop_strings:
            # a stop string ends the request: its text cannot wait for the next step
            if not self._emit_text_of(seq):
                self.finish(seq, FinishReason.ERROR, error=_UNDECODABLE)
            if seq.status is SequenceStatus.FINISHED:
                return
        elif len(seq.untexted) == 1:
            self._text_due.append(seq)
        if seq.matcher is not None and seq.matcher.is_finished:
            self.finish(seq, FinishReason.STOP)  # the language allows no further token
        elif (
            len(seq.generated) >= seq.request.max_tokens
            or seq.num_prompt_tokens + len(seq.generated) >= self.capabilities.context_length
        ):
            self.finish(seq, FinishReason.LENGTH)

    def _emit_text_of(self, seq: Sequence) -> bool:
        """Runs the text side over ``seq.untexted``, oldest first, as if each token had just
        been generated: its text appended, a ``TokenEvent`` for whatever text became safe to
        send; a stop string matched finishes the sequence (STOP) and drops the tokens after
        it. Returns False when a token's text failed to decode (logged; the caller ends the
        request), True otherwise."""
        untexted, seq.untexted = seq.untexted, []
        text = seq.text
        for token, logprobs, has_text in untexted:
            seq.unsent_token_ids.append(token)
            seq.unsent_logprobs.extend(logprobs)
            if not has_text:
                continue
            try:
                new_text = text.append(self._tokenizer.decode_bytes((token,)))
            except Exception:
                logger.exception("request %s: decoding token %d failed", seq.request_id, token)
                return False
            if new_text:
                seq.emit(
                    TokenEvent(new_text, tuple(seq.unsent_token_ids), tuple(seq.unsent_logprobs))
                )
                seq.unsent_token_ids.clear()
                seq.unsent_logprobs.clear()
            if text.matched_stop is not None:
                self.finish(seq, FinishReason.STOP, stop_reason=text.matched_stop)
                return True
        return True

    def _finish_undecodable(self) -> None:
        """Ends (ERROR) the requests whose text failed to decode while a step was in flight."""
        undecodable, self._undecodable = self._undecodable, []
        for seq in undecodable:
            self.finish(seq, FinishReason.ERROR, error=_UNDECODABLE)
