"""The async engine: an inbox of commands and the one task that owns the scheduler.

Endpoints never touch the scheduler or the model. They call ``submit`` / ``cancel`` / ``abort``,
which put frozen commands on the inbox; only the loop task applies them, between model steps.
The model step itself runs on the model thread so the event loop keeps serving HTTP meanwhile.
What the edge needs to know of the model (its capabilities, its tokenizer, its chat template)
it reads through the engine's own operations (rule R11): ``capabilities``, ``encode_text``,
``encode_chat``, ``chat_template``, ``policy_name``.

    loop:  take_new_commands -> admit_waiting -> schedule -> start step N (thread)
           -> while N runs: emit_text (step N-1's events), commands, schedule_ahead (step
              N+1, queued behind N when it can be built before N's tokens: ``lookahead``)
           -> step N's output -> take_new_commands (cancels win) -> advance -> (N+1 ...)

The overlap and which guarantee costs what: ``docs/ENGINE_LOOP.md``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from app.engine.engine_core import EngineCore
from app.engine.handle import InFlightRequests, RequestHandle
from app.engine.inbox import Cancel, Command, Inbox, Submit
from app.engine.lookahead import TimedStepCall
from app.engine.model_thread import ModelThread
from app.engine.request import FinishReason, GenerationRequest
from app.engine.step_rows import ScheduledStep
from app.models.base import Model, StepOutput

logger = logging.getLogger(__name__)

_LOOP_FAILED = "the server's scheduler failed"


class EngineState(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class EngineUnavailable(Exception):
    """The engine is not accepting requests (not started, draining, stopped or failed)."""


class DuplicateRequestId(Exception):
    """A request with this id is already in flight."""


class Overloaded(Exception):
    """The waiting queue is full (by count or by prompt tokens).

    Attributes:
        retry_after_s: a hint for the client, in whole seconds.
    """

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """How much may wait for a slot; beyond it, ``submit`` raises ``Overloaded`` at once.

    Attributes:
        max_queue: requests waiting (not yet in a slot), across the inbox and the queue.
        max_queued_tokens: prompt tokens of those waiting requests.
    """

    max_queue: int = 1024
    max_queued_tokens: int = 1_000_000


class AsyncEngine(EngineCore):
    """Runs continuous batching over ``model`` in one background task.

    Args: :class:`app.engine.engine_core.EngineCore`'s (the model, admission policy, token
    budget, metrics, prefix caching, speculation, chat template), and

        limits: admission limits (queue length and queued prompt tokens).
        model_thread: where ``model.step`` runs; pass the thread the model was loaded on
            (see :mod:`app.engine.model_thread`). A new one by default. The engine shuts it
            down in :meth:`stop`.
        schedule_ahead: build step N+1 while step N runs when the scheduler can
            (``Scheduler.schedule_ahead``); False: always after step N's output is applied.
    """

    def __init__(
        self,
        model: Model,
        *,
        limits: AdmissionLimits | None = None,
        model_thread: ModelThread | None = None,
        schedule_ahead: bool = True,
        **options: Any,
    ) -> None:
        super().__init__(model, release_slot=self._release_slot, **options)
        self.schedules_ahead = schedule_ahead
        self.limits = limits or AdmissionLimits()
        self.metrics.track_queue(
            waiting=lambda: self.scheduler.num_waiting, running=lambda: self.scheduler.num_running
        )
        self.state = EngineState.CREATED
        self._inbox = Inbox()
        self._in_flight = InFlightRequests()
        self._model_thread = model_thread or ModelThread()
        self._task: asyncio.Task[None] | None = None
        # the steps on the model thread (N, and N+1 queued behind it) until the loop has their
        # output: ``stop`` waits for them; a release meanwhile is queued behind them (base.py)
        self._steps_in_flight: list[asyncio.Future[tuple[StepOutput, float]]] = []
        self._queued_release: Future[None] | None = None
        self._call_model = TimedStepCall(model, keeps_tokens=schedule_ahead)  # model thread

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self.state is not EngineState.CREATED:
            raise RuntimeError(f"engine cannot start from state {self.state.value}")
        self.state = EngineState.RUNNING
        self._task = asyncio.create_task(self._run(), name="scheduler-loop")

    @property
    def is_alive(self) -> bool:
        return (
            self.state is EngineState.RUNNING and self._task is not None and not self._task.done()
        )

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    async def drain(self, timeout_s: float) -> None:
        """Stops taking requests and waits up to ``timeout_s`` seconds for in-flight ones (or
        for the loop to end, whichever comes first)."""
        if self.state is EngineState.RUNNING:
            self.state = EngineState.DRAINING
        if self._task is None or self._task.done():
            return
        emptied = asyncio.ensure_future(self._in_flight.wait_empty())
        try:
            await asyncio.wait(
                {emptied, self._task}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            emptied.cancel()

    async def stop(self) -> None:
        """Ends every remaining request as cancelled and stops the loop. Idempotent.

        In this order: the loop task is cancelled and awaited; the step it left on the model
        thread, if any, is waited for (it still uses its slots: a release never races a
        step); then every request ends, releasing its slot; then the model thread shuts down.
        A step that never returns therefore holds ``stop`` as long.
        """
        if self.state in (EngineState.RUNNING, EngineState.DRAINING, EngineState.CREATED):
            self.state = EngineState.STOPPED
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self._steps_returned()
        self._end_every_request(FinishReason.CANCELLED)
        await self.wait_model_thread()  # the releases queued on it
        self._model_thread.shutdown()

    async def _steps_returned(self) -> None:
        """Waits until no step runs on the model thread (their outputs or errors dropped)."""
        while self._steps_in_flight:
            running = self._steps_in_flight.pop(0)
            await asyncio.wait({running})
            if not running.cancelled():
                running.exception()  # retrieved: the loop that would have read it is gone

    async def wait_model_thread(self) -> None:
        """Returns once every call queued on the model thread so far has run: the steps in
        flight and the slot releases queued behind them."""
        await self._model_thread.drain()

    def _release_slot(self, slot: int) -> None:
        """The scheduler's release of a slot: queued on the model thread behind the steps in
        flight, which may still use the slot (and behind releases queued so), else at once."""
        queued = self._queued_release
        if self._steps_in_flight or (queued is not None and not queued.done()):
            self._queued_release = self._model_thread.queue(self.model.release, slot)
        else:
            self.model.release(slot)

    # ----------------------------------------------------------------- what the edge reads

    @property
    def prefix_caching(self) -> bool:
        """Whether a paged model's prompts reuse cached KV blocks (False when not paged)."""
        blocks = self.scheduler.kv_blocks
        return blocks is not None and blocks.prefix_caching

    @property
    def speculative_ngram(self) -> int:
        """Most tokens drafted per row and step (``--speculative-ngram``; 0: off)."""
        return self.scheduler.speculation.num_draft_tokens

    @property
    def policy_name(self) -> str:
        """The admission policy in use (``continuous`` or ``static``)."""
        return self.scheduler.policy.name

    # ----------------------------------------------------------------- commands (any task)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queues a request; returns the handle its events arrive on.

        Raises:
            EngineUnavailable: not running (draining, stopped, failed).
            DuplicateRequestId: ``request.request_id`` is already in flight.
            Overloaded: the request would have to wait and the queue is full.
        """
        if not self.is_alive:
            raise EngineUnavailable(f"engine is {self.state.value}")
        if self._in_flight.get(request.request_id) is not None:
            raise DuplicateRequestId(request.request_id)
        # max_tokens 0 finishes at once and never waits, unless it scores the prompt
        if request.max_tokens > 0 or request.sampling.prompt_logprobs is not None:
            self.check_admission(len(request.prompt_token_ids))
        handle = RequestHandle(request, on_final=self._in_flight.discard)
        self._in_flight.add(handle)
        self._inbox.put(Submit(handle))
        return handle

    def check_admission(self, prompt_tokens: int, *, count: int = 1) -> None:
        """Raises ``Overloaded`` if ``count`` requests of ``prompt_tokens`` in all (the ``n``
        choices of one prompt) would not be admitted now.

        Cheap (no allocation), so the HTTP edge can call it before reading the body and
        answer 429 before doing any work; ``submit`` checks again with the real count.
        Requests that will find a free slot do not wait; the limits apply to the rest.
        """
        waiting = self._inbox.num_submits + self.scheduler.num_waiting
        would_wait = waiting + count - self.scheduler.num_free_slots
        if would_wait > self.limits.max_queue:
            raise Overloaded(f"the waiting queue is full ({self.limits.max_queue} requests)")
        queued_tokens = self._inbox.submitted_prompt_tokens + self.scheduler.waiting_prompt_tokens
        if would_wait > 0 and queued_tokens + prompt_tokens > self.limits.max_queued_tokens:
            raise Overloaded(
                f"the waiting queue is full ({queued_tokens} of "
                f"{self.limits.max_queued_tokens} prompt tokens)"
            )

    def cancel(self, request_id: str, *, owner: str | None = None) -> bool:
        """Cancels the in-flight request ``request_id`` made by ``owner``.

        The id of an ``n`` > 1 answer is its group's (``GenerationRequest.group_id``, the id
        of choice 0): cancelling it cancels every choice still in flight.

        Returns False (the caller answers 404) when no such request is in flight for that
        owner, including when it was already cancelled: a second cancel is a miss.
        """
        handle = self._in_flight.get(request_id)
        if handle is None or handle.request.owner != owner:
            return False
        if handle.request.group_id == request_id:
            for member in self._in_flight:  # a copy: abort() discards from it
                if member.request.group_id == request_id and member.request.owner == owner:
                    self.abort(member)
        self.abort(handle)
        return True

    def abort(self, handle: RequestHandle) -> None:
        """Cancels the request behind ``handle`` (its client left). Safe to call repeatedly."""
        if handle.is_finished or handle.cancel_requested_at is not None:
            return
        handle.cancel_requested_at = time.perf_counter()
        self._in_flight.discard(handle)
        self._inbox.put(Cancel(handle.request, handle.cancel_requested_at))

    # ----------------------------------------------------------------- the loop

    async def _run(self) -> None:
        try:
            while True:
                await self._take_new_commands()
                self.scheduler.admit_waiting()
                step = self.scheduler.schedule()
                if step is None:
                    self.scheduler.emit_text(step_in_flight=False)
                else:
                    await self._run_steps(step)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("scheduler loop failed; failing every request")
            self.state = EngineState.FAILED
            self._end_every_request(FinishReason.ERROR, error=_LOOP_FAILED)

    async def _take_new_commands(self) -> None:
        """Applies every queued command; waits for one when there is nothing to run."""
        if not self.scheduler.has_work:
            self.scheduler.emit_text(step_in_flight=False)  # the last step's events, then idle
            self._apply(await self._inbox.get())
        self._apply_inbox()

    def _apply_inbox(self) -> None:
        for command in self._inbox.take_ready():
            self._apply(command)

    def _apply(self, command: Command) -> None:
        if isinstance(command, Submit):
            request = command.handle.request
            sequence = self.new_sequence(request, command.handle.push)
            self.scheduler.add(sequence)
            if command.handle.cancel_requested_at is not None:
                self.scheduler.cancel(sequence)  # cancelled before it reached us: end it now
        else:
            sequence = self.scheduler.find(command.request)
            if sequence is not None and self.scheduler.cancel(sequence):
                self.metrics.cancel_to_free.observe(time.perf_counter() - command.issued_at)

    async def _run_steps(self, step: ScheduledStep) -> None:
        """Runs ``step`` on the model thread and, while each step runs, the previous step's
        text and events (``emit_text``), the commands that arrived, and the next step when it
        can be built before this one's tokens are known (``schedule_ahead``: queued behind it
        at once, so the model thread goes from one to the next without waiting for the loop);
        each step's output is applied when it returns (``_step_output``). Returns once a step
        is applied with none built ahead. A failure while emitting or scheduling is the
        loop's own and ends it, after the steps in flight returned (rule R16)."""
        running = self._start(step)
        while True:
            try:
                self.scheduler.emit_text(step_in_flight=True)
                if self.schedules_ahead:  # what arrived meanwhile can join the next step
                    self._apply_inbox()
                ahead = self.scheduler.schedule_ahead(step) if self.schedules_ahead else None
            except Exception:
                await self._steps_returned()
                raise
            following = None if ahead is None else self._start(ahead)
            await self._step_output(step, running)
            if ahead is None or following is None:  # both or neither
                return
            step, running = ahead, following

    def _start(self, step: ScheduledStep) -> asyncio.Future[tuple[StepOutput, float]]:
        running = self._model_thread.start(self._call_model, step)
        self._steps_in_flight.append(running)
        return running

    async def _step_output(
        self, step: ScheduledStep, running: asyncio.Future[tuple[StepOutput, float]]
    ) -> None:
        """Awaits ``step`` and applies its output. The step raising, or its output not
        applying, fails the step's rows (``EngineCore``'s rule). Awaited through a shield:
        cancelling the loop (``stop``) leaves the step running, and ``stop`` waits for it
        (``_steps_returned``) before releasing any slot."""
        try:
            output, seconds = await asyncio.shield(running)  # a cancel leaves it to stop()
        except Exception:
            self._steps_in_flight.remove(running)
            logger.exception("model step over %d rows failed", len(step.sequences))
            self.fail_step(step)
            return
        self._steps_in_flight.remove(running)
        self.metrics.step_duration.observe(seconds)
        # Cancels that arrived during the step win over its output: a DELETE answered
        # 200 must end its request as cancelled, never with one more token.
        self._apply_inbox()
        failure = self.advance_or_fail(step, output)
        if failure is not None:
            logger.error(
                "model step over %d rows gave an output that did not apply",
                len(step.sequences),
                exc_info=failure,
            )

    def _end_every_request(self, reason: FinishReason, *, error: str | None = None) -> None:
        """Once the loop is gone (stopped or failed): every request still known ends with
        ``reason``, so no client waits forever: those in the scheduler, those still in the
        inbox, and one whose command was being applied when the loop failed."""
        self.scheduler.finish_all(reason, error=error)
        for command in self._inbox.take_ready():
            if isinstance(command, Submit):
                self._finish_unscheduled(command.handle, reason, error)
        for handle in self._in_flight:
            self._finish_unscheduled(handle, reason, error)

    def _finish_unscheduled(
        self, handle: RequestHandle, reason: FinishReason, error: str | None
    ) -> None:
        """Ends a request the scheduler never took, through its finish funnel."""
        if not handle.is_finished:
            sequence = self.new_sequence(handle.request, handle.push)
            self.scheduler.finish(sequence, reason, error=error)
