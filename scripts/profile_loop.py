"""The engine loop's own cost, phase by phase, per row: the server's ``AsyncEngine`` over the mock
kept saturated in one process, under cProfile.

    python scripts/profile_loop.py                      # 16, 64 and 256 slots, 0 ms step
    python scripts/profile_loop.py --slots 64 --steps 400
    python scripts/profile_loop.py --step-ms 10         # rows/s against slots / step too

A closed loop of ``2 x slots`` requests (greedy, ``ignore_eos``, ``--output-len`` tokens each) is
kept in flight; each request's events are drained by its own task, as an SSE answer would. The
profile covers ``--steps`` model calls after a warm-up; each phase of the loop is the summed
time of the functions that make it (cProfile's inclusive time, ``PHASES``), divided by the
rows the profiled steps carried, in CPU time of the event loop's thread (so another process
on the machine does not inflate it). cProfile slows Python by about a factor of two, so the numbers
compare phases and commits measured the same way. Measured without it: ``steps/s``, and the
loop's cost on the critical path as the model thread sees it, the wall time from one step's
return to the next step's start (mean per step: a step built ahead starts at once, one built
after the previous step's output waits for the loop). ``--no-schedule-ahead`` builds every
step after the previous one's output (``AsyncEngine(schedule_ahead=False)``).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import itertools
import pstats
import time
from dataclasses import dataclass

from app.engine.engine import AsyncEngine
from app.engine.request import GenerationRequest, StopCriteria
from app.models.base import SamplingParams
from app.models.mock import MockModelRunner

# phase -> (file suffix, function name) pairs whose inclusive times add up to it; a function a
# commit lacks counts 0 (the loop before the overlap applied a step in one ``apply``).
PHASES: dict[str, tuple[tuple[str, str], ...]] = {
    "take commands": (("engine/inbox.py", "take_ready"), ("engine/engine.py", "_apply")),
    "admit": (("engine/scheduler.py", "admit_waiting"),),
    "schedule": (("engine/scheduler.py", "schedule"), ("engine/scheduler.py", "schedule_ahead")),
    "build rows": (
        ("engine/step_rows.py", "decode_row"),
        ("engine/step_rows.py", "prefill_row"),
        ("engine/lookahead.py", "pending_row"),
    ),
    "apply": (
        ("engine/scheduler.py", "apply"),
        ("engine/scheduler.py", "advance"),
        ("engine/scheduler.py", "emit_text"),
    ),
    "emit": (
        ("engine/handle.py", "push"),
        ("engine/detokenizer.py", "append"),
        ("models/mock.py", "decode_bytes"),
    ),
}
# "schedule" includes "build rows"; "apply" includes "emit" (both reported exclusive).
_INCLUDED = {"schedule": ("build rows",), "apply": ("emit",)}


@dataclass(frozen=True, slots=True)
class LoopProfile:
    """One slot count's result: microseconds per row of each phase, and steps per second."""

    slots: int
    steps: int
    rows: int
    us_per_row: dict[str, float]
    steps_per_s: float
    rows_over_ideal: float
    between_steps_ms: float


async def saturate(engine: AsyncEngine, slots: int, output_len: int, stop: asyncio.Event) -> None:
    """Keeps ``2 x slots`` requests in flight until ``stop`` is set."""
    ids = itertools.count()

    async def client() -> None:
        while not stop.is_set():
            request = GenerationRequest(
                request_id=f"r{next(ids)}",
                prompt_token_ids=tuple(b"profile!"),
                max_tokens=output_len,
                sampling=SamplingParams(temperature=0.0, seed=1),
                stop=StopCriteria(ignore_eos=True),
            )
            handle = engine.submit(request)
            async for _ in handle.events():
                pass

    await asyncio.gather(*(client() for _ in range(2 * slots)))


class _StepClock:
    """Wraps a model's ``step`` (on the model thread) to record when each call starts and
    returns, in ``time.perf_counter`` seconds."""

    def __init__(self, model: MockModelRunner) -> None:
        self.spans: list[tuple[float, float]] = []
        self._step = model.step
        model.step = self  # type: ignore[method-assign]

    def __call__(self, batch):  # noqa: ANN001, ANN204 (the model's own signature)
        started = time.perf_counter()
        try:
            return self._step(batch)
        finally:
            self.spans.append((started, time.perf_counter()))

    def between_steps_ms(self, first: int) -> float:
        """Mean wall time from a step's return to the next one's start, from span ``first``."""
        spans = self.spans[first:]
        gaps = [after[0] - before[1] for before, after in zip(spans, spans[1:], strict=False)]
        return 1e3 * sum(gaps) / max(len(gaps), 1)


async def profile_one(
    slots: int, steps: int, output_len: int, step_ms: float, *, schedule_ahead: bool = True
) -> LoopProfile:
    model = MockModelRunner(max_num_seqs=slots, step_ms=step_ms)
    clock = _StepClock(model)
    engine = AsyncEngine(model, schedule_ahead=schedule_ahead)
    await engine.start()
    stop = asyncio.Event()
    load = asyncio.ensure_future(saturate(engine, slots, output_len, stop))

    async def steps_done(count: int) -> None:
        target = model.num_model_calls + count
        while model.num_model_calls < target:
            await asyncio.sleep(0.005)

    await steps_done(max(20, steps // 5))  # warm-up: every slot busy
    calls, started = model.num_model_calls, time.perf_counter()
    first_span = len(clock.spans)
    rows_before = engine.metrics.batch_size._sum.get()  # noqa: SLF001 (a histogram's sum)
    await steps_done(steps)
    seconds = time.perf_counter() - started
    between_steps_ms = clock.between_steps_ms(first_span)
    steps_per_s = (model.num_model_calls - calls) / seconds
    rows_per_s = (engine.metrics.batch_size._sum.get() - rows_before) / seconds  # noqa: SLF001
    ideal = slots * 1000.0 / step_ms if step_ms > 0 else float("nan")

    rows_before = engine.metrics.batch_size._sum.get()  # noqa: SLF001 (a histogram's sum)
    calls = model.num_model_calls
    profiler = cProfile.Profile(time.thread_time)  # the loop thread's CPU, not the wall
    profiler.enable()
    await steps_done(steps)
    profiler.disable()
    profiled_steps = model.num_model_calls - calls
    rows = int(engine.metrics.batch_size._sum.get() - rows_before)  # noqa: SLF001
    stop.set()
    await engine.stop()
    load.cancel()
    return LoopProfile(
        slots,
        profiled_steps,
        rows,
        phase_costs(profiler, rows),
        steps_per_s,
        rows_per_s / ideal,
        between_steps_ms,
    )


def phase_costs(profiler: cProfile.Profile, rows: int) -> dict[str, float]:
    """Microseconds per row of each phase (inclusive time of its functions, exclusive of the
    phases nested in it)."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    totals = dict.fromkeys(PHASES, 0.0)
    for (filename, _line, name), (_cc, _nc, _tt, cumulative, _callers) in stats.items():
        for phase, functions in PHASES.items():
            if any(filename.endswith(suffix) and name == fn for suffix, fn in functions):
                totals[phase] += cumulative
    for outer, inner in _INCLUDED.items():
        totals[outer] -= sum(totals[phase] for phase in inner)
    return {phase: max(0.0, seconds) * 1e6 / max(rows, 1) for phase, seconds in totals.items()}


def render(results: list[LoopProfile]) -> str:
    header = ["phase (us per row)", *(f"{r.slots} slots" for r in results)]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for phase in PHASES:
        cells = [f"{r.us_per_row[phase]:.2f}" for r in results]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    total = [f"{sum(r.us_per_row[p] for p in PHASES):.2f}" for r in results]
    lines.append("| **all phases** | " + " | ".join(total) + " |")
    between = [f"{r.between_steps_ms:.3f}" for r in results]
    lines.append(
        "| **between two steps, ms (the critical path; no profiler)** | "
        + " | ".join(between)
        + " |"
    )
    lines.append(
        "| steps/s (no profiler) | " + " | ".join(f"{r.steps_per_s:.0f}" for r in results) + " |"
    )
    lines.append(
        "| rows/s over slots / step (no profiler) | "
        + " | ".join(f"{r.rows_over_ideal:.3f}" for r in results)
        + " |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", default="16,64,256", help="comma-separated slot counts")
    parser.add_argument("--steps", type=int, default=300, help="model calls profiled")
    parser.add_argument("--output-len", type=int, default=64, help="tokens per request")
    parser.add_argument("--step-ms", type=float, default=0.0, help="the mock's step, in ms")
    parser.add_argument(
        "--schedule-ahead",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="build step N+1 while step N runs when the scheduler can (the server's default)",
    )
    args = parser.parse_args(argv)
    results = [
        asyncio.run(
            profile_one(
                int(slots),
                args.steps,
                args.output_len,
                args.step_ms,
                schedule_ahead=args.schedule_ahead,
            )
        )
        for slots in args.slots.split(",")
    ]
    print(render(results))


if __name__ == "__main__":
    main()
