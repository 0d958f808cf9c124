"""Overload burst: offer N x the server's capacity and check that it only says 200 or 429, and
that it says 429 fast (the command line is ``scripts/overload_burst.py``).

The arrivals are loadgen's open loop (Poisson: gamma inter-arrival times of shape 1) of
non-stream requests without ``X-Request-Id`` (as a plain client sends them), over aiohttp:
httpx's client costs ~3x the CPU a request and, at hundreds of arrivals a second on two shared
cores, falls behind them and measures itself. Each request's status and its latency (send to
the whole answer) come from its loadgen record; percentiles are loadgen's (linear, as numpy's
default). The server's event-loop lag over the burst is ``slotserve_event_loop_lag_seconds``
between a scrape before and one after, its p99 the harness's one quantile (Prometheus').
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from harness.metrics import histogram_delta, scrape
from loadgen import LoadConfig, RequestRecord, Transport, WorkloadConfig, run_load
from loadgen.stats import percentile
from rich.console import Console
from rich.table import Table

LOOP_LAG = "slotserve_event_loop_lag_seconds"
REQUEST_TIMEOUT_S = 60.0
NO_ANSWER = "no answer"  # a transport error: no status came back


@dataclass(frozen=True, slots=True)
class BurstConfig:
    """One burst: ``rate`` arrivals a second for ``duration_s`` seconds at ``url``.

    Attributes:
        capacity_rps: the requests a second the server completes (for the report).
        max_429_p99_ms: the bound on the p99 latency of 429 answers.
    """

    url: str
    rate: float
    duration_s: float
    max_tokens: int
    seed: int
    capacity_rps: float
    max_429_p99_ms: float


async def burst(config: BurstConfig) -> tuple[tuple[RequestRecord, ...], float | None]:
    """The burst's records, and the server's event-loop lag p99 over it (seconds)."""
    load = LoadConfig(
        url=config.url,
        rate=config.rate,
        duration_s=config.duration_s,
        transport=Transport.AIOHTTP,
        send_request_ids=False,
        timeout_s=REQUEST_TIMEOUT_S,
        workload=WorkloadConfig(
            prompt_len=2,
            output_len=config.max_tokens,
            ignore_eos=True,
            stream=False,
            seed=config.seed,
        ),
    )
    # the client's own full collections (tens of ms) would count as server latency
    gc.collect()
    gc.freeze()
    async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
        before = await scrape(http, config.url)
        result = await run_load(load)
        after = await scrape(http, config.url)
    return result.records, histogram_delta(before, after, LOOP_LAG).quantile(0.99)


def status_name(record: RequestRecord) -> str:
    return NO_ANSWER if record.status is None else str(record.status)


def latency_summary(records: Sequence[RequestRecord]) -> dict[str, dict[str, float]]:
    """By status: count, p50/p90/p99 and max of the latency, ms."""
    by_status: dict[str, list[float]] = {}
    for record in records:
        by_status.setdefault(status_name(record), []).append(record.e2e_s * 1000.0)
    return {
        status: {
            "count": len(values),
            "p50_ms": percentile(values, 50),
            "p90_ms": percentile(values, 90),
            "p99_ms": percentile(values, 99),
            "max_ms": max(values),
        }
        for status, values in sorted(by_status.items())
    }


def problems_of(summary: dict[str, dict[str, float]], max_429_p99_ms: float) -> list[str]:
    problems = [f"unexpected status {status}" for status in summary if status not in ("200", "429")]
    p99_429 = summary.get("429", {}).get("p99_ms")
    if p99_429 is None:
        problems.append("no 429 at all: the burst did not overload the server")
    elif p99_429 > max_429_p99_ms:
        problems.append(f"429 p99 {p99_429:.2f} ms > {max_429_p99_ms} ms")
    return problems


def report(
    config: BurstConfig,
    records: Sequence[RequestRecord],
    loop_lag_p99_s: float | None,
    console: Console,
) -> dict[str, object]:
    """Prints the table and the checks; returns the JSON document (``problems`` empty: ok)."""
    summary = latency_summary(records)
    table = Table(
        title=f"overload: {len(records)} requests at {config.rate:.0f}/s = "
        f"{config.rate / config.capacity_rps:g} x capacity ({config.capacity_rps:.0f}/s)"
    )
    for column in ("status", "count", "p50 ms", "p90 ms", "p99 ms", "max ms"):
        table.add_column(column, justify="right")
    for status, row in summary.items():
        cells = (f"{row[key]:.2f}" for key in ("p50_ms", "p90_ms", "p99_ms", "max_ms"))
        table.add_row(status, str(row["count"]), *cells)
    console.print(table)
    lag_ms = None if loop_lag_p99_s is None else loop_lag_p99_s * 1000.0
    console.print(
        f"server event-loop lag during the burst: p99 {'-' if lag_ms is None else f'{lag_ms:.2f}'}"
        f" ms ({LOOP_LAG}; the rest of a 429's latency is the client and the OS)"
    )
    problems = problems_of(summary, config.max_429_p99_ms)
    for problem in problems:
        console.print(f"[red]{problem}[/red]")
    return {
        "count": len(records),
        "capacity_rps": config.capacity_rps,
        "rate_rps": config.rate,
        "by_status": summary,
        "server_event_loop_lag_p99_ms": lag_ms,
        "problems": problems,
    }
