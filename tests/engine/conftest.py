"""Drive the scheduler without HTTP or a real model: a scripted model and small factories."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import pytest

from app.engine.metrics import EngineMetrics
from app.engine.output_processor import RequestOutput
from app.engine.policy import AdmissionPolicy, ContinuousBatching
from app.engine.request import (
    FinalEvent,
    GenerationRequest,
    StopCriteria,
    StreamEvent,
    TokenEvent,
)
from app.engine.request import (
    Sequence as EngineSequence,
)
from app.engine.scheduler import Scheduler
from app.models.base import ModelCapabilities, SamplingParams, StepBatch, StepOutput
from app.models.mock import ByteTokenizer

EOS = 256


class ScriptedModel:
    """A ``Model`` whose outputs are scripted per prompt: ``scripts[prompt_bytes]`` is the
    exact list of tokens it generates, then EOS forever. Keeps per-slot state like a KV cache
    and records every step it ran."""

    def __init__(
        self,
        scripts: dict[bytes, Sequence[int]],
        *,
        max_num_seqs: int = 4,
        context_length: int = 4096,
        max_tokens_per_row: int | None = None,
    ) -> None:
        self.scripts = {key: list(value) for key, value in scripts.items()}
        self.tokenizer = ByteTokenizer()
        self.capabilities = ModelCapabilities(
            name="scripted",
            backend="test",
            context_length=context_length,
            max_num_seqs=max_num_seqs,
            vocab_size=257,
            eos_token_ids=frozenset({EOS}),
            keeps_kv_cache=True,
            max_tokens_per_row=max_tokens_per_row or context_length,
        )
        self.state: list[list[int]] = [[] for _ in range(max_num_seqs)]
        self.steps: list[StepBatch] = []
        self.released: list[int] = []

    def step(self, batch: StepBatch) -> StepOutput:
        self.steps.append(batch)
        out: list[int | None] = []
        for row in batch.rows:
            if row.position == 0:
                self.state[row.slot] = []
            assert row.position == len(self.state[row.slot]), "row does not continue its slot"
            self.state[row.slot].extend(row.token_ids)
            if not row.sample:
                out.append(None)
                continue
            tokens = self.state[row.slot]
            prompt, generated = self._split(tokens)
            script = self.scripts.get(bytes(prompt), [])
            out.append(script[generated] if generated < len(script) else EOS)
        return StepOutput.of_token_ids(out)

    def _split(self, tokens: list[int]) -> tuple[list[int], int]:
        matches = [p for p in self.scripts if bytes(tokens[: len(p)]) == p]
        if not matches:
            return tokens, 0
        prompt = max(matches, key=len)
        return list(prompt), len(tokens) - len(prompt)

    def release(self, slot: int) -> None:
        self.released.append(slot)


@dataclass
class Collected:
    """Events of one request, as its client would see them."""

    events: list[StreamEvent] = field(default_factory=list)

    def __call__(self, event: StreamEvent) -> None:
        self.events.append(event)

    @property
    def final(self) -> FinalEvent:
        finals = [e for e in self.events if isinstance(e, FinalEvent)]
        assert len(finals) == 1, f"expected exactly one final event, got {len(finals)}"
        assert self.events[-1] is finals[0], "final event is not last"
        return finals[0]

    @property
    def streamed_text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, TokenEvent))

    @property
    def streamed_ids(self) -> list[int]:
        return [t for e in self.events if isinstance(e, TokenEvent) for t in e.token_ids]


def make_request(
    request_id: str,
    prompt: str | bytes = "p",
    *,
    max_tokens: int = 16,
    stop: Iterable[str] = (),
    stop_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
) -> GenerationRequest:
    data = prompt.encode() if isinstance(prompt, str) else prompt
    return GenerationRequest(
        request_id=request_id,
        prompt_token_ids=tuple(data),
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0, seed=0),
        stop=StopCriteria(tuple(stop), frozenset(stop_token_ids), ignore_eos),
    )


def make_sequence(request: GenerationRequest) -> tuple[EngineSequence, Collected]:
    sink = Collected()
    return EngineSequence(request=request, output=RequestOutput(request, sink)), sink


def make_scheduler(
    model, *, policy: AdmissionPolicy | None = None, max_num_batched_tokens: int | None = None
) -> Scheduler:
    caps = model.capabilities
    return Scheduler(
        capabilities=caps,
        tokenizer=model.tokenizer,
        policy=policy or ContinuousBatching(),
        metrics=EngineMetrics(),
        release_slot=model.release,
        max_num_batched_tokens=max_num_batched_tokens
        or max(caps.max_num_seqs, caps.max_tokens_per_row),
    )


def run_until_idle(scheduler: Scheduler, model, *, max_steps: int = 10_000) -> int:
    """Runs the loop's steps synchronously until nothing is left; returns model calls made."""
    calls = 0
    while scheduler.has_work:
        scheduler.admit_waiting()
        step = scheduler.schedule()
        assert step is not None, "work left but nothing scheduled"
        scheduler.apply(step, model.step(step.batch))
        calls += 1
        assert calls < max_steps, "loop does not terminate"
    return calls


@pytest.fixture
def scripted():
    return ScriptedModel
