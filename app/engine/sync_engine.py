"""The scheduler driven on the caller's thread: no event loop, no inbox, no worker thread.

``AsyncEngine`` runs the loop in an asyncio task for the HTTP server; offline callers (the
seed's ``generate``, the Python API) need the same loop without one:

    add requests -> admit_waiting() -> schedule() -> model.step() -> advance() -> emit_text()

It is the same core (``EngineCore``: the ``Scheduler`` built the same way, one failure rule),
so the same admission policy, slot refilling, stop checks and finish funnel
(``Scheduler.finish``) decide every request's tokens, exactly as in the server.
What differs is only who waits: here ``step`` returns once the model step is applied.

The model should be stepped on the thread that loaded it (one OpenMP team, see
:mod:`app.engine.model_thread`); calling ``step`` from the thread that built the model does that.
"""

from __future__ import annotations

import functools
from typing import Any

from app.engine.engine_core import EngineCore
from app.engine.request import FinalEvent, FinishReason, GenerationRequest, StreamEvent
from app.engine.step_rows import ScheduledStep
from app.models.base import Model


class ModelStepError(RuntimeError):
    """``model.step`` raised (or returned a malformed output) in step ``step_index``.

    The requests of that step have already ended with ``FinishReason.ERROR`` (their handles
    hold the final event); the others are untouched, so the caller may go on stepping or stop.
    The model's exception is ``__cause__``.

    Attributes:
        step_index: 1-based index of the failed model step in this engine's life.
        request_ids: the ids of the requests whose rows were in it, in row order.
    """

    def __init__(self, step_index: int, request_ids: tuple[str, ...], cause: BaseException):
        super().__init__(
            f"model step {step_index} failed (requests {', '.join(map(repr, request_ids))}): "
            f"{type(cause).__name__}: {cause}"
        )
        self.step_index = step_index
        self.request_ids = request_ids


class SyncHandle:
    """The caller's end of one request in a ``SyncEngine``.

    ``final`` is set exactly once, by the scheduler's finish funnel; token events are not
    kept (``final`` holds the whole text and every token id).
    """

    __slots__ = ("request", "final")

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.final: FinalEvent | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def is_finished(self) -> bool:
        return self.final is not None


class SyncEngine(EngineCore):
    """Runs continuous batching over ``model`` on the caller's thread.

    Args:
        model: anything implementing ``app.models.base.Model``.
        options: :class:`app.engine.engine_core.EngineCore`'s keyword arguments (admission
            policy, token budget, metrics, prefix caching, speculation, chat template).

    Attributes:
        num_model_steps: ``model.step`` calls made so far, failed ones included.
    """

    def __init__(self, model: Model, **options: Any) -> None:
        super().__init__(model, **options)
        self.num_model_steps = 0
        self._in_flight: dict[str, SyncHandle] = {}

    def add(self, request: GenerationRequest) -> SyncHandle:
        """Queues ``request`` (FIFO behind those added before); ``max_tokens == 0`` finishes
        at once, without a model step.

        Raises:
            ValueError: a request with this id is in flight.
        """
        if request.request_id in self._in_flight:
            raise ValueError(f"a request with id {request.request_id!r} is already in flight")
        handle = SyncHandle(request)
        self._in_flight[request.request_id] = handle
        self.scheduler.add(self.new_sequence(request, functools.partial(self._deliver, handle)))
        return handle

    def step(self) -> None:
        """Admits waiting requests into free slots, runs one model step and applies it.

        Does nothing when no request holds a slot after admitting.

        Raises:
            ModelStepError: the model raised, or its output did not fit the step; that step's
                requests have ended with an error, nothing else changed.
        """
        self.scheduler.admit_waiting()
        scheduled = self.scheduler.schedule()
        if scheduled is not None:
            self._run(scheduled)

    def run_until_idle(self, *, max_steps: int | None = None) -> None:
        """Steps until every request added so far has finished.

        Args:
            max_steps: most model steps this call may take, when the caller knows a bound
                (the seed's ``generate``: one token per step at least); None: no bound.

        Raises:
            ModelStepError: at the first failed step, with no step after it.
            RuntimeError: work is left after ``max_steps`` steps (the loop is not advancing).
        """
        first = self.num_model_steps
        while self.scheduler.has_work:
            if max_steps is not None and self.num_model_steps - first >= max_steps:
                raise RuntimeError(
                    f"{self.scheduler.num_running + self.scheduler.num_waiting} requests "
                    f"unfinished after {max_steps} model steps"
                )
            self.step()

    def cancel_all(self) -> None:
        """Ends every waiting and running request as cancelled (the caller gave up)."""
        self.scheduler.finish_all(FinishReason.CANCELLED)

    def _run(self, scheduled: ScheduledStep) -> None:
        """The step, then its output applied whole (``EngineCore``'s failure rule); the caller
        gets a failure as ``ModelStepError`` (not logged here: it decides)."""
        self.num_model_steps += 1
        try:
            output = self.model.step(scheduled.batch)
        except Exception as exc:
            self.fail_step(scheduled)
            raise self._step_error(scheduled, exc) from exc
        failure = self.advance_or_fail(scheduled, output)
        if failure is not None:
            raise self._step_error(scheduled, failure) from failure
        self.scheduler.emit_text(step_in_flight=False)

    def _step_error(self, scheduled: ScheduledStep, cause: Exception) -> ModelStepError:
        request_ids = tuple(seq.request_id for seq in scheduled.sequences)
        return ModelStepError(self.num_model_steps, request_ids, cause)

    def _deliver(self, handle: SyncHandle, event: StreamEvent) -> None:
        if isinstance(event, FinalEvent):
            handle.final = event
            if self._in_flight.get(handle.request_id) is handle:
                del self._in_flight[handle.request_id]
