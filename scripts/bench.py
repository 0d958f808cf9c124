"""slotserve benchmarks: starts the servers itself, runs five scenarios, writes a markdown report,
PNGs and a JSON of every number.

    python scripts/bench.py                          # all scenarios, 3 repeats, into docs/
    python scripts/bench.py --quick --out-dir /tmp/b  # 1 repeat, small sizes, no SmolLM2
    python scripts/bench.py --scenarios 1,5 --repeats 5

Scenarios:
  1. mock, 10 ms step, 64 slots, saturating closed loop: delivered tok/s / ideal (slots / step).
  2. mock, 0 ms step: SSE tok/s through the full stack / a bare Starlette SSE endpoint
     (scripts/bench_sse_ceiling.py) streaming the same events: the HTTP layer's ceiling.
  3. continuous vs static scheduling, exponential output lengths, same requests: model calls,
     tok/s, p99 TTFT, as ratios continuous/static (mock, and SmolLM2 unless --quick).
  4. SmolLM2 at concurrency 1, 4, 16: tok/s, TTFT and TPOT p50/p99 (skipped under --quick).
  5. cancellation storm (mock, 10 ms, 32 slots): 30% DELETEd after k tokens; cancel -> slot
     free from the server's histogram, and throughput against a no-cancel baseline.

Every number is the median of --repeats runs; a ratio is computed inside each repeat (both sides
measured back to back, in alternating order) and then its median is taken. Servers are
subprocesses on free ports of 127.0.0.1 (``--log-level warning``: no access log); the load runs
in this process through scripts/loadgen. Output: <out-dir>/BENCHMARKS.md, bench_results.json,
bench_s<N>_*.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import httpx
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_plots  # noqa: E402
from bench_servers import ROOT, Run, Server, ServerSpec, Window, launched, measure  # noqa: E402
from loadgen import (  # noqa: E402
    CancelMode,
    CancelPolicy,
    LengthDist,
    LoadConfig,
    Outcome,
    WorkloadConfig,
)
from loadgen.stats import tokens_per_second  # noqa: E402

Numbers = dict[str, float | None]
REQUEST_TIMEOUT_S = 300.0
SMOLLM2_READY_S = 300.0

# --------------------------------------------------------------------------- sizes


@dataclass(frozen=True, slots=True)
class SaturationSizes:
    """Scenario 1: a closed loop of 2 x slots keeps every slot busy (the queue refills them)."""

    slots: int = 64
    step_ms: float = 10.0
    output_len: int = 128
    prompt_len: int = 8
    warmup_s: float = 1.5
    duration_s: float = 8.0
    bin_s: float = 0.25


@dataclass(frozen=True, slots=True)
class SseSizes:
    """Scenario 2: the same closed loop against the full stack and the two ceilings."""

    slots: int = 16
    concurrency: int = 16
    output_len: int = 256
    prompt_len: int = 8
    warmup_s: float = 1.0
    duration_s: float = 5.0


@dataclass(frozen=True, slots=True)
class SchedulingSizes:
    """Scenario 3, one model: a closed loop of 2 x slots over a fixed set of requests."""

    model: str
    slots: int
    num_requests: int
    mean_output_len: int
    prompt_len: int
    step_ms: float = 0.0  # mock only


@dataclass(frozen=True, slots=True)
class ConcurrencySizes:
    """Scenario 4: SmolLM2, ``requests[i]`` requests at concurrency ``levels[i]``."""

    slots: int = 16
    levels: tuple[int, ...] = (1, 4, 16)
    requests: tuple[int, ...] = (3, 8, 16)
    output_len: int = 64
    prompt_len: int = 16


@dataclass(frozen=True, slots=True)
class CancelSizes:
    """Scenario 5: 2 x slots clients, so a queue is there to refill a freed slot at once."""

    slots: int = 32
    step_ms: float = 10.0
    concurrency: int = 64
    output_len: int = 128
    prompt_len: int = 8
    cancel_fraction: float = 0.3
    cancel_after_tokens: int = 16
    warmup_s: float = 1.5
    duration_s: float = 8.0
    bin_s: float = 0.5


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything one invocation runs; `build_plan` makes the full or the --quick one."""

    scenarios: tuple[int, ...]
    repeats: int
    quick: bool
    smollm2: bool
    out_dir: Path
    argv: tuple[str, ...]
    s1: SaturationSizes = SaturationSizes()
    s2: SseSizes = SseSizes()
    s3_mock: SchedulingSizes = SchedulingSizes("mock", 16, 128, 48, 8, step_ms=10.0)
    s3_smollm2: SchedulingSizes = SchedulingSizes("smollm2", 8, 24, 32, 16)
    s4: ConcurrencySizes = ConcurrencySizes()
    s5: CancelSizes = CancelSizes()


def build_plan(args: argparse.Namespace, argv: Sequence[str]) -> Plan:
    plan = Plan(
        scenarios=args.scenarios,
        repeats=args.repeats if args.repeats is not None else (1 if args.quick else 3),
        quick=args.quick,
        smollm2=args.smollm2 if args.smollm2 is not None else not args.quick,
        out_dir=args.out_dir,
        argv=tuple(argv),
    )
    if not args.quick:
        return plan
    return replace(
        plan,
        s1=SaturationSizes(output_len=32, warmup_s=0.4, duration_s=1.4),
        s2=SseSizes(output_len=128, warmup_s=0.2, duration_s=0.8),
        s3_mock=SchedulingSizes("mock", 16, 32, 16, 8, step_ms=10.0),
        s3_smollm2=SchedulingSizes("smollm2", 4, 8, 8, 8),
        s4=ConcurrencySizes(levels=(1, 4, 16), requests=(1, 4, 16), output_len=8),
        s5=CancelSizes(output_len=32, cancel_after_tokens=8, warmup_s=0.4, duration_s=1.4),
    )


# --------------------------------------------------------------------------- results


@dataclass(slots=True)
class Section:
    """One scenario's report: per-repeat numbers (flat, dotted keys), their medians, and the
    markdown pieces. ``skipped`` replaces everything else with a note."""

    number: int
    title: str
    measures: str
    command: str
    config: dict[str, object] = field(default_factory=dict)
    repeats: list[Numbers] = field(default_factory=list)
    tables: list[str] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    reading: str = ""
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None
    seconds: float = 0.0

    @property
    def medians(self) -> Numbers:
        return summarize(self.repeats, statistics.median)

    @property
    def lows(self) -> Numbers:
        return summarize(self.repeats, min)

    @property
    def highs(self) -> Numbers:
        return summarize(self.repeats, max)


def summarize(rows: Sequence[Numbers], how: Callable[[list[float]], float]) -> Numbers:
    keys = dict.fromkeys(key for row in rows for key in row)
    out: Numbers = {}
    for key in keys:
        values = [v for row in rows if (v := row.get(key)) is not None and not math.isnan(v)]
        out[key] = how(values) if values else None
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


@dataclass(slots=True)
class Context:
    plan: Plan
    log_dir: Path
    console: Console

    def say(self, text: str) -> None:
        self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {text}")

    def command(self, scenario: int) -> str:
        quick = " --quick" if self.plan.quick else ""
        smol = " --smollm2" if self.plan.quick and self.plan.smollm2 else ""
        return (
            f"python scripts/bench.py --scenarios {scenario} --repeats {self.plan.repeats}"
            f"{quick}{smol}"
        )


def mock_flags(slots: int, step_ms: float, *extra: str) -> tuple[str, ...]:
    return (
        "--model",
        "mock",
        "--mock-step-ms",
        f"{step_ms:g}",
        "--max-num-seqs",
        str(slots),
        *extra,
    )


def smollm2_spec(name: str, slots: int, *extra: str) -> ServerSpec:
    flags = ("--model", "smollm2", "--max-num-seqs", str(slots), "--max-model-len", "512", *extra)
    return ServerSpec.app(name, *flags, ready_timeout_s=SMOLLM2_READY_S)


async def warm_up(server: Server) -> None:
    """One short request, so that first-call costs (torch kernels, caches) stay out of runs."""
    async with httpx.AsyncClient(trust_env=False, timeout=REQUEST_TIMEOUT_S) as http:
        body = {"prompt": "warm up", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        response = await http.post(server.url + "/generate", json=body)
        response.raise_for_status()


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(" --- " if i == 0 else " ---: " for i in range(len(header))) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def metric_rows(section: Section, rows: Sequence[tuple[str, str, str]]) -> list[list[str]]:
    """(label, key, format) -> [label, median, min, max] (min and max only with repeats > 1)."""
    med, lo, hi = section.medians, section.lows, section.highs
    many = len(section.repeats) > 1
    out = []
    for label, key, spec in rows:
        cells = [label, fmt(med.get(key), spec)]
        if many:
            cells += [fmt(lo.get(key), spec), fmt(hi.get(key), spec)]
        out.append(cells)
    return out


def median_header(section: Section, first: str = "metric") -> list[str]:
    return [first, "median", "min", "max"] if len(section.repeats) > 1 else [first, "value"]


def failures_note(section: Section, what: str, failures: float | None) -> None:
    if failures:
        section.notes.append(
            f"{failures:.0f} request(s) of {what} failed (not ok, not "
            "cancelled by the client): see bench_results.json."
        )


# --------------------------------------------------------------------------- 1. saturation


async def scenario_saturation(ctx: Context) -> Section:
    s = ctx.plan.s1
    ideal = s.slots * 1000.0 / s.step_ms
    section = Section(
        1,
        "Saturation: delivered tokens/s against the ideal",
        f"Mock model with a {s.step_ms:g} ms step and {s.slots} slots, driven by a closed loop of "
        f"{2 * s.slots} streaming clients (so a queue refills every slot at once), "
        f"{s.output_len} output tokens each (ignore_eos). The ideal is slots / step = "
        f"{ideal:.0f} tok/s. Measured over a steady window ({s.warmup_s:g} s to "
        f"{s.duration_s:g} s, skipping the ramp-up and the drain): tokens the clients received, "
        "and the server's own view from /metrics (generated tokens, mean batch size, model "
        "calls and model step time from the histograms).",
        ctx.command(1),
        config=asdict(s),
    )
    spec = ServerSpec.app("s1-mock", *mock_flags(s.slots, s.step_ms))
    series: list[float] = []
    async with launched([spec], ctx.log_dir) as (server,):
        await warm_up(server)
        for repeat in range(ctx.plan.repeats):
            config = LoadConfig(
                url=server.url,
                concurrency=2 * s.slots,
                duration_s=s.duration_s,
                timeout_s=REQUEST_TIMEOUT_S,
                workload=WorkloadConfig(
                    prompt_len=s.prompt_len,
                    output_len=s.output_len,
                    ignore_eos=True,
                    temperature=0.0,
                    seed=repeat,
                ),
            )
            run = await measure(server, config, (s.warmup_s, s.duration_s))
            numbers = saturation_numbers(run, ideal)
            section.repeats.append(numbers)
            series = series or tokens_per_second(run.result.records, s.bin_s)
            ctx.say(
                f"  1: repeat {repeat + 1}: {numbers['delivered_tok_s']:.0f} tok/s delivered "
                f"({numbers['delivered_over_ideal']:.0%} of ideal)"
            )
    image = "bench_s1_saturation.png"
    bench_plots.saturation(
        ctx.plan.out_dir / image,
        s.bin_s,
        series,
        ideal,
        (s.warmup_s, s.duration_s),
        f"Mock, {s.step_ms:g} ms step, {s.slots} slots, {2 * s.slots} clients (first repeat)",
    )
    section.images.append(image)
    section.tables.append(
        table(
            median_header(section),
            metric_rows(
                section,
                [
                    ("ideal tok/s (slots / step)", "ideal_tok_s", ".0f"),
                    ("delivered tok/s (clients, steady window)", "delivered_tok_s", ".0f"),
                    ("**delivered / ideal**", "delivered_over_ideal", ".3f"),
                    (
                        "server: generated tok/s (generated_tokens_total / duration)",
                        "server_generated_tok_s",
                        ".0f",
                    ),
                    ("server: generated / ideal", "server_over_ideal", ".3f"),
                    ("server: mean batch size (batch_size histogram)", "mean_batch_size", ".1f"),
                    (
                        "server: model calls/s (batch_size _count / duration)",
                        "model_calls_per_s",
                        ".1f",
                    ),
                    (
                        "server: loop iteration (ms) (duration / model calls)",
                        "loop_iteration_ms",
                        ".2f",
                    ),
                    ("server: model step (ms) (model_step_seconds mean)", "model_step_ms", ".2f"),
                    ("server CPU (% of one core)", "server_cpu_pct", ".0f"),
                    ("client CPU (% of one core)", "client_cpu_pct", ".0f"),
                    (
                        "server threads waiting for a CPU (% of the window)",
                        "server_wait_pct",
                        ".0f",
                    ),
                    ("client waiting for a CPU (% of the window)", "client_wait_pct", ".0f"),
                    ("whole run incl. ramp and drain: delivered tok/s", "run_output_tok_s", ".0f"),
                ],
            ),
        )
    )
    med = section.medians
    fill = ratio(med["mean_batch_size"], s.slots)
    pace = ratio(s.step_ms, med["loop_iteration_ms"])
    section.reading = (
        f"Clients received {fmt(med['delivered_over_ideal'], '.0%')} of the ideal "
        f"{ideal:.0f} tok/s; the server's own count is {fmt(med['server_over_ideal'], '.0%')}, "
        f"= batch fill {fmt(fill, '.0%')} x pace {fmt(pace, '.0%')} (a loop iteration takes "
        f"{fmt(med['loop_iteration_ms'], '.1f')} ms for a {s.step_ms:g} ms model step, of "
        f"which the step itself is {fmt(med['model_step_ms'], '.1f')} ms, while the server's "
        f"threads waited for a CPU {fmt(med['server_wait_pct'], '.0f')}% of the time)."
    )
    failures_note(section, "the runs", med.get("failed_requests"))
    return section


def saturation_numbers(run: Run, ideal: float) -> Numbers:
    window = run.window()
    seconds = window.seconds
    delivered = window.tokens_received(run.records()) / seconds
    generated = window.counter("slotserve_generated_tokens_total") / seconds
    batches = window.histogram("slotserve_batch_size")
    steps = window.histogram("slotserve_model_step_seconds")
    server_cpu, client_cpu = window.cpu_percent()
    server_wait, client_wait = window.wait_percent()
    return {
        "ideal_tok_s": ideal,
        "window_s": seconds,
        "delivered_tok_s": delivered,
        "delivered_over_ideal": delivered / ideal,
        "server_generated_tok_s": generated,
        "server_over_ideal": generated / ideal,
        "mean_batch_size": batches.mean,
        "model_calls_per_s": batches.count / seconds,
        "loop_iteration_ms": 1000.0 * seconds / batches.count if batches.count else None,
        "model_step_ms": None if steps.mean is None else 1000.0 * steps.mean,
        "server_cpu_pct": server_cpu,
        "client_cpu_pct": client_cpu,
        "server_wait_pct": server_wait,
        "client_wait_pct": client_wait,
        "run_output_tok_s": run.result.summary.output_token_throughput,
        "failed_requests": run.failures(),
    }


# --------------------------------------------------------------------------- 2. SSE ceiling


SSE_TARGETS = ("full", "sse", "bare")
SSE_LABELS = {
    "full": "full stack (mock, 0 ms step)",
    "sse": "ceiling: sse-starlette",
    "bare": "ceiling: bare Starlette",
}


async def scenario_sse_ceiling(ctx: Context) -> Section:
    s = ctx.plan.s2
    section = Section(
        2,
        "SSE throughput: the full stack against the HTTP layer's ceiling",
        f"Tokens/s streamed to {s.concurrency} concurrent clients ({s.output_len} tokens per "
        f"request, ignore_eos) by the mock server with a 0 ms step and {s.slots} slots, beside "
        "the same client against `scripts/bench_sse_ceiling.py`: a bare Starlette app on the "
        "same uvicorn that streams the same number of `token` events of the same shape and size "
        "(the mock's alphabet, multi-byte characters as one event), with no engine, model or "
        "validation. The ceiling has two endpoints: a plain `StreamingResponse` (the HTTP "
        "layer alone) and `sse_starlette.EventSourceResponse` as the server uses it (the SSE "
        "library's share). Steady window "
        f"{s.warmup_s:g} s to {s.duration_s:g} s; the three targets run back to back in a "
        "rotating order within each repeat.",
        ctx.command(2),
        config=asdict(s),
    )
    specs = [ServerSpec.app("s2-mock", *mock_flags(s.slots, 0.0)), ServerSpec.ceiling("s2-ceil")]
    async with launched(specs, ctx.log_dir) as (server, ceiling):
        await warm_up(server)
        targets = {
            "full": (server, server.url),
            "sse": (ceiling, ceiling.url + "/sse-starlette"),
            "bare": (ceiling, ceiling.url),
        }
        for repeat in range(ctx.plan.repeats):
            order = SSE_TARGETS[repeat % 3 :] + SSE_TARGETS[: repeat % 3]
            numbers: Numbers = {}
            for name in order:
                target, url = targets[name]
                config = LoadConfig(
                    url=url,
                    concurrency=s.concurrency,
                    duration_s=s.duration_s,
                    timeout_s=REQUEST_TIMEOUT_S,
                    workload=WorkloadConfig(
                        prompt_len=s.prompt_len,
                        output_len=s.output_len,
                        ignore_eos=True,
                        temperature=0.0,
                        seed=repeat,
                    ),
                )
                run = await measure(target, config, (s.warmup_s, s.duration_s))
                numbers |= sse_numbers(name, run, has_metrics=target is server)
            numbers["full_over_bare"] = ratio(numbers["full.tok_s"], numbers["bare.tok_s"])
            numbers["full_over_sse"] = ratio(numbers["full.tok_s"], numbers["sse.tok_s"])
            numbers["sse_over_bare"] = ratio(numbers["sse.tok_s"], numbers["bare.tok_s"])
            numbers["full_over_bare_events"] = ratio(
                numbers["full.events_s"], numbers["bare.events_s"]
            )
            section.repeats.append(numbers)
            ctx.say(
                f"  2: repeat {repeat + 1}: full {numbers['full.tok_s']:.0f}, bare "
                f"{numbers['bare.tok_s']:.0f} tok/s ({numbers['full_over_bare']:.0%})"
            )
    med, lo, hi = section.medians, section.lows, section.highs
    rows = [
        ("tok/s received (steady window)", "tok_s", ".0f"),
        ("events/s received", "events_s", ".0f"),
        ("tokens per event", "tokens_per_event", ".2f"),
        ("server CPU (% of one core)", "server_cpu_pct", ".0f"),
        ("client CPU (% of one core)", "client_cpu_pct", ".0f"),
        ("server waiting for a CPU (% of the window)", "server_wait_pct", ".0f"),
        ("client waiting for a CPU (% of the window)", "client_wait_pct", ".0f"),
        ("server: generated tok/s (/metrics)", "generated_tok_s", ".0f"),
        ("failed requests", "failed_requests", ".0f"),
    ]
    section.tables.append(
        table(
            ["metric (median)", *(SSE_LABELS[t] for t in SSE_TARGETS)],
            [
                [label, *(fmt(med.get(f"{t}.{key}"), spec) for t in SSE_TARGETS)]
                for label, key, spec in rows
            ],
        )
    )
    section.tables.append(
        table(
            median_header(section, "ratio (per repeat, then median)"),
            metric_rows(
                section,
                [
                    ("**full stack / bare Starlette**", "full_over_bare", ".3f"),
                    ("full stack / sse-starlette", "full_over_sse", ".3f"),
                    ("sse-starlette / bare Starlette", "sse_over_bare", ".3f"),
                    ("full stack / bare Starlette, in events/s", "full_over_bare_events", ".3f"),
                ],
            ),
        )
    )
    image = "bench_s2_sse_ceiling.png"
    bench_plots.grouped_bars(
        ctx.plan.out_dir / image,
        ["tokens/s", "events/s"],
        {
            SSE_LABELS[t]: [
                (med[f"{t}.{k}"] or 0, lo[f"{t}.{k}"] or 0, hi[f"{t}.{k}"] or 0)
                for k in ("tok_s", "events_s")
            ]
            for t in SSE_TARGETS
        },
        f"SSE streaming, {s.concurrency} clients x {s.output_len} tokens: median, min-max "
        f"over {len(section.repeats)} repeat(s)",
        "per second (steady window)",
    )
    section.images.append(image)
    section.reading = (
        f"The full stack streams {fmt(med['full.tok_s'], '.0f')} tok/s, "
        f"{fmt(med['full_over_bare'], '.0%')} of the bare-Starlette ceiling "
        f"({fmt(med['bare.tok_s'], '.0f')} tok/s) and {fmt(med['full_over_sse'], '.0%')} of "
        f"sse-starlette alone ({fmt(med['sse.tok_s'], '.0f')} tok/s), with the same client; "
        f"the client itself used {fmt(med['bare.client_cpu_pct'], '.0f')}% of a core against "
        "the ceiling, so on 2 shared cores the ceiling is partly the client's."
    )
    failures_note(
        section, "the runs", sum((med.get(f"{t}.failed_requests") or 0) for t in SSE_TARGETS)
    )
    return section


def sse_numbers(name: str, run: Run, *, has_metrics: bool) -> Numbers:
    window = run.window()
    records = run.records()
    tokens = window.tokens_received(records)
    events = window.events_received(records)
    server_cpu, client_cpu = window.cpu_percent()
    server_wait, client_wait = window.wait_percent()
    generated = (
        window.counter("slotserve_generated_tokens_total") / window.seconds if has_metrics else None
    )
    return {
        f"{name}.tok_s": tokens / window.seconds,
        f"{name}.events_s": events / window.seconds,
        f"{name}.tokens_per_event": ratio(tokens, events),
        f"{name}.server_cpu_pct": server_cpu,
        f"{name}.client_cpu_pct": client_cpu,
        f"{name}.server_wait_pct": server_wait,
        f"{name}.client_wait_pct": client_wait,
        f"{name}.generated_tok_s": generated,
        f"{name}.failed_requests": run.failures(),
    }


# --------------------------------------------------------------------------- 3. scheduling


POLICIES = ("continuous", "static")


async def scenario_scheduling(ctx: Context) -> Section:
    plan = ctx.plan
    models = [plan.s3_mock] + ([plan.s3_smollm2] if plan.smollm2 else [])
    section = Section(
        3,
        "Continuous vs static batching",
        "The same requests (same seed: same prompts and output lengths) against two servers "
        "that differ only in `--scheduling continuous|static`. Output lengths are drawn from an "
        "exponential distribution and sent as max_tokens with ignore_eos, so every request "
        "generates exactly its drawn length. A closed loop of 2 x slots clients keeps a queue. "
        "Model calls are the `slotserve_batch_size` histogram's count (one sample per model "
        "step); 'predicted' is a FIFO simulation of each policy over the same lengths, in the "
        "order they were sent (a request of L tokens holds its slot for L steps; static admits "
        "only into an empty batch); 'first batch' counts the requests whose first token came "
        "from the run's first model step (told apart by their arrival times at the client). "
        "Ratios are continuous / static within each repeat; the two servers run back "
        "to back in alternating order.",
        ctx.command(3),
        config={m.model: asdict(m) for m in models},
    )
    ttfts: dict[str, dict[str, list[float]]] = {}
    for sizes in models:
        ttfts[sizes.model] = await scheduling_model(ctx, section, sizes)
    if not plan.smollm2:
        section.notes.append("SmolLM2 part skipped (--quick; add --smollm2 to run it).")
    for sizes in models:
        section.tables.append(scheduling_table(section, sizes))
    image = "bench_s3_ttft_cdf.png"
    bench_plots.ttft_cdfs(
        plan.out_dir / image,
        {scheduling_title(sizes): ttfts[sizes.model] for sizes in models},
        f"TTFT, continuous vs static batching ({len(section.repeats)} repeat(s) pooled)",
    )
    section.images.append(image)
    med = section.medians
    parts = []
    for sizes in models:
        m = sizes.model
        parts.append(
            f"{'SmolLM2' if m == 'smollm2' else 'mock'}: continuous needs "
            f"{fmt(med[f'{m}.ratio.model_calls'], '.2f')}x the model calls of static, gives "
            f"{fmt(med[f'{m}.ratio.tok_s'], '.2f')}x its tokens/s and "
            f"{fmt(med[f'{m}.ratio.ttft_p99_ms'], '.2f')}x its p99 TTFT"
        )
    section.reading = "; ".join(parts) + "."
    for sizes in models:
        check_predictions(section, sizes)
    return section


def scheduling_title(sizes: SchedulingSizes) -> str:
    if sizes.model == "mock":
        return f"mock, {sizes.step_ms:g} ms step, {sizes.slots} slots"
    return f"SmolLM2-135M (CPU), {sizes.slots} slots"


async def scheduling_model(
    ctx: Context, section: Section, sizes: SchedulingSizes
) -> dict[str, list[float]]:
    """Both policies of one model over every repeat; adds to ``section.repeats`` (merging with
    the other model's numbers of the same repeat) and returns the TTFTs (ms) per policy."""
    specs = [scheduling_spec(sizes, policy) for policy in POLICIES]
    ttfts: dict[str, list[float]] = {policy: [] for policy in POLICIES}
    m = sizes.model
    async with launched(specs, ctx.log_dir) as servers:
        for server in servers:
            await warm_up(server)
        by_policy = dict(zip(POLICIES, servers, strict=True))
        for repeat in range(ctx.plan.repeats):
            order = POLICIES if repeat % 2 == 0 else POLICIES[::-1]
            numbers: Numbers = {}
            for policy in order:
                server = by_policy[policy]
                config = LoadConfig(
                    url=server.url,
                    concurrency=2 * sizes.slots,
                    num_requests=sizes.num_requests,
                    timeout_s=REQUEST_TIMEOUT_S,
                    workload=WorkloadConfig(
                        prompt_len=sizes.prompt_len,
                        output_len=sizes.mean_output_len,
                        output_len_dist=LengthDist.EXPONENTIAL,
                        ignore_eos=True,
                        temperature=0.0,
                        seed=0,
                    ),
                )
                run = await measure(server, config)
                numbers |= scheduling_numbers(f"{m}.{policy}", run, sizes.slots, policy)
                ttfts[policy] += [
                    r.ttft_s * 1000 for r in run.records(Outcome.OK) if r.ttft_s is not None
                ]
            for key in ("model_calls", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "makespan_s"):
                numbers[f"{m}.ratio.{key}"] = ratio(
                    numbers[f"{m}.continuous.{key}"], numbers[f"{m}.static.{key}"]
                )
            if len(section.repeats) <= repeat:
                section.repeats.append({})
            section.repeats[repeat] |= numbers
            ctx.say(
                f"  3 ({m}): repeat {repeat + 1}: calls "
                f"{numbers[f'{m}.continuous.model_calls']:.0f} vs "
                f"{numbers[f'{m}.static.model_calls']:.0f}, tok/s x"
                f"{numbers[f'{m}.ratio.tok_s']:.2f}"
            )
    return ttfts


def scheduling_spec(sizes: SchedulingSizes, policy: str) -> ServerSpec:
    name = f"s3-{sizes.model}-{policy}"
    if sizes.model == "mock":
        return ServerSpec.app(name, *mock_flags(sizes.slots, sizes.step_ms, "--scheduling", policy))
    return smollm2_spec(name, sizes.slots, "--scheduling", policy)


def scheduling_numbers(prefix: str, run: Run, slots: int, policy: str) -> Numbers:
    whole = run.whole()
    batches = whole.histogram("slotserve_batch_size")
    summary = run.result.summary
    lengths = [r.spec.max_tokens for r in run.result.records]
    ttft = summary.ttft_ms
    return {
        f"{prefix}.model_calls": batches.count,
        f"{prefix}.predicted_calls": predicted_model_calls(lengths, slots, policy),
        f"{prefix}.mean_batch": batches.mean,
        f"{prefix}.tok_s": summary.output_token_throughput,
        f"{prefix}.ttft_p50_ms": None if ttft is None else ttft.p50,
        f"{prefix}.ttft_p99_ms": None if ttft is None else ttft.p99,
        f"{prefix}.makespan_s": run.result.duration_s,
        f"{prefix}.first_batch": first_batch_size(run, batches.count),
        f"{prefix}.requested_tokens": sum(lengths),
        f"{prefix}.generated_tokens": whole.counter("slotserve_generated_tokens_total"),
        f"{prefix}.failed_requests": run.failures(),
    }


def first_batch_size(run: Run, model_calls: float) -> int:
    """How many requests got their first token in the run's first model step, estimated on the
    client: first tokens that arrived within 3/4 of a loop iteration of the earliest one."""
    firsts = [record.chunks[0].at for record in run.result.records if record.chunks]
    if not firsts or not model_calls:
        return 0
    tolerance = 0.75 * run.result.duration_s / model_calls
    earliest = min(firsts)
    return sum(at - earliest <= tolerance for at in firsts)


def predicted_model_calls(lengths: Sequence[int], slots: int, policy: str) -> int:
    """Model steps to serve ``lengths`` (FIFO in this order, all queued) under ``policy``: a
    request of L tokens holds a slot for L steps (its prefill step samples the first token);
    continuous refills free slots before every step, static only when the batch is empty."""
    queue = list(reversed(lengths))
    running: list[int] = []
    calls = 0
    while queue or running:
        if policy == "continuous" or not running:
            while queue and len(running) < slots:
                running.append(queue.pop())
        calls += 1
        running = [left - 1 for left in running if left > 1]
    return calls


def scheduling_table(section: Section, sizes: SchedulingSizes) -> str:
    med = section.medians
    m = sizes.model
    rows = [
        ("model calls (batch_size _count)", "model_calls", ".0f"),
        ("model calls predicted (FIFO simulation)", "predicted_calls", ".0f"),
        ("mean batch size", "mean_batch", ".1f"),
        ("first batch (requests in the first step, client-side estimate)", "first_batch", ".0f"),
        ("output tok/s (whole run)", "tok_s", ".1f"),
        ("TTFT p50 (ms)", "ttft_p50_ms", ".0f"),
        ("TTFT p99 (ms)", "ttft_p99_ms", ".0f"),
        ("makespan (s)", "makespan_s", ".2f"),
        ("tokens requested / generated", None, ""),
    ]
    body = []
    for label, key, spec in rows:
        if key is None:
            cells = [
                f"{fmt(med[f'{m}.{p}.requested_tokens'], '.0f')} / "
                f"{fmt(med[f'{m}.{p}.generated_tokens'], '.0f')}"
                for p in POLICIES
            ]
            body.append([label, *cells, ""])
            continue
        ratio_key = f"{m}.ratio.{key}"
        body.append(
            [
                label,
                *(fmt(med[f"{m}.{p}.{key}"], spec) for p in POLICIES),
                f"**{fmt(med[ratio_key], '.3f')}**" if ratio_key in med else "",
            ]
        )
    title = (
        f"**{scheduling_title(sizes)}**: {sizes.num_requests} requests, exponential "
        f"output lengths (mean {sizes.mean_output_len}), {2 * sizes.slots} clients "
        "(medians)\n\n"
    )
    return title + table(["metric", "continuous", "static", "continuous / static"], body)


def check_predictions(section: Section, sizes: SchedulingSizes) -> None:
    """Notes model-call counts that stray from the FIFO simulation by more than 5%, and static
    runs whose first batch did not fill the slots."""
    med = section.medians
    for policy in POLICIES:
        key = f"{sizes.model}.{policy}"
        measured, predicted = med[f"{key}.model_calls"], med[f"{key}.predicted_calls"]
        strays = bool(measured and predicted and abs(measured / predicted - 1) > 0.05)
        short_start = policy == "static" and (med[f"{key}.first_batch"] or 0) < sizes.slots
        if measured and predicted and (strays or short_start):
            per_repeat = ", ".join(f"{row[f'{key}.model_calls']:.0f}" for row in section.repeats)
            firsts = ", ".join(f"{row[f'{key}.first_batch']:.0f}" for row in section.repeats)
            section.notes.append(
                f"{scheduling_title(sizes)}, {policy}: {measured:.0f} model calls (median; per "
                f"repeat {per_repeat}) against {predicted:.0f} predicted "
                f"({measured / predicted - 1:+.0%}); first batch per repeat: {firsts} of "
                f"{sizes.slots} slots. The {2 * sizes.slots} first requests leave the client at "
                "once but reach the server over a few milliseconds, in any order; the loop "
                "starts a step as soon as the first one is there"
                + (
                    ", and a static batch then runs to its longest member before anyone else "
                    "is admitted: a short first batch costs a whole batch's worth of steps."
                    if short_start
                    else "."
                )
            )
        requested, generated = med[f"{key}.requested_tokens"], med[f"{key}.generated_tokens"]
        if requested is not None and generated is not None and requested != generated:
            section.notes.append(
                f"{scheduling_title(sizes)}, {policy}: {generated:.0f} tokens "
                f"generated for {requested:.0f} requested."
            )
        failures_note(
            section, f"{scheduling_title(sizes)}, {policy}", med[f"{key}.failed_requests"]
        )


# --------------------------------------------------------------------------- 4. concurrency


async def scenario_concurrency(ctx: Context) -> Section:
    s = ctx.plan.s4
    section = Section(
        4,
        "SmolLM2 under concurrency",
        f"SmolLM2-135M-Instruct on this CPU ({s.slots} slots, float32), closed loop at "
        f"concurrency {', '.join(map(str, s.levels))} with "
        f"{', '.join(map(str, s.requests))} requests respectively, {s.output_len} output "
        f"tokens each (ignore_eos, temperature 0), {s.prompt_len}-word prompts. Tokens/s is "
        "output tokens over the run (first send to last end); TTFT and TPOT are the client's "
        "(TPOT = (E2E - TTFT) / (tokens - 1) per request).",
        ctx.command(4),
        config=asdict(s),
    )
    if not ctx.plan.smollm2:
        section.skipped = "SmolLM2 scenarios are skipped under --quick (add --smollm2)."
        return section
    async with launched([smollm2_spec("s4-smollm2", s.slots)], ctx.log_dir) as (server,):
        await warm_up(server)
        for repeat in range(ctx.plan.repeats):
            numbers: Numbers = {}
            for level, count in zip(s.levels, s.requests, strict=True):
                config = LoadConfig(
                    url=server.url,
                    concurrency=level,
                    num_requests=count,
                    timeout_s=REQUEST_TIMEOUT_S,
                    workload=WorkloadConfig(
                        prompt_len=s.prompt_len,
                        output_len=s.output_len,
                        ignore_eos=True,
                        temperature=0.0,
                        seed=repeat,
                    ),
                )
                run = await measure(server, config)
                numbers |= concurrency_numbers(f"c{level}", run)
                ctx.say(
                    f"  4: repeat {repeat + 1}, concurrency {level}: "
                    f"{numbers[f'c{level}.tok_s']:.1f} tok/s"
                )
            section.repeats.append(numbers)
    med = section.medians
    columns = [
        ("output tok/s", "tok_s", ".1f"),
        ("TTFT p50", "ttft_p50_ms", ".0f"),
        ("TTFT p99", "ttft_p99_ms", ".0f"),
        ("TPOT p50", "tpot_p50_ms", ".1f"),
        ("TPOT p99", "tpot_p99_ms", ".1f"),
        ("mean batch", "mean_batch", ".1f"),
        ("model step (ms)", "model_step_ms", ".1f"),
        ("server CPU %", "server_cpu_pct", ".0f"),
    ]
    section.tables.append(
        table(
            [
                "concurrency",
                *(
                    label + (" (ms)" if "TT" in label or "TP" in label else "")
                    for label, _, _ in columns
                ),
            ],
            [
                [str(level), *(fmt(med[f"c{level}.{key}"], spec) for _, key, spec in columns)]
                for level in s.levels
            ],
        )
    )
    image = "bench_s4_concurrency.png"
    bench_plots.concurrency_sweep(
        ctx.plan.out_dir / image,
        list(s.levels),
        [med[f"c{c}.tok_s"] or 0 for c in s.levels],
        {
            f"{name} {q}": [med[f"c{c}.{name.lower()}_{q}_ms"] for c in s.levels]
            for name in ("TTFT", "TPOT")
            for q in ("p50", "p99")
        },
        f"SmolLM2-135M on CPU, {s.output_len} output tokens (medians of "
        f"{len(section.repeats)} repeat(s))",
    )
    section.images.append(image)
    lo_c, hi_c = s.levels[0], s.levels[-1]
    section.reading = (
        f"From concurrency {lo_c} to {hi_c} throughput grows "
        f"{fmt(ratio(med[f'c{hi_c}.tok_s'], med[f'c{lo_c}.tok_s']), '.1f')}x "
        f"({fmt(med[f'c{lo_c}.tok_s'], '.0f')} -> {fmt(med[f'c{hi_c}.tok_s'], '.0f')} tok/s) "
        f"while TPOT p50 goes from {fmt(med[f'c{lo_c}.tpot_p50_ms'], '.0f')} to "
        f"{fmt(med[f'c{hi_c}.tpot_p50_ms'], '.0f')} ms: batching amortises the weights' "
        "memory traffic until the cores are the limit."
    )
    if min(s.requests) < 10:
        section.notes.append("p99 over so few requests per run is close to the maximum.")
    failures_note(section, "the runs", sum(med[f"c{c}.failed_requests"] or 0 for c in s.levels))
    return section


def concurrency_numbers(prefix: str, run: Run) -> Numbers:
    whole = run.whole()
    summary = run.result.summary
    batches = whole.histogram("slotserve_batch_size")
    steps = whole.histogram("slotserve_model_step_seconds")
    server_cpu, _ = whole.cpu_percent()
    ttft, tpot = summary.ttft_ms, summary.tpot_ms
    return {
        f"{prefix}.tok_s": summary.output_token_throughput,
        f"{prefix}.ttft_p50_ms": None if ttft is None else ttft.p50,
        f"{prefix}.ttft_p99_ms": None if ttft is None else ttft.p99,
        f"{prefix}.tpot_p50_ms": None if tpot is None else tpot.p50,
        f"{prefix}.tpot_p99_ms": None if tpot is None else tpot.p99,
        f"{prefix}.mean_batch": batches.mean,
        f"{prefix}.model_step_ms": None if steps.mean is None else steps.mean * 1000,
        f"{prefix}.server_cpu_pct": server_cpu,
        f"{prefix}.failed_requests": run.failures(),
    }


# --------------------------------------------------------------------------- 5. cancel storm


async def scenario_cancel_storm(ctx: Context) -> Section:
    s = ctx.plan.s5
    section = Section(
        5,
        "Cancellation storm",
        f"Mock, {s.step_ms:g} ms step, {s.slots} slots, closed loop of {s.concurrency} "
        f"streaming clients, {s.output_len} output tokens (ignore_eos). In the storm run "
        f"{s.cancel_fraction:.0%} of the requests (seeded) are cancelled with "
        f"`DELETE /generate/{{id}}` once the client has received {s.cancel_after_tokens} tokens; "
        "the baseline run sends the same requests without cancelling. Cancel -> slot free comes "
        "from the server's `slotserve_cancel_to_slot_free_seconds` histogram (mean from its sum, "
        "p50/p99 interpolated inside its buckets); throughputs over the steady window "
        f"{s.warmup_s:g} s to {s.duration_s:g} s. 'Expected' is the baseline rate times the share "
        "of the storm's tokens that went to non-cancelled requests: what the non-cancelled "
        "requests would get if every freed slot were refilled at once.",
        ctx.command(5),
        config=asdict(s),
    )
    spec = ServerSpec.app("s5-mock", *mock_flags(s.slots, s.step_ms))
    rates: dict[str, list[float]] = {}
    buckets: dict[float, float] = {}
    async with launched([spec], ctx.log_dir) as (server,):
        await warm_up(server)
        for repeat in range(ctx.plan.repeats):
            order = ("baseline", "storm") if repeat % 2 == 0 else ("storm", "baseline")
            runs: dict[str, Run] = {}
            for name in order:
                fraction = s.cancel_fraction if name == "storm" else 0.0
                config = LoadConfig(
                    url=server.url,
                    concurrency=s.concurrency,
                    duration_s=s.duration_s,
                    timeout_s=REQUEST_TIMEOUT_S,
                    workload=WorkloadConfig(
                        prompt_len=s.prompt_len,
                        output_len=s.output_len,
                        ignore_eos=True,
                        temperature=0.0,
                        seed=repeat,
                        cancel=CancelPolicy(fraction, s.cancel_after_tokens, CancelMode.DELETE),
                    ),
                )
                runs[name] = await measure(server, config, (s.warmup_s, s.duration_s))
            numbers = cancel_numbers(runs["baseline"], runs["storm"], s)
            section.repeats.append(numbers)
            for bound, count in (
                runs["storm"]
                .whole()
                .histogram("slotserve_cancel_to_slot_free_seconds")
                .bucket_counts()
            ):
                buckets[bound] = buckets.get(bound, 0.0) + count
            if not rates:
                storm = runs["storm"]
                rates = {
                    "baseline: all tokens": tokens_per_second(runs["baseline"].records(), s.bin_s),
                    "storm: all tokens": tokens_per_second(storm.records(), s.bin_s),
                    "storm: non-cancelled requests' tokens": tokens_per_second(
                        storm.records(Outcome.OK), s.bin_s
                    ),
                }
            ctx.say(
                f"  5: repeat {repeat + 1}: cancel->free mean "
                f"{fmt(numbers['cancel_to_free_mean_ms'], '.1f')} ms, recovery "
                f"{fmt(numbers['recovery'], '.0%')}"
            )
    section.tables.append(
        table(
            median_header(section),
            metric_rows(
                section,
                [
                    ("requests chosen for cancelling / sent", "chosen_share", ".3f"),
                    ("requests that ended cancelled / sent", "cancelled_share", ".3f"),
                    (
                        "chosen, but finished before the DELETE landed (404)",
                        "late_cancel_share",
                        ".3f",
                    ),
                    (
                        "cancels seen by the server (finished_total{cancelled})",
                        "server_cancels",
                        ".0f",
                    ),
                    (
                        f"tokens a cancelled request got (mean; k = {s.cancel_after_tokens})",
                        "cancelled_mean_tokens",
                        ".1f",
                    ),
                    ("**cancel -> slot free, mean (ms)**", "cancel_to_free_mean_ms", ".2f"),
                    ("cancel -> slot free, p50 (ms, from buckets)", "cancel_to_free_p50_ms", ".2f"),
                    ("cancel -> slot free, p99 (ms, from buckets)", "cancel_to_free_p99_ms", ".2f"),
                    ("storm: model step (ms, mean)", "storm_model_step_ms", ".1f"),
                    ("baseline: generated tok/s (server)", "baseline_generated_tok_s", ".0f"),
                    ("storm: generated tok/s (server)", "storm_generated_tok_s", ".0f"),
                    ("**recovery: storm / baseline generated tok/s**", "recovery", ".3f"),
                    ("baseline: mean batch size", "baseline_mean_batch", ".1f"),
                    ("storm: mean batch size", "storm_mean_batch", ".1f"),
                    ("baseline: loop iteration (ms per model call)", "baseline_loop_ms", ".1f"),
                    ("storm: loop iteration (ms per model call)", "storm_loop_ms", ".1f"),
                    ("baseline: tok/s received", "baseline_ok_tok_s", ".0f"),
                    ("storm: tok/s received by non-cancelled requests", "storm_ok_tok_s", ".0f"),
                    ("**non-cancelled: storm / baseline tok/s**", "ok_ratio", ".3f"),
                    ("expected if freed slots are refilled at once", "expected_ok_ratio", ".3f"),
                    (
                        "storm: server threads waiting for a CPU (% of the window)",
                        "storm_server_wait_pct",
                        ".0f",
                    ),
                    (
                        "storm: client waiting for a CPU (% of the window)",
                        "storm_client_wait_pct",
                        ".0f",
                    ),
                ],
            ),
        )
    )
    image = "bench_s5_cancel_storm.png"
    bench_plots.cancel_storm(
        ctx.plan.out_dir / image,
        s.bin_s,
        rates,
        [(bound * 1000, count) for bound, count in sorted(buckets.items()) if bound <= 0.1 or count]
        or [(0.0, 0.0)],
        f"Cancellation storm: mock {s.step_ms:g} ms, {s.slots} slots, {s.cancel_fraction:.0%} "
        f"cancelled after {s.cancel_after_tokens} tokens (rates: first repeat; "
        "histogram: all repeats)",
    )
    section.images.append(image)
    med = section.medians
    section.reading = (
        f"Once the server had the DELETE, the slot was free "
        f"{fmt(med['cancel_to_free_mean_ms'], '.1f')} ms later (mean; p50 "
        f"{fmt(med['cancel_to_free_p50_ms'], '.1f')}, p99 "
        f"{fmt(med['cancel_to_free_p99_ms'], '.1f')} ms from the buckets), against a model "
        f"step of {fmt(med['storm_model_step_ms'], '.1f')} ms that a cancel may have to wait "
        f"out; during the storm the server generated {fmt(med['recovery'], '.0%')} of the "
        f"baseline's tokens/s (mean batch {fmt(med['storm_mean_batch'], '.1f')} vs "
        f"{fmt(med['baseline_mean_batch'], '.1f')}, loop iteration "
        f"{fmt(med['storm_loop_ms'], '.1f')} vs {fmt(med['baseline_loop_ms'], '.1f')} ms), "
        "and the non-cancelled requests received "
        f"{fmt(med['ok_ratio'], '.0%')} of the baseline rate, against "
        f"{fmt(med['expected_ok_ratio'], '.0%')} expected from the share of tokens the "
        "cancelled requests took before their cancel."
    )
    late, got = med["late_cancel_share"], med["cancelled_mean_tokens"]
    if (late or 0) > 0.02 or (got or 0) > 2 * s.cancel_after_tokens:
        section.notes.append(
            f"The client cancels late: {fmt(late, '.0%')} of the requests chosen for "
            f"cancelling had finished before their DELETE reached the server, and a cancelled "
            f"request received {fmt(got, '.1f')} tokens on average for k = "
            f"{s.cancel_after_tokens}. The server answers a DELETE in milliseconds; the lag is "
            "the client's, whose event loop, on the same starved cores, reads its streams "
            "behind the server (see its CPU wait above)."
        )
    failures_note(section, "the runs", med.get("failed_requests"))
    return section


def loop_iteration_ms(window: Window) -> float | None:
    """Wall time per model call over the window: the model step plus the loop's own work."""
    calls = window.histogram("slotserve_batch_size").count
    return 1000.0 * window.seconds / calls if calls else None


def cancel_numbers(baseline: Run, storm: Run, s: CancelSizes) -> Numbers:
    base_w, storm_w = baseline.window(), storm.window()
    ok_tokens = storm_w.tokens_received(storm.records(Outcome.OK))
    cancelled_tokens = storm_w.tokens_received(storm.records(Outcome.CANCELLED))
    base_rate = base_w.tokens_received(baseline.records(Outcome.OK)) / base_w.seconds
    storm_ok_rate = ok_tokens / storm_w.seconds
    useful_share = ratio(ok_tokens, ok_tokens + cancelled_tokens)
    cancelled = storm.records(Outcome.CANCELLED)
    to_free = storm.whole().histogram("slotserve_cancel_to_slot_free_seconds")
    base_gen = base_w.counter("slotserve_generated_tokens_total") / base_w.seconds
    storm_gen = storm_w.counter("slotserve_generated_tokens_total") / storm_w.seconds

    def ms(value: float | None) -> float | None:
        return None if value is None else value * 1000.0

    chosen = [r for r in storm.result.records if r.spec.cancel_after_tokens is not None]
    late = [r for r in chosen if r.outcome is Outcome.OK]
    return {
        "chosen_share": len(chosen) / max(1, len(storm.result.records)),
        "cancelled_share": len(cancelled) / max(1, len(storm.result.records)),
        "late_cancel_share": len(late) / max(1, len(chosen)),
        "server_cancels": storm.whole().counter(
            "slotserve_requests_finished_total", finish_reason="cancelled"
        ),
        "cancelled_mean_tokens": (
            statistics.mean(r.output_tokens for r in cancelled) if cancelled else None
        ),
        "cancel_to_free_count": to_free.count,
        "cancel_to_free_mean_ms": ms(to_free.mean),
        "cancel_to_free_p50_ms": ms(to_free.quantile(0.50)),
        "cancel_to_free_p99_ms": ms(to_free.quantile(0.99)),
        "baseline_generated_tok_s": base_gen,
        "storm_generated_tok_s": storm_gen,
        "recovery": ratio(storm_gen, base_gen),
        "baseline_mean_batch": base_w.histogram("slotserve_batch_size").mean,
        "storm_mean_batch": storm_w.histogram("slotserve_batch_size").mean,
        "storm_model_step_ms": ms(storm_w.histogram("slotserve_model_step_seconds").mean),
        "baseline_loop_ms": loop_iteration_ms(base_w),
        "storm_loop_ms": loop_iteration_ms(storm_w),
        "storm_server_wait_pct": storm_w.wait_percent()[0],
        "storm_client_wait_pct": storm_w.wait_percent()[1],
        "baseline_ok_tok_s": base_rate,
        "storm_ok_tok_s": storm_ok_rate,
        "ok_ratio": ratio(storm_ok_rate, base_rate),
        "expected_ok_ratio": useful_share,
        "failed_requests": baseline.failures() + storm.failures(),
    }


# --------------------------------------------------------------------------- report

SCENARIOS: dict[int, Callable[[Context], Awaitable[Section]]] = {
    1: scenario_saturation,
    2: scenario_sse_ceiling,
    3: scenario_scheduling,
    4: scenario_concurrency,
    5: scenario_cancel_storm,
}


def machine() -> dict[str, object]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
    }


def render_markdown(plan: Plan, sections: Sequence[Section], info: dict[str, object]) -> str:
    start, end = info["machine_before"], info["machine_after"]
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `{' '.join(('python scripts/bench.py', *plan.argv))}` on "
        f"{info['finished_at']} in {info['runtime_s'] / 60:.1f} min "
        "(this file, the PNGs beside it and `bench_results.json`, which holds every number of "
        "every repeat).",
        "",
        f"**Machine:** {start['cpus']} CPU cores ({start['cpu_model'] or 'unknown model'}), "
        f"Python {start['python']}, **shared with other engineers' benchmarks while these "
        f"ran** (load average {start['load_average'][0]:.1f} before, "
        f"{end['load_average'][0]:.1f} after). Absolute numbers are noisy: every number is "
        f"the **median of {plan.repeats} repeat(s)** (min and max shown where it helps), and "
        "every ratio is computed inside one repeat, from two runs back to back in alternating "
        "order, before its median is taken. The servers are subprocesses on 127.0.0.1 with "
        "`--log-level warning` (no access log); the load generator (`scripts/loadgen`, httpx) "
        "runs in the benchmark's own process on the same cores, so the client competes with "
        "the server for CPU: the tables give both CPU shares.",
        "",
        "The real model's speed against transformers and llama.cpp (1 / 16 / 64 streams, "
        "dtypes, int4, memory, batch invariance) is in [`MODEL_PERF.md`](MODEL_PERF.md) "
        "(`scripts/bench_model.py`, `scripts/bench_model_step.py`).",
        "",
    ]
    for section in sections:
        lines += render_section(section)
    return "\n".join(lines) + "\n"


def render_section(section: Section) -> list[str]:
    lines = [
        f"## {section.number}. {section.title}",
        "",
        f"**Measures.** {section.measures}",
        "",
        f"**Reproduce:** `{section.command}`",
        "",
    ]
    if section.skipped:
        return lines + [f"*Skipped: {section.skipped}*", ""]
    for block in section.tables:
        lines += [block, ""]
    for image in section.images:
        lines += [f"![{section.title}]({image})", ""]
    lines += [f"**Reading.** {section.reading}", ""]
    if section.notes:
        lines += ["**Notes.**", ""] + [f"- {note}" for note in section.notes] + [""]
    lines += [f"*({len(section.repeats)} repeat(s), {section.seconds:.0f} s.)*", ""]
    return lines


def results_json(plan: Plan, sections: Sequence[Section], info: dict[str, object]) -> str:
    document = {
        "schema": "slotserve-bench/1",
        "argv": list(plan.argv),
        "repeats": plan.repeats,
        "quick": plan.quick,
        "smollm2": plan.smollm2,
        **info,
        "scenarios": {
            str(section.number): {
                "title": section.title,
                "command": section.command,
                "skipped": section.skipped,
                "config": section.config,
                "seconds": section.seconds,
                "medians": section.medians,
                "min": section.lows,
                "max": section.highs,
                "repeats": section.repeats,
                "reading": section.reading,
                "notes": section.notes,
                "images": section.images,
            }
            for section in sections
        },
    }
    return json.dumps(document, indent=1, default=str) + "\n"


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
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    plan = build_plan(parse_args(argv), argv)
    return asyncio.run(run_all(plan, Console()))


if __name__ == "__main__":
    sys.exit(main())
