"""Soak test: many requests, a share cancelled or abandoned, bad bodies mixed in; then check
that nothing leaked. The command line is ``scripts/soak.py``:

    python scripts/soak.py                       # starts its own mock server, 10k requests
    python scripts/soak.py --num-requests 2000 --concurrency 32 --out soak.json
    python scripts/soak.py --url http://127.0.0.1:8000 --server-pid 1234

Every request is one of: a plain stream read to its end, a stream cancelled by DELETE after k
tokens, a stream whose client disconnects after k tokens, a non-stream request, or a bad body
(expects 422): a mix of ``RequestSpec``s sent by loadgen's closed loop. At the end the script
checks, and exits 1 if any check fails:

* /metrics: ``slotserve_requests_running`` and ``..._waiting`` are back to 0, and so is
  ``slotserve_kv_cache_usage_ratio`` (no KV block is held: what stays is cached free blocks
  only, which the gauge counts as free);
* every accepted request ended exactly once on the server (``requests_finished_total`` grew by
  the number of accepted requests) and every stream that was read to its end saw exactly one
  final event (``done`` or ``error``), with ``cancelled`` for those it DELETEd;
* no 5xx answers and no transport errors;
* the server's RSS grew by less than ``--max-rss-growth`` between the end of a warm-up and the
  end of the run (when the server's pid is known).

Traffic goes only to the given URL (loopback by default).
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum

import httpx
from harness.metrics import Metrics, scrape
from harness.process_stats import ProcessStats
from harness.wait import ConditionTimeout, wait_for
from loadgen import CancelMode, LoadConfig, Outcome, RequestRecord, RequestSpec, run_load
from rich.console import Console
from rich.table import Table

FINISHED = "slotserve_requests_finished_total"
SETTLE_TIMEOUT_S = 5.0

BAD_BODIES = (
    b'{"prompt": ""}',
    b'{"prompt": "x", "temperature": -1}',
    b'{"prompt": "x", "stop": [""]}',
    b'{"prompt": "x", "bogus": 1}',
    b'{"prompt": "x", "temperature": NaN}',
    b"{not json",
    b'{"prompt": "x", "max_tokens": "ten"}',
)

KV_USAGE = "slotserve_kv_cache_usage_ratio"


@dataclass(frozen=True, slots=True)
class SoakConfig:
    url: str
    num_requests: int
    concurrency: int
    cancel_fraction: float
    disconnect_fraction: float
    bad_fraction: float
    non_stream_fraction: float
    max_tokens: int
    seed: int
    max_rss_growth: float
    server_pid: int | None


@dataclass(slots=True)
class SoakTally:
    """Counts by outcome; ``problems`` lists every check that failed."""

    outcomes: Counter[str] = field(default_factory=Counter)
    accepted: int = 0
    problems: list[str] = field(default_factory=list)


class Kind(StrEnum):
    """What one soak request does."""

    BAD_BODY = "bad_body"  # an invalid body: expects 422
    NON_STREAM = "non_stream"
    DELETE = "delete"  # a stream DELETEd after k tokens
    DISCONNECT = "disconnect"  # a stream whose client leaves after k tokens
    FULL = "full"  # a stream read to its end


def soak_specs(config: SoakConfig, count: int, offset: int) -> list[tuple[RequestSpec, Kind]]:
    """Requests ``offset`` .. ``offset + count - 1`` of the mix, drawn from the seed."""
    rng = random.Random(config.seed * 1_000_003 + offset)
    edges = [config.bad_fraction]
    edges.append(edges[-1] + config.non_stream_fraction)
    edges.append(edges[-1] + config.cancel_fraction)
    edges.append(edges[-1] + config.disconnect_fraction)
    specs = []
    for index in range(offset, offset + count):
        roll = rng.random()
        max_tokens = rng.randint(1, 2 * config.max_tokens)
        base = RequestSpec(
            index=index,
            request_id=f"soak-{config.seed}-{index}",
            prompt=f"soak {index} {rng.random():.6f}",
            max_tokens=max_tokens,
            cancel_after_tokens=None,
            stream=False,
            temperature=1.0,
        )
        if roll < edges[0]:
            specs.append((replace(base, raw_body=rng.choice(BAD_BODIES)), Kind.BAD_BODY))
        elif roll < edges[1]:
            specs.append((base, Kind.NON_STREAM))
        elif roll < edges[3]:
            kind = Kind.DELETE if roll < edges[2] else Kind.DISCONNECT
            mode = CancelMode.DELETE if kind is Kind.DELETE else CancelMode.DISCONNECT
            cancelled = replace(
                base,
                stream=True,
                ignore_eos=True,
                max_tokens=max(max_tokens, 200),  # long enough to still be running
                cancel_after_tokens=rng.randint(1, 5),
                cancel_mode=mode,
            )
            specs.append((cancelled, kind))
        else:
            specs.append((replace(base, stream=True), Kind.FULL))
    return specs


def tally_records(records: Sequence[RequestRecord], kinds: dict[int, Kind]) -> SoakTally:
    """Each record's outcome name, the accepted count, and the problems seen by the client."""
    tally = SoakTally()
    for record in records:
        kind = kinds[record.spec.index]
        name, problem = outcome_of(record, kind)
        tally.outcomes[name] += 1
        if record.status == 200:
            tally.accepted += 1
        if problem is not None:
            tally.problems.append(f"{record.spec.request_id}: {problem}")
    return tally


def outcome_of(record: RequestRecord, kind: Kind) -> tuple[str, str | None]:
    """(outcome name, problem or None) of one request."""
    status = record.status
    if record.outcome is Outcome.TRANSPORT_ERROR:
        if status is None:
            # No answer (e.g. a keep-alive connection the server closed as it was reused): not
            # a leak, and the server-side count still has to match.
            return "transport_error_before_answer", None
        return "transport_error", f"transport error mid-answer ({record.error})"
    if kind is Kind.BAD_BODY:
        return f"bad_body_{status}", None if status == 422 else f"bad body answered {status}"
    server_fault = f"{status} {record.error}" if status is not None and status >= 500 else None
    if kind is Kind.NON_STREAM:
        return f"non_stream_{status}", server_fault
    if status != 200:
        return f"stream_{status}", server_fault
    if kind is Kind.DISCONNECT and record.outcome is Outcome.CANCELLED:
        return "stream_disconnected", None  # the client left: no final event to see
    problem = None
    if record.final_events != 1:
        problem = f"{record.final_events} final events"
    elif record.cancel_confirmed and record.finish_reason != "cancelled":
        problem = f"DELETE answered 200 but ended {record.finish_reason}"
    if kind is Kind.DELETE:
        return ("stream_deleted" if record.cancel_confirmed else "stream_delete_too_late"), problem
    if kind is Kind.DISCONNECT:
        return "stream_ended_before_cut", problem
    return "stream_full", problem


async def run_phase(config: SoakConfig, count: int, offset: int) -> SoakTally:
    """``count`` requests of the mix through loadgen's closed loop of ``config.concurrency``."""
    specs = soak_specs(config, count, offset)
    load = LoadConfig(
        url=config.url, concurrency=config.concurrency, num_requests=count, timeout_s=60.0
    )
    result = await run_load(load, specs=[spec for spec, _ in specs])
    return tally_records(result.records, {spec.index: kind for spec, kind in specs})


def busy(metrics: Metrics) -> float:
    return metrics.value("slotserve_requests_running") + metrics.value("slotserve_requests_waiting")


async def settle(http: httpx.AsyncClient, finished_before: float, accepted: int) -> Metrics:
    """The server's metrics once nothing runs or waits and every accepted request finished (or
    after ``SETTLE_TIMEOUT_S``: the checks then say what is left). Disconnected requests end
    at the server's next step."""
    latest = await scrape(http)

    async def settled() -> bool:
        nonlocal latest
        latest = await scrape(http)
        finished = latest.value(FINISHED) - finished_before
        return busy(latest) == 0 and finished >= accepted

    with contextlib.suppress(ConditionTimeout):
        await wait_for(settled, SETTLE_TIMEOUT_S, poll_s=0.05)
    return latest


async def soak(config: SoakConfig, console: Console) -> dict[str, object]:
    server = ProcessStats(config.server_pid) if config.server_pid is not None else None
    async with httpx.AsyncClient(base_url=config.url, timeout=60, trust_env=False) as http:
        warmup = min(500, max(config.num_requests // 10, 1))
        await run_phase(config, warmup, 0)
        before = await settle(http, 0.0, 0)
        rss_before = server.rss_bytes() if server else None
        started = time.perf_counter()
        tally = await run_phase(config, config.num_requests, warmup)
        duration = time.perf_counter() - started
        after = await settle(http, before.value(FINISHED), tally.accepted)
        rss_after = server.rss_bytes() if server else None

    finished = after.value(FINISHED) - before.value(FINISHED)
    for gauge in ("slotserve_requests_running", "slotserve_requests_waiting"):
        if after.value(gauge) != 0:
            tally.problems.append(
                f"{gauge.removeprefix('slotserve_requests_')} gauge is {after.value(gauge)}, not 0"
            )
    if after.value(KV_USAGE) != 0:
        tally.problems.append(f"KV cache usage is {after.value(KV_USAGE)}, not 0: leaked blocks")
    if int(finished) != tally.accepted:
        tally.problems.append(
            f"server finished {int(finished)} requests, {tally.accepted} were accepted"
        )
    growth = None
    if rss_before and rss_after:
        growth = (rss_after - rss_before) / rss_before
        if growth > config.max_rss_growth:
            tally.problems.append(f"RSS grew {growth:.1%} (limit {config.max_rss_growth:.0%})")
    reasons_before = before.by_label(FINISHED, "finish_reason")
    by_reason = {
        reason: count - reasons_before.get(reason, 0.0)
        for reason, count in after.by_label(FINISHED, "finish_reason").items()
    }
    return {
        "config": asdict(config),
        "duration_s": duration,
        "requests_per_s": config.num_requests / duration,
        "outcomes": dict(tally.outcomes),
        "accepted": tally.accepted,
        "server_finished": int(finished),
        "server_finished_by_reason": by_reason,
        "rss_before_bytes": rss_before,
        "rss_after_bytes": rss_after,
        "rss_growth": growth,
        "kv_cache_usage_after": after.value(KV_USAGE),
        "problems": tally.problems,
        "ok": not tally.problems,
    }


def print_report(result: dict[str, object], console: Console) -> None:
    table = Table(title="soak: outcomes")
    table.add_column("outcome")
    table.add_column("count", justify="right")
    for name, count in sorted(result["outcomes"].items()):  # type: ignore[union-attr]
        table.add_row(name, str(count))
    console.print(table)
    summary = Table(title="soak: checks", show_header=False)
    summary.add_row(
        "requests / duration",
        f"{result['config']['num_requests']} in {result['duration_s']:.1f} s "  # type: ignore[index]
        f"({result['requests_per_s']:.0f} req/s)",
    )
    summary.add_row(
        "accepted / finished on server", f"{result['accepted']} / {result['server_finished']}"
    )
    summary.add_row("server finish reasons", json.dumps(result["server_finished_by_reason"]))
    if result["rss_before_bytes"]:
        summary.add_row(
            "server RSS before / after",
            f"{result['rss_before_bytes'] / 2**20:.1f} MiB / "  # type: ignore[operator]
            f"{result['rss_after_bytes'] / 2**20:.1f} MiB "  # type: ignore[operator]
            f"({result['rss_growth']:+.1%})",
        )
    summary.add_row("problems", str(len(result["problems"])))  # type: ignore[arg-type]
    console.print(summary)
    for problem in result["problems"][:20]:  # type: ignore[index]
        console.print(f"[red]{problem}[/red]")
    console.print("[green]OK: nothing leaked[/green]" if result["ok"] else "[red]FAILED[/red]")
