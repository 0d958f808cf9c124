"""Throughput of 1 vs 2 mock replicas behind nginx (the routing of docker/nginx.conf), in one run
(``scenarios/replicas.py``).

    python scripts/bench_replicas.py                      # prints a table, writes JSON
    python scripts/bench_replicas.py --replicas 1 2 3 --requests 96 --out results-replicas.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from scenarios.replicas import ReplicaBench, compare, print_table


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
    bench = ReplicaBench(
        replica_counts=tuple(args.replicas),
        mock_step_ms=args.mock_step_ms,
        slots=args.slots,
        concurrency=args.concurrency,
        requests=args.requests,
        max_tokens=args.max_tokens,
        direct=args.direct,
    )
    results = compare(bench)
    print_table(results)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    args.out.write_text(
        json.dumps({"config": config, "runs": [asdict(r) for r in results]}, indent=2) + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
