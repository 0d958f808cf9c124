"""Scenario 2, the HTTP layer's ceiling: SSE tokens/s of the full stack (mock, 0 ms step)
against a bare Starlette app and sse-starlette streaming the same events
(``scenarios/sse_ceiling_app.py``), same client."""

from __future__ import annotations

from dataclasses import asdict

from harness.measure import Run, Window, measure
from harness.server import ServerSpec, launched

from scenarios import plots
from scenarios.context import Context, greedy_load, mock_flags, warm_up
from scenarios.report import Numbers, Section, fmt, ratio, table

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
            runs: dict[str, Run] = {}
            for name in order:
                target, url = targets[name]
                config = greedy_load(
                    url,
                    concurrency=s.concurrency,
                    duration_s=s.duration_s,
                    prompt_len=s.prompt_len,
                    output_len=s.output_len,
                    seed=repeat,
                )
                runs[name] = await measure(target, config, (s.warmup_s, s.duration_s))
            windows = steady_windows(runs)
            numbers: Numbers = {}
            for name in order:
                has_metrics = targets[name][0] is server
                numbers |= sse_numbers(name, runs[name], windows[name], has_metrics=has_metrics)
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
    section.add_metric_table(
        [
            ("**full stack / bare Starlette**", "full_over_bare", ".3f"),
            ("full stack / sse-starlette", "full_over_sse", ".3f"),
            ("sse-starlette / bare Starlette", "sse_over_bare", ".3f"),
            ("full stack / bare Starlette, in events/s", "full_over_bare_events", ".3f"),
        ],
        "ratio (per repeat, then median)",
    )
    image = "bench_s2_sse_ceiling.png"
    plots.grouped_bars(
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
    section.note_failures(
        "the runs", sum((med.get(f"{t}.failed_requests") or 0) for t in SSE_TARGETS)
    )
    return section


def steady_windows(runs: dict[str, Run]) -> dict[str, Window]:
    """Each target's steady-state window, or every target's whole run where any window
    received no token (a busy machine can hold a quick run's client back past its 0.6 s
    window: that target's rate was then 0, a flake of tests/scripts/test_bench.py, as scenario
    5's was; the targets are compared over the same kind of span, or the ratios are skewed)."""
    windows = {name: run.window() for name, run in runs.items()}
    if all(windows[name].tokens_received(run.records()) > 0 for name, run in runs.items()):
        return windows
    return {name: run.whole() for name, run in runs.items()}


def sse_numbers(name: str, run: Run, window: Window, *, has_metrics: bool) -> Numbers:
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
