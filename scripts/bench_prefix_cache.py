"""Evidence for the paged KV cache and prefix caching (issue #17), ratios from one run.

    python scripts/bench_prefix_cache.py                        # everything, SmolLM2 bfloat16
    python scripts/bench_prefix_cache.py --only multi-turn shared-prompt
    python scripts/bench_prefix_cache.py --baseline /path/to/old/checkout --json out.json

Workloads (each side a fresh server; the two sides of a comparison run interleaved, turn by
turn or round by round, so a shared machine's load falls on both):

* ``multi-turn``: ``--rounds`` 5-turn chats, each turn resending the whole history; the
  server's TTFT of turn 5 (``timings.ttft_ms``) with prefix caching over without
  (``--no-prefix-caching``), the median over the chats.
* ``shared-prompt``: 16 concurrent requests sharing a ~1,000-token system prompt; prompt tokens
  computed (queried minus hit, from /metrics) and the wave's wall time, on over off.
* ``many-slots``: 64 slots of 2,048 positions under ``--kv-cache-memory 400MiB``; 64 concurrent
  ~700-token requests must all complete, and the server's RSS growth over idle stays within the
  pool (with the preemptions it took).
* ``decode``: aggregate decode tok/s of 1, 16 and 64 streams, this checkout over
  ``--baseline`` (another checkout's ``python -m app serve``, e.g. the commit before the paged
  cache); skipped without ``--baseline``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from rich.console import Console
from scenarios.prefix_cache import WORKLOADS, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--only",
        nargs="+",
        default=list(WORKLOADS),
        choices=WORKLOADS,
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="a checkout to compare decode tok/s with")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    results = asyncio.run(run(args, Console()))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
