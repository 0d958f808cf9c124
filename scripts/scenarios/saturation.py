"""Scenario 1, saturation: the tokens/s a saturated mock server delivers against the ideal
(slots / step), from the clients and from the server's own metrics, over a steady window."""

from __future__ import annotations

from dataclasses import asdict

from harness.measure import Run, measure
from harness.server import ServerSpec, launched
from loadgen.stats import tokens_per_second

from scenarios import plots
from scenarios.context import Context, greedy_load, mock_flags, warm_up
from scenarios.report import Numbers, Section, fmt, ratio


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
            config = greedy_load(
                server.url,
                concurrency=2 * s.slots,
                duration_s=s.duration_s,
                prompt_len=s.prompt_len,
                output_len=s.output_len,
                seed=repeat,
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
    plots.saturation(
        ctx.plan.out_dir / image,
        s.bin_s,
        series,
        ideal,
        (s.warmup_s, s.duration_s),
        f"Mock, {s.step_ms:g} ms step, {s.slots} slots, {2 * s.slots} clients (first repeat)",
    )
    section.images.append(image)
    section.add_metric_table(
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
        ]
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
    section.note_failures("the runs", med.get("failed_requests"))
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
