"""Scenario 3, continuous against static batching: model calls, tokens/s and TTFT over the same
requests (mock, and SmolLM2 unless ``--quick``), with a FIFO simulation of each policy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from harness.measure import Run, measure
from harness.server import ServerSpec, launched
from loadgen import LengthDist, Outcome

from scenarios import plots
from scenarios.context import Context, greedy_load, mock_flags, smollm2_spec, warm_up
from scenarios.plan import SchedulingSizes
from scenarios.report import Numbers, Section, fmt, ratio, table

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
    plots.ttft_cdfs(
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
                config = greedy_load(
                    server.url,
                    concurrency=2 * sizes.slots,
                    num_requests=sizes.num_requests,
                    prompt_len=sizes.prompt_len,
                    output_len=sizes.mean_output_len,
                    seed=0,
                    output_len_dist=LengthDist.EXPONENTIAL,
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
        section.note_failures(f"{scheduling_title(sizes)}, {policy}", med[f"{key}.failed_requests"])
