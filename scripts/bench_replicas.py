"""Throughput of 1 vs 2 mock replicas behind nginx (the routing of docker/nginx.conf), in one run.

    python scripts/bench_replicas.py                      # prints a table, writes JSON
    python scripts/bench_replicas.py --replicas 1 2 3 --requests 96 --out results-replicas.json

For each replica count it starts that many ``python -m app serve --model mock`` processes and an
nginx in front (scripts/local_cluster.py, all on 127.0.0.1), then keeps ``--concurrency``
non-stream requests of ``--max-tokens`` tokens (ignore_eos) in flight through nginx until
``--requests`` have finished. ``--direct`` adds a run against one replica without nginx, to see
what the proxy costs. Numbers are client-side: tokens/s = completion tokens / wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from local_cluster import local_cluster


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


async def run_load(url: str, args: argparse.Namespace, name: str, replicas: int, via_nginx: bool):
    body = {"prompt": "bench", "max_tokens": args.max_tokens, "ignore_eos": True}
    limits = httpx.Limits(
        max_connections=args.concurrency, max_keepalive_connections=args.concurrency
    )
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        await asyncio.gather(
            *(client.post("/generate", json=body) for _ in range(args.concurrency))
        )
        todo = iter(range(args.requests))
        latencies: list[float] = []
        owners: Counter[str] = Counter()
        tokens = errors = 0

        async def worker() -> None:
            nonlocal tokens, errors
            for _ in todo:
                started = time.perf_counter()
                response = await client.post("/generate", json=body)
                latencies.append(time.perf_counter() - started)
                if response.status_code != 200:
                    errors += 1
                    continue
                answer = response.json()
                tokens += answer["usage"]["completion_tokens"]
                owners[answer["id"].split("-")[0]] += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - started
    latencies.sort()
    return RunResult(
        name=name,
        replicas=replicas,
        via_nginx=via_nginx,
        requests=args.requests,
        errors=errors,
        wall_s=round(wall, 3),
        completion_tokens=tokens,
        tokens_per_s=round(tokens / wall, 1),
        requests_per_s=round(args.requests / wall, 2),
        latency_p50_s=round(statistics.median(latencies), 3),
        latency_p99_s=round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
        per_replica=dict(sorted(owners.items())),
    )


def bench(args: argparse.Namespace) -> list[RunResult]:
    server_args = ["--model", "mock", "--mock-step-ms", str(args.mock_step_ms)]
    server_args += ["--max-num-seqs", str(args.slots), "--log-level", "warning"]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        for count in args.replicas:
            replica_ids = [f"r{i}" for i in range(count)]
            workdir = Path(tmp) / f"{count}"
            with local_cluster(replica_ids, workdir, server_args=server_args) as cluster:
                if args.direct and count == 1:
                    url = cluster.replicas["r0"]
                    results.append(asyncio.run(run_load(url, args, "1 direct", 1, False)))
                name = f"{count} via nginx"
                results.append(asyncio.run(run_load(cluster.url, args, name, count, True)))
    return results


def print_table(results: list[RunResult]) -> None:
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="counts to run")
    parser.add_argument("--mock-step-ms", type=float, default=20.0, help="mock model step time")
    parser.add_argument("--slots", type=int, default=8, help="--max-num-seqs of each replica")
    parser.add_argument("--concurrency", type=int, default=32, help="requests kept in flight")
    parser.add_argument("--requests", type=int, default=64, help="requests measured per run")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--direct", action="store_true", help="also 1 replica without nginx")
    parser.add_argument("--out", type=Path, default=Path("results-replicas.json"))
    args = parser.parse_args()
    results = bench(args)
    print_table(results)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    args.out.write_text(
        json.dumps({"config": config, "runs": [asdict(r) for r in results]}, indent=2) + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
