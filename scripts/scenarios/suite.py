"""slotserve benchmarks: starts the servers itself, runs five scenarios, writes a markdown report,
PNGs and a JSON of every number (``python scripts/bench.py``, the command line of this module).

    python scripts/bench.py                          # all scenarios, 3 repeats, into docs/
    python scripts/bench.py --quick --out-dir /tmp/b  # 1 repeat, small sizes, no SmolLM2
    python scripts/bench.py --scenarios 1,5 --repeats 5

Scenarios (modules of ``scenarios/``, numbered as the report's sections):
  1. saturation: mock, 10 ms step, 64 slots, saturating closed loop: delivered tok/s / ideal
     (slots / step).
  2. sse_ceiling: mock, 0 ms step: SSE tok/s through the full stack / a bare Starlette SSE
     endpoint (scripts/bench_sse_ceiling.py) streaming the same events: the HTTP layer's ceiling.
  3. scheduling: continuous vs static scheduling, exponential output lengths, same requests:
     model calls, tok/s, p99 TTFT, as ratios continuous/static (mock, and SmolLM2 unless --quick).
  4. concurrency: SmolLM2 at concurrency 1, 4, 16: tok/s, TTFT and TPOT p50/p99 (skipped under
     --quick).
  5. cancel_storm: cancellation storm (mock, 10 ms, 32 slots): 30% DELETEd after k tokens;
     cancel -> slot free from the server's histogram, and throughput against a no-cancel
     baseline.

Every number is the median of --repeats runs; a ratio is computed inside each repeat (both sides
measured back to back, in alternating order) and then its median is taken. Servers are
subprocesses on free ports of 127.0.0.1 (``--log-level warning``: no access log); the load runs
in this process through scripts/loadgen. Output: <out-dir>/BENCHMARKS.md, bench_results.json,
bench_s<N>_*.png.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from harness.server import ROOT
from rich.console import Console

from scenarios.cancel_storm import scenario_cancel_storm
from scenarios.concurrency import scenario_concurrency
from scenarios.context import Context
from scenarios.plan import Plan, build_plan
from scenarios.report import Section, machine, render_markdown, results_json
from scenarios.saturation import scenario_saturation
from scenarios.scheduling import scenario_scheduling
from scenarios.sse_ceiling import scenario_sse_ceiling

SCENARIOS: dict[int, Callable[[Context], Awaitable[Section]]] = {
    1: scenario_saturation,
    2: scenario_sse_ceiling,
    3: scenario_scheduling,
    4: scenario_concurrency,
    5: scenario_cancel_storm,
}


async def run_all(plan: Plan, console: Console) -> int:
    started = time.perf_counter()
    before = machine()
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    sections: list[Section] = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="slotserve-bench-") as logs:
        ctx = Context(plan, Path(logs), console)
        for number in plan.scenarios:
            ctx.say(f"scenario {number} ...")
            began = time.perf_counter()
            try:
                section = await SCENARIOS[number](ctx)
            except Exception as exc:  # one broken scenario must not lose the others' numbers
                console.print_exception()
                failed = True
                section = Section(
                    number,
                    f"Scenario {number}",
                    "",
                    ctx.command(number),
                    skipped=f"failed: {type(exc).__name__}: {exc}",
                )
            section.seconds = time.perf_counter() - began
            sections.append(section)
            ctx.say(f"scenario {number}: {section.skipped or section.reading}")
    info = {
        "machine_before": before,
        "machine_after": machine(),
        "finished_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "runtime_s": time.perf_counter() - started,
    }
    (plan.out_dir / "BENCHMARKS.md").write_text(render_markdown(plan, sections, info))
    (plan.out_dir / "bench_results.json").write_text(results_json(plan, sections, info))
    console.print(f"wrote {plan.out_dir / 'BENCHMARKS.md'} in {info['runtime_s']:.0f} s")
    return 1 if failed else 0


def parse_scenarios(text: str) -> tuple[int, ...]:
    try:
        numbers = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError("expected numbers like 1,3,5") from None
    if not numbers or any(n not in SCENARIOS for n in numbers):
        raise argparse.ArgumentTypeError(f"scenarios are {', '.join(map(str, SCENARIOS))}")
    return numbers


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 repeat, small sizes, no SmolLM2 (unless --smollm2)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs per measurement; the report gives medians (default 3, 1 with --quick)",
    )
    parser.add_argument(
        "--scenarios",
        type=parse_scenarios,
        default=tuple(SCENARIOS),
        help="comma-separated scenario numbers (default: 1,2,3,4,5)",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=ROOT / "docs",
        help="where BENCHMARKS.md, bench_results.json and the PNGs go",
    )
    parser.add_argument(
        "--smollm2",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the SmolLM2 parts (default: yes, except under --quick)",
    )
    parser.add_argument(
        "--s1-slots", type=int, default=None, help="scenario 1's slots (default 64)"
    )
    parser.add_argument(
        "--s1-step-ms", type=float, default=None, help="scenario 1's mock step in ms (default 10)"
    )
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    plan = build_plan(parse_args(argv), argv)
    return asyncio.run(run_all(plan, Console()))
