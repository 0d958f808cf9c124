"""Soak test: many requests, a share cancelled or abandoned, bad bodies mixed in; then check
that nothing leaked (what is sent and checked: ``scenarios/soak.py``).

    python scripts/soak.py                       # starts its own mock server, 10k requests
    python scripts/soak.py --num-requests 2000 --concurrency 32 --out soak.json
    python scripts/soak.py --url http://127.0.0.1:8000 --server-pid 1234

Exits 1 when a check fails. Traffic goes only to the given URL (loopback by default).
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
from scenarios.soak import SoakConfig, print_report, soak


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="server to soak; default: start a mock server on 127.0.0.1")
    parser.add_argument("--server-pid", type=int, help="pid of --url's server, for RSS")
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--cancel-fraction", type=float, default=0.15, help="DELETEd mid-stream")
    parser.add_argument("--disconnect-fraction", type=float, default=0.15, help="client leaves")
    parser.add_argument("--bad-fraction", type=float, default=0.05, help="invalid bodies")
    parser.add_argument("--non-stream-fraction", type=float, default=0.2)
    parser.add_argument(
        "--max-tokens", type=int, default=24, help="mean max_tokens (uniform 1..2x)"
    )
    parser.add_argument("--mock-step-ms", type=float, default=1.0, help="for the started server")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="for the started server")
    parser.add_argument("--max-rss-growth", type=float, default=0.10, help="fraction, e.g. 0.10")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    with ExitStack() as stack:
        url, pid = args.url, args.server_pid
        if url is None:
            spec = ServerSpec.mock(
                "soak-mock", step_ms=args.mock_step_ms, max_num_seqs=args.max_num_seqs
            )
            server = stack.enter_context(running(spec, Path(tempfile.mkdtemp(prefix="soak-"))))
            url, pid = server.url, server.pid
        config = SoakConfig(
            url=url,
            num_requests=args.num_requests,
            concurrency=args.concurrency,
            cancel_fraction=args.cancel_fraction,
            disconnect_fraction=args.disconnect_fraction,
            bad_fraction=args.bad_fraction,
            non_stream_fraction=args.non_stream_fraction,
            max_tokens=args.max_tokens,
            seed=args.seed,
            max_rss_growth=args.max_rss_growth,
            server_pid=pid,
        )
        result = asyncio.run(soak(config, console))
    print_report(result, console)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
