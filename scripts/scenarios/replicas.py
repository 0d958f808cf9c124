"""Throughput of 1, 2, ... mock replicas behind nginx (the routing of docker/nginx.conf), in one
run (the command line is ``scripts/bench_replicas.py``).

For each replica count: that many ``python -m app serve --model mock`` processes and an nginx in
front (``harness.cluster``, all on 127.0.0.1), then loadgen's closed loop keeps ``concurrency``
non-stream requests of ``max_tokens`` tokens (ignore_eos) in flight through nginx until
``requests`` have finished, after a warm-up of ``concurrency`` requests. The requests carry no
``X-Request-Id``, so nginx balances them by ``least_conn`` and each answer's server-made id names
the replica that served it. ``direct`` adds a run against one replica without nginx, to see what
the proxy costs. Numbers are client-side: tokens/s = completion tokens / wall time (first send to
last answer); latency percentiles are loadgen's.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.cluster import local_cluster
from loadgen import LoadConfig, LoadResult, Outcome, WorkloadConfig, run_load


@dataclass(frozen=True, slots=True)
class ReplicaBench:
    """What every run of the comparison uses."""

    replica_counts: tuple[int, ...]
    mock_step_ms: float
    slots: int
    concurrency: int
    requests: int
    max_tokens: int
    direct: bool


@dataclass
class RunResult:
    name: str
    replicas: int
    via_nginx: bool
    requests: int
    errors: int
    wall_s: float
    completion_tokens: int
    tokens_per_s: float
    requests_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    per_replica: dict[str, int]


def load_config(url: str, bench: ReplicaBench, num_requests: int) -> LoadConfig:
    return LoadConfig(
        url=url,
        concurrency=bench.concurrency,
        num_requests=num_requests,
        send_request_ids=False,
        timeout_s=120.0,
        workload=WorkloadConfig(
            prompt_len=1, output_len=bench.max_tokens, ignore_eos=True, stream=False
        ),
    )


def run_result(name: str, replicas: int, via_nginx: bool, result: LoadResult) -> RunResult:
    summary = result.summary
    ok = [record for record in result.records if record.outcome is Outcome.OK]
    owners = Counter((record.server_request_id or "?").split("-")[0] for record in ok)
    e2e = summary.e2e_ms
    return RunResult(
        name=name,
        replicas=replicas,
        via_nginx=via_nginx,
        requests=summary.requests,
        errors=summary.requests - len(ok),
        wall_s=round(result.duration_s, 3),
        completion_tokens=summary.output_tokens,
        tokens_per_s=round(summary.output_token_throughput, 1),
        requests_per_s=round(summary.requests / result.duration_s, 2),
        latency_p50_s=round(e2e.p50 / 1000, 3) if e2e else float("nan"),
        latency_p99_s=round(e2e.p99 / 1000, 3) if e2e else float("nan"),
        per_replica=dict(sorted(owners.items())),
    )


async def measure(url: str, bench: ReplicaBench, name: str, replicas: int, via: bool) -> RunResult:
    await run_load(load_config(url, bench, bench.concurrency))  # warm-up
    result = await run_load(load_config(url, bench, bench.requests))
    return run_result(name, replicas, via, result)


def compare(bench: ReplicaBench) -> list[RunResult]:
    server_args = ("--model", "mock", "--mock-step-ms", f"{bench.mock_step_ms:g}")
    server_args += ("--max-num-seqs", str(bench.slots))
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        for count in bench.replica_counts:
            replica_ids = [f"r{i}" for i in range(count)]
            workdir = Path(tmp) / f"{count}"
            with local_cluster(replica_ids, workdir, server_args=server_args) as cluster:
                if bench.direct and count == 1:
                    url = cluster.replicas["r0"]
                    results.append(asyncio.run(measure(url, bench, "1 direct", 1, False)))
                name = f"{count} via nginx"
                results.append(asyncio.run(measure(cluster.url, bench, name, count, True)))
    return results


def print_table(results: Sequence[RunResult]) -> None:
    header = (
        f"{'run':<14}{'tok/s':>9}{'req/s':>8}{'p50 s':>8}{'p99 s':>8}{'errors':>8}  per replica"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.name:<14}{r.tokens_per_s:>9.1f}{r.requests_per_s:>8.2f}{r.latency_p50_s:>8.3f}"
            f"{r.latency_p99_s:>8.3f}{r.errors:>8}  {r.per_replica}"
        )
