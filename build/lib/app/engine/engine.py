"""The async engine: an inbox of commands and the one task that owns the scheduler.

Endpoints never touch the scheduler. They call ``submit`` / ``cancel`` / ``abort``, which put
frozen commands on the inbox; only the loop task applies them, between model steps. The model
step itself runs in a dedicated worker thread so the event loop keeps serving HTTP meanwhile.

    loop:  take_new_commands -> admit_waiting -> schedule -> run_step (thread)
           -> take_new_commands (cancels win) -> apply
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass

from app.engine.detokenizer import TextAssembler
from app.engine.handle import RequestHandle
from app.engine.metrics import EngineMetrics
from app.engine.model_thread import ModelThread
from app.engine.policy import AdmissionPolicy, ContinuousBatching
from app.engine.request import FinishReason, GenerationRequest, Sequence
from app.engine.scheduler import ScheduledStep, Scheduler
from app.models.base import Model

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


@dataclass(frozen=True, slots=True)
class Submit:
    handle: RequestHandle


@dataclass(frozen=True, slots=True)
class Cancel:
    """Cancel the request *object* (not its id: ids can be reused, rule R17)."""

    request: GenerationRequest
    issued_at: float


Command = Submit | Cancel


class AsyncEngine:
    """Runs continuous batching over ``model`` in one background task.

    Args:
        model: anything implementing ``app.models.base.Model``.
        policy: admission policy (continuous by default).
        max_num_batched_tokens: per-step token budget (decodes + prompt chunks); defaults to
            ``max(model slots, model.capabilities.max_tokens_per_row)``.
        metrics: where to count; a fresh registry by default.
        limits: admission limits (queue length and queued prompt tokens).
        model_thread: where ``model.step`` runs; pass the thread the model was loaded on
            (see :mod:`app.engine.model_thread`). A new one by default. The engine shuts it
            down in :meth:`stop`.
    """

    def __init__(
        self,
        model: Model,
        *,
        policy: AdmissionPolicy | None = None,
        max_num_batched_tokens: int | None = None,
        metrics: EngineMetrics | None = None,
        limits: AdmissionLimits | None = None,
        model_thread: ModelThread | None = None,
    ) -> None:
        caps = model.capabilities
        self.limits = limits or AdmissionLimits()
        self.model = model
        self.metrics = metrics or EngineMetrics()
        self.scheduler = Scheduler(
            capabilities=caps,
            tokenizer=model.tokenizer,
            policy=policy or ContinuousBatching(),
            metrics=self.metrics,
            release_slot=model.release,
            max_num_batched_tokens=max_num_batched_tokens
            or max(caps.max_num_seqs, caps.max_tokens_per_row),
        )
        self.metrics.track_queue(
            waiting=lambda: self.scheduler.num_waiting, running=lambda: self.scheduler.num_running
        )
        self.state = EngineState.CREATED
        self._inbox: asyncio.Queue[Command] = asyncio.Queue()
        self._in_flight: dict[str, RequestHandle] = {}
        # Submits in the inbox the loop has not applied yet (they wait like queued requests).
        self._inbox_requests = 0
        self._inbox_prompt_tokens = 0
        self._model_thread = model_thread or ModelThread()
        self._task: asyncio.Task[None] | None = None

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
        """Stops taking requests and waits up to ``timeout_s`` seconds for in-flight ones."""
        if self.state is EngineState.RUNNING:
            self.state = EngineState.DRAINING
        deadline = time.monotonic() + timeout_s
        while self._in_flight and time.monotonic() < deadline:
            if self._task is None or self._task.done():
                break
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        """Ends every remaining request as cancelled and stops the loop. Idempotent."""
        if self.state in (EngineState.RUNNING, EngineState.DRAINING, EngineState.CREATED):
            self.state = EngineState.STOPPED
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.scheduler.finish_all(FinishReason.CANCELLED)
        self._end_inbox(FinishReason.CANCELLED)
        self._model_thread.shutdown()

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
        if request.request_id in self._in_flight:
            raise DuplicateRequestId(request.request_id)
        if request.max_tokens > 0:  # max_tokens 0 finishes at once and never waits
            self.check_admission(len(request.prompt_token_ids))
        handle = RequestHandle(request, on_final=self._forget)
        self._in_flight[request.request_id] = handle
        self._inbox_requests += 1
        self._inbox_prompt_tokens += len(request.prompt_token_ids)
        self._inbox.put_nowait(Submit(handle))
        return handle

    def check_admission(self, prompt_tokens: int) -> None:
        """Raises ``Overloaded`` if a request of ``prompt_tokens`` would not be admitted now.

        Cheap (no allocation), so the HTTP edge can call it before reading the body and
        answer 429 before doing any work; ``submit`` checks again with the real count.
        Requests that will find a free slot do not wait; the limits apply to the rest.
        """
        waiting = self._inbox_requests + self.scheduler.num_waiting
        would_wait = waiting + 1 - self.scheduler.num_free_slots
        if would_wait > self.limits.max_queue:
            raise Overloaded(f"the waiting queue is full ({self.limits.max_queue} requests)")
        queued_tokens = self._inbox_prompt_tokens + self.scheduler.waiting_prompt_tokens
        if would_wait > 0 and queued_tokens + prompt_tokens > self.limits.max_queued_tokens:
            raise Overloaded(
                f"the waiting queue is full ({queued_tokens} of "
                f"{self.limits.max_queued_tokens} prompt tokens)"
            )

    def cancel(self, request_id: str, *, owner: str | None = None) -> bool:
        """Cancels the in-flight request ``request_id`` made by ``owner``.

        Returns False (the caller answers 404) when no such request is in flight for that
        owner, including when it was already cancelled: a second cancel is a miss.
        """
        handle = self._in_flight.get(request_id)
        if handle is None or handle.request.owner != owner:
            return False
        self.abort(handle)
        return True

    def abort(self, handle: RequestHandle) -> None:
        """Cancels the request behind ``handle`` (its client left). Safe to call repeatedly."""
        if handle.is_finished or handle.cancel_requested_at is not None:
            return
        handle.cancel_requested_at = time.perf_counter()
        if self._in_flight.get(handle.request_id) is handle:
            del self._in_flight[handle.request_id]
        self._inbox.put_nowait(Cancel(handle.request, handle.cancel_requested_at))

    def _forget(self, handle: RequestHandle) -> None:
        if self._in_flight.get(handle.request_id) is handle:
            del self._in_flight[handle.request_id]

    # ----------------------------------------------------------------- the loop

    async def _run(self) -> None:
        try:
            while True:
                await self._take_new_commands()
                self.scheduler.admit_waiting()
                step = self.scheduler.schedule()
                if step is not None:
                    await self._run_step(step)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("scheduler loop failed; failing every request")
            self.state = EngineState.FAILED
            self.scheduler.finish_all(FinishReason.ERROR, error=_LOOP_FAILED)
            self._end_inbox(FinishReason.ERROR, error=_LOOP_FAILED)

    async def _take_new_commands(self) -> None:
        """Applies every queued command; waits for one when there is nothing to run."""
        if not self.scheduler.has_work:
            self._apply(await self._inbox.get())
        self._apply_inbox()

    def _apply_inbox(self) -> None:
        while not self._inbox.empty():
            self._apply(self._inbox.get_nowait())

    def _apply(self, command: Command) -> None:
        if isinstance(command, Submit):
            request = command.handle.request
            self._inbox_requests -= 1
            self._inbox_prompt_tokens -= len(request.prompt_token_ids)
            sequence = Sequence(
                request=request,
                emit=command.handle.push,
                text=TextAssembler(request.stop.stop_strings),
            )
            if command.handle.cancel_requested_at is not None:
                self.scheduler.add(sequence)  # cancelled before it reached us: end it now
                self.scheduler.cancel(sequence)
                return
            self.scheduler.add(sequence)
        else:
            sequence = self.scheduler.find(command.request)
            if sequence is not None and self.scheduler.cancel(sequence):
                self.metrics.cancel_to_free.observe(time.perf_counter() - command.issued_at)

    async def _run_step(self, step: ScheduledStep) -> None:
        started = time.perf_counter()
        try:
            output = await self._model_thread.run(self.model.step, step.batch)
            self.metrics.step_duration.observe(time.perf_counter() - started)
            # Cancels that arrived during the step win over its output: a DELETE answered
            # 200 must end its request as cancelled, never with one more token.
            self._apply_inbox()
            self.scheduler.apply(step, output)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("model step over %d rows failed", len(step.sequences))
            self.scheduler.fail(step, "the model failed on this request")

    def _end_inbox(self, reason: FinishReason, *, error: str | None = None) -> None:
        """Once the loop is gone: end requests still in the inbox so no client waits forever."""
        while not self._inbox.empty():
            command = self._inbox.get_nowait()
            if isinstance(command, Submit):
                self._inbox_requests -= 1
                self._inbox_prompt_tokens -= len(command.handle.request.prompt_token_ids)
                sequence = Sequence(
                    request=command.handle.request, emit=command.handle.push, text=TextAssembler()
                )
                self.scheduler.finish(sequence, reason, error=error)
