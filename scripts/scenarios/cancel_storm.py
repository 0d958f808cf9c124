"""Scenario 5, a cancellation storm: cancel -> slot free from the server's histogram, and the
throughput of the requests left against a run without cancels."""

from __future__ import annotations

import statistics
from dataclasses import asdict

from harness.measure import Run, Window, measure
from harness.server import ServerSpec, launched
from loadgen import CancelMode, CancelPolicy, Outcome
from loadgen.stats import tokens_per_second

from scenarios import plots
from scenarios.context import Context, greedy_load, mock_flags, warm_up
from scenarios.plan import CancelSizes
from scenarios.report import Numbers, Section, fmt, ratio


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
                config = greedy_load(
                    server.url,
                    concurrency=s.concurrency,
                    duration_s=s.duration_s,
                    prompt_len=s.prompt_len,
                    output_len=s.output_len,
                    seed=repeat,
                    cancel=CancelPolicy(fraction, s.cancel_after_tokens, CancelMode.DELETE),
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
    section.add_metric_table(
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
        ]
    )
    image = "bench_s5_cancel_storm.png"
    plots.cancel_storm(
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
    section.note_failures("the runs", med.get("failed_requests"))
    return section


def loop_iteration_ms(window: Window) -> float | None:
    """Wall time per model call over the window: the model step plus the loop's own work."""
    calls = window.histogram("slotserve_batch_size").count
    return 1000.0 * window.seconds / calls if calls else None


def steady_windows(baseline: Run, storm: Run) -> tuple[Window, Window]:
    """Both runs' steady-state windows, or both whole runs where either window saw no token
    generated (a busy machine can stretch the mock's start past the window: the baseline's
    rate was then 0 and the recovery ratio undefined, a flake of tests/scripts/test_bench.py;
    the two are compared over the same kind of span, or the ratio is skewed)."""
    windows = baseline.window(), storm.window()
    if all(w.counter("slotserve_generated_tokens_total") > 0 for w in windows):
        return windows
    return baseline.whole(), storm.whole()


def cancel_numbers(baseline: Run, storm: Run, s: CancelSizes) -> Numbers:
    base_w, storm_w = steady_windows(baseline, storm)
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
