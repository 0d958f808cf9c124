"""Overload burst: offer N x the server's capacity and check it only says 200 or 429, and
says 429 fast.

    python scripts/overload_burst.py                    # starts its own mock server
    python scripts/overload_burst.py --multiple 10 --duration 5 --out burst.json

Capacity is what the server can complete: ``max_num_seqs / (max_tokens x step time)``
requests/s for the started mock server. The script sends Poisson arrivals at ``--multiple``
times that rate for ``--duration`` seconds (aiohttp, one connection per request in flight),
records each status and latency (send to full response), prints a table, writes JSON, and exits
1 if any status other than 200/429 came back or the p99 latency of 429 answers exceeds
``--max-429-p99-ms``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import aiohttp
import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table
from server_process import ServerSpec, running


async def burst(
    url: str, rate: float, duration_s: float, max_tokens: int, seed: int
) -> list[tuple[int, float]]:
    rng = np.random.default_rng(seed)
    connector = aiohttp.TCPConnector(limit=0)
    results: list[tuple[int, float]] = []
    async with aiohttp.ClientSession(url, connector=connector) as session:

        async def one(index: int) -> None:
            body = {"prompt": f"burst {index}", "max_tokens": max_tokens, "ignore_eos": True}
            started = time.perf_counter()
            async with session.post("/generate", json=body) as response:
                await response.read()
                results.append((response.status, (time.perf_counter() - started) * 1000.0))

        tasks = []
        loop_start = time.perf_counter()
        next_at = 0.0
        index = 0
        while next_at < duration_s:
            delay = loop_start + next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(index)))
            index += 1
            next_at += rng.exponential(1.0 / rate)
        await asyncio.gather(*tasks)
    return results


def loop_lag_buckets(url: str) -> dict[float, float]:
    """The server's cumulative ``slotserve_event_loop_lag_seconds`` buckets: upper bound (s) ->
    samples at most that late."""
    body = httpx.get(url + "/metrics", timeout=10).text
    return {
        float(sample.labels["le"]): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
        if sample.name == "slotserve_event_loop_lag_seconds_bucket"
    }


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The smallest bucket bound (s) holding a fraction ``q`` of the samples taken between the
    two scrapes; ``inf`` when there were none."""
    total = after.get(math.inf, 0.0) - before.get(math.inf, 0.0)
    for bound in sorted(after):
        if total > 0 and after[bound] - before.get(bound, 0.0) >= q * total:
            return bound
    return math.inf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="server to hit (give --capacity); default: start a mock")
    parser.add_argument("--capacity", type=float, help="requests/s --url's server completes")
    parser.add_argument("--multiple", type=float, default=10.0, help="offered rate / capacity")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of arrivals")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-queue", type=int, default=16)
    parser.add_argument("--mock-step-ms", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-429-p99-ms", type=float, default=10.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    with ExitStack() as stack:
        url, capacity = args.url, args.capacity
        if url is None:
            spec = ServerSpec.mock(
                "burst-mock",
                step_ms=args.mock_step_ms,
                max_num_seqs=args.max_num_seqs,
                flags=("--max-queue", str(args.max_queue)),
            )
            url = stack.enter_context(running(spec, Path(tempfile.mkdtemp(prefix="burst-")))).url
            capacity = args.max_num_seqs / (args.max_tokens * args.mock_step_ms / 1000.0)
        if capacity is None:
            parser.error("--capacity is required with --url")
        rate = capacity * args.multiple
        # the client's own full collections (tens of ms) would count as server latency
        gc.collect()
        gc.freeze()
        lag_before = loop_lag_buckets(url)
        results = asyncio.run(burst(url, rate, args.duration, args.max_tokens, args.seed))
        lag_after = loop_lag_buckets(url)

    statuses = Counter(status for status, _ in results)
    by_status = {status: np.array([ms for s, ms in results if s == status]) for status in statuses}
    count = len(results)
    table = Table(
        title=f"overload: {count} requests at {rate:.0f}/s = {args.multiple:g} x capacity "
        f"({capacity:.0f}/s)"
    )
    for column in ("status", "count", "p50 ms", "p90 ms", "p99 ms", "max ms"):
        table.add_column(column, justify="right")
    summary: dict[str, dict[str, float]] = {}
    for status, values in sorted(by_status.items()):
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        summary[str(status)] = {
            "count": len(values),
            "p50_ms": p50,
            "p90_ms": p90,
            "p99_ms": p99,
            "max_ms": float(values.max()),
        }
        table.add_row(
            str(status),
            str(len(values)),
            f"{p50:.2f}",
            f"{p90:.2f}",
            f"{p99:.2f}",
            f"{values.max():.2f}",
        )
    Console().print(table)
    loop_lag_p99 = bucket_quantile(lag_before, lag_after, 0.99)
    Console().print(
        f"server event-loop lag during the burst: p99 <= {loop_lag_p99 * 1000:g} ms "
        "(slotserve_event_loop_lag_seconds; the rest of a 429's latency is the client and the OS)"
    )
    problems = [f"unexpected status {s}" for s in statuses if s not in (200, 429)]
    p99_429 = summary.get("429", {}).get("p99_ms")
    if p99_429 is None:
        problems.append("no 429 at all: the burst did not overload the server")
    elif p99_429 > args.max_429_p99_ms:
        problems.append(f"429 p99 {p99_429:.2f} ms > {args.max_429_p99_ms} ms")
    for problem in problems:
        Console().print(f"[red]{problem}[/red]")
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "count": count,
                    "capacity_rps": capacity,
                    "rate_rps": rate,
                    "by_status": summary,
                    "server_event_loop_lag_p99_ms_at_most": loop_lag_p99 * 1000,
                    "problems": problems,
                },
                indent=2,
            )
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
