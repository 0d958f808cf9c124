"""Overload burst: offer N x the server's capacity and check it only says 200 or 429, and
says 429 fast (``scenarios/overload.py``).

    python scripts/overload_burst.py                    # starts its own mock server
    python scripts/overload_burst.py --multiple 10 --duration 5 --out burst.json

Capacity is what the server can complete: ``max_num_seqs / (max_tokens x step time)``
requests/s for the started mock server. The script sends Poisson arrivals at ``--multiple``
times that rate for ``--duration`` seconds, records each status and latency (send to full
response), prints a table, writes JSON, and exits 1 if any status other than 200/429 came back
or the p99 latency of 429 answers exceeds ``--max-429-p99-ms``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from harness.server import ServerSpec, running
from rich.console import Console
from scenarios.overload import BurstConfig, burst, report


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
        config = BurstConfig(
            url=url,
            rate=capacity * args.multiple,
            duration_s=args.duration,
            max_tokens=args.max_tokens,
            seed=args.seed,
            capacity_rps=capacity,
            max_429_p99_ms=args.max_429_p99_ms,
        )
        records, loop_lag_p99_s = asyncio.run(burst(config))
    result = report(config, records, loop_lag_p99_s, Console())
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
