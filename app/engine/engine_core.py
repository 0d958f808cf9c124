"""What both engines share: the scheduler built from a model and its options, the prompt side,
a request's sequence, and the one rule for a failed step.

``AsyncEngine`` (the server: an inbox, a loop task, the step on the model thread) and
``SyncEngine`` (offline: the caller's thread) are two drivers of this core. They differ only in
who waits and when the text side runs; what a step's failure does to requests is decided here:

    model.step raised, or its output did not apply (``Scheduler.advance`` raised)
        -> every sequence of that step still in its slot ends with ERROR (``STEP_FAILED``);
           the others go on, and so does the engine.

Anything else that raises (applying a command, emitting text) is the driver's own failure.
"""

from __future__ import annotations

from collections.abc import Callable

from app.constraints import ConstraintCompiler
from app.engine.metrics import EngineMetrics
from app.engine.output_processor import RequestOutput
from app.engine.policy import AdmissionPolicy, ContinuousBatching
from app.engine.prompt_encoder import PromptEncoder
from app.engine.prompt_operations import PromptOperations
from app.engine.request import GenerationRequest, Sequence, StreamEvent
from app.engine.scheduler import Scheduler
from app.engine.speculation import NO_SPECULATION, NgramSpeculation
from app.engine.step_rows import ScheduledStep
from app.models.base import Model, ModelCapabilities, StepOutput

STEP_FAILED = "the model failed on this request"


class EngineCore(PromptOperations):
    """The scheduler over ``model`` and the operations both engine drivers share.

    Args:
        model: anything implementing ``app.models.base.Model``.
        policy: admission policy (continuous by default).
        max_num_batched_tokens: per-step token budget (decodes + prompt chunks); defaults to
            ``model.capabilities.default_max_num_batched_tokens``.
        metrics: where to count; a fresh registry by default.
        prefix_caching: a paged model reuses cached KV blocks of prompt prefixes
            (``--no-prefix-caching``: False).
        speculation: n-gram speculative decoding (``--speculative-ngram``); off by default.
        chat_template: a chat template source that replaces the model's (``--chat-template``).
        release_slot: how the scheduler has the model forget a slot; ``model.release`` by
            default (``AsyncEngine`` orders it after the steps in flight).

    Attributes:
        model: the model; only the driver calls its ``step``, the scheduler its ``release``.
        metrics: the engine's counters and histograms.
        scheduler: the one owner of waiting and running sequences.

    Raises:
        ValueError: from ``Scheduler`` (a token budget below the slots, a KV pool too small).
    """

    def __init__(
        self,
        model: Model,
        *,
        policy: AdmissionPolicy | None = None,
        max_num_batched_tokens: int | None = None,
        metrics: EngineMetrics | None = None,
        prefix_caching: bool = True,
        speculation: NgramSpeculation = NO_SPECULATION,
        chat_template: str | None = None,
        release_slot: Callable[[int], None] | None = None,
    ) -> None:
        caps = model.capabilities
        self.model = model
        self.metrics = metrics or EngineMetrics()
        self.scheduler = Scheduler(
            capabilities=caps,
            tokenizer=model.tokenizer,
            policy=policy or ContinuousBatching(),
            metrics=self.metrics,
            release_slot=release_slot or model.release,
            max_num_batched_tokens=max_num_batched_tokens or caps.default_max_num_batched_tokens,
            prefix_caching=prefix_caching,
            speculation=speculation,
        )
        self._prompts = PromptEncoder(model.tokenizer, caps.name, chat_template=chat_template)
        self._constraints = ConstraintCompiler(model.tokenizer, caps)

    @property
    def capabilities(self) -> ModelCapabilities:
        """The model's declared limits (frozen, read once at start-up)."""
        return self.model.capabilities

    @property
    def has_work(self) -> bool:
        """Whether a sequence waits or holds a slot."""
        return self.scheduler.has_work

    def new_sequence(
        self, request: GenerationRequest, emit: Callable[[StreamEvent], None]
    ) -> Sequence:
        """The scheduler's state of ``request``, whose events go to ``emit`` (its handle)."""
        return Sequence(request=request, output=RequestOutput(request, emit))

    def advance_or_fail(self, step: ScheduledStep, output: StepOutput) -> Exception | None:
        """Applies the part of ``step``'s output the next step depends on
        (``Scheduler.advance``); when that raises (an output that does not fit the step, or
        a fault while applying it), fails the step (:meth:`fail_step`).

        Returns:
            The exception that failed the step (the driver logs or raises it), None when the
            output applied.
        """
        try:
            self.scheduler.advance(step, output)
        except Exception as exc:
            self.fail_step(step)
            return exc
        return None

    def fail_step(self, step: ScheduledStep) -> None:
        """The failure rule: every sequence of ``step`` still in its slot ends with ERROR
        (``STEP_FAILED``); the others, and the engine, go on."""
        self.scheduler.fail(step, STEP_FAILED)
