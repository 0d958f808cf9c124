"""What a run shows and writes: the live progress bar, the summary tables, the JSON file.

JSON layout (`--out`), times in seconds on the run clock unless the key says ms:

    {"schema": "slotserve-load/1",
     "started_at_unix": <wall clock at the run's start>,
     "config":   <every LoadConfig field ("api_key" redacted); "workload" nested, with
                  "cancel" nested>,
     "summary":  {"duration_s", "requests", "outcomes": {ok, cancelled, rejected, error,
                  transport_error}, "errors": {"<status> <type>": n, ...}, "prompt_tokens",
                  "output_tokens", "request_throughput", "output_token_throughput",
                  "total_token_throughput", "goodput", and "ttft_ms", "tpot_ms", "itl_ms",
                  "e2e_ms" each {count, mean, p50, p90, p99, max} or null},
     "requests": [{"index", "request_id", "max_tokens", "cancel_after_tokens", "streamed",
                   "outcome", "error", "status", "finish_reason", "prompt_tokens",
                   "output_tokens", "started_at", "finished_at", "ttft_ms", "tpot_ms", "e2e_ms",
                   "chunks": [[arrival time, tokens], ...]}, ...]}
"""

from __future__ import annotations

import json
from dataclasses import asdict
from enum import Enum
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from loadgen.config import LoadConfig
from loadgen.record import Outcome, RequestRecord
from loadgen.runner import LoadResult
from loadgen.stats import Distribution, Summary

SCHEMA = "slotserve-load/1"


class ProgressDisplay:
    """A rich progress bar over the requests that ended, with a running count by outcome.

    Its total is --num-requests; a run bounded only by --duration shows an open-ended bar.
    Use as a context manager and pass `on_record` to `run_load`.
    """

    def __init__(self, config: LoadConfig, console: Console) -> None:
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        )
        self._task = self._progress.add_task("starting", total=config.num_requests)
        self._outcomes = dict.fromkeys(Outcome, 0)

    def __enter__(self) -> ProgressDisplay:
        self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._progress.stop()

    def on_record(self, record: RequestRecord) -> None:
        self._outcomes[record.outcome] += 1
        counts = " ".join(f"{o.value} {n}" for o, n in self._outcomes.items() if n)
        self._progress.update(self._task, advance=1, description=counts)


def print_summary(result: LoadResult, console: Console) -> None:
    """The three summary tables: outcomes, latencies, throughput."""
    summary = result.summary
    console.print(outcome_table(summary))
    console.print(latency_table(summary))
    console.print(throughput_table(summary))


def outcome_table(summary: Summary) -> Table:
    table = Table(title=f"Requests ({summary.requests})", title_justify="left")
    table.add_column("outcome")
    table.add_column("count", justify="right")
    for outcome, count in summary.outcomes.items():
        table.add_row(outcome, str(count))
    for error, count in summary.errors.items():
        table.add_row(f"  {error}", str(count), style="dim")
    return table


def latency_table(summary: Summary) -> Table:
    table = Table(title="Latency of ok requests (ms)", title_justify="left")
    table.add_column("metric")
    for name in ("mean", "p50", "p90", "p99", "max", "n"):
        table.add_column(name, justify="right")
    rows = {
        "TTFT": summary.ttft_ms,
        "TPOT": summary.tpot_ms,
        "ITL": summary.itl_ms,
        "E2E": summary.e2e_ms,
    }
    for metric, distribution in rows.items():
        table.add_row(metric, *distribution_cells(distribution))
    return table


def distribution_cells(distribution: Distribution | None) -> list[str]:
    if distribution is None:
        return ["-"] * 6
    d = distribution
    return [f"{value:.1f}" for value in (d.mean, d.p50, d.p90, d.p99, d.max)] + [str(d.count)]


def throughput_table(summary: Summary) -> Table:
    table = Table(title="Throughput", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("duration (s)", f"{summary.duration_s:.2f}")
    table.add_row("request throughput (req/s)", f"{summary.request_throughput:.2f}")
    table.add_row("output token throughput (tok/s)", f"{summary.output_token_throughput:.1f}")
    table.add_row("total token throughput (tok/s)", f"{summary.total_token_throughput:.1f}")
    table.add_row("prompt / output tokens", f"{summary.prompt_tokens} / {summary.output_tokens}")
    if summary.goodput is not None:
        table.add_row("goodput (req/s within SLOs)", f"{summary.goodput:.2f}")
    return table


def write_json(result: LoadResult, path: Path) -> None:
    config = asdict(result.config)
    if config["api_key"] is not None:
        config["api_key"] = "<redacted>"  # a results file gets shared; the key must not be
    document = {
        "schema": SCHEMA,
        "started_at_unix": result.started_at_unix,
        "config": config,
        "summary": asdict(result.summary),
        "requests": [request_json(record) for record in result.records],
    }
    path.write_text(json.dumps(document, indent=1, default=json_value) + "\n", encoding="utf-8")


def request_json(record: RequestRecord) -> dict[str, Any]:
    spec = record.spec
    return {
        "index": spec.index,
        "request_id": spec.request_id,
        "max_tokens": spec.max_tokens,
        "cancel_after_tokens": spec.cancel_after_tokens,
        "streamed": record.streamed,
        "outcome": record.outcome.value,
        "error": record.error,
        "status": record.status,
        "finish_reason": record.finish_reason,
        "prompt_tokens": record.prompt_tokens,
        "output_tokens": record.output_tokens,
        "started_at": record.started_at,
        "finished_at": record.finished_at,
        "ttft_ms": milliseconds(record.ttft_s),
        "tpot_ms": milliseconds(record.tpot_s),
        "e2e_ms": milliseconds(record.e2e_s),
        "chunks": [[chunk.at, chunk.tokens] for chunk in record.chunks],
    }


def milliseconds(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def json_value(value: object) -> object:
    """What json.dumps cannot write by itself: enums by value, paths as strings."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
