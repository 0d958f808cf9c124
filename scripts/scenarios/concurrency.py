"""Scenario 4, SmolLM2 under concurrency: tokens/s, TTFT and TPOT at several closed-loop
concurrencies (skipped under ``--quick``)."""

from __future__ import annotations

from dataclasses import asdict

from harness.measure import Run, measure
from harness.server import launched

from scenarios import plots
from scenarios.context import Context, greedy_load, smollm2_spec, warm_up
from scenarios.report import Numbers, Section, fmt, ratio, table


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
                config = greedy_load(
                    server.url,
                    concurrency=level,
                    num_requests=count,
                    prompt_len=s.prompt_len,
                    output_len=s.output_len,
                    seed=repeat,
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
    plots.concurrency_sweep(
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
    section.note_failures("the runs", sum(med[f"c{c}.failed_requests"] or 0 for c in s.levels))
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
