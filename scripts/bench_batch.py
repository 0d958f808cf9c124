"""Batch runner throughput against the HTTP server on the same requests
(``scenarios/batch_runner.py``).

    python scripts/bench_batch.py                 # mock (5 ms steps, none), then SmolLM2
    python scripts/bench_batch.py --quick         # one round of each mock workload, no SmolLM2
    python scripts/bench_batch.py --only smollm2 --rounds 5 --json out.json

Each workload: ``python -m app batch`` on a file of the requests, and the same bodies POSTed to
``python -m app serve`` with the same flags, interleaved round by round; the figure is completion
tok/s, batch over HTTP, per round and its median. SmolLM2 runs with one torch thread: on a
shared two-core machine, two OpenMP threads wait on each other at every barrier whenever another
process takes a core, which swamps the difference measured here (set ``--smollm2-threads``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from rich.console import Console
from scenarios.batch_runner import BatchBench, as_json, compare, report


def workloads(quick: bool, rounds: int, smollm2_threads: int) -> list[BatchBench]:
    mock = ("--model", "mock", "--max-num-seqs", "16")
    benches = [
        BatchBench("mock 5 ms/step", (*mock, "--mock-step-ms", "5"), 256, 32, 64, rounds),
        BatchBench("mock 0 ms/step", (*mock, "--mock-step-ms", "0"), 1024, 16, 64, rounds),
    ]
    if quick:
        return [
            BatchBench(b.name, b.model_flags, b.requests // 4, b.max_tokens, 64, 1) for b in benches
        ]
    threads = ("--torch-threads", str(smollm2_threads))
    smollm2 = ("--model", "smollm2", "--max-num-seqs", "16", *threads)
    return [*benches, BatchBench("SmolLM2-135M", smollm2, 64, 64, 32, rounds)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="one short round, mock only")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--only", choices=("mock", "smollm2"), help="run only the mock or the SmolLM2 workloads"
    )
    parser.add_argument("--smollm2-threads", type=int, default=1, help="SmolLM2's torch threads")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as workdir:
        for bench in workloads(args.quick, args.rounds, args.smollm2_threads):
            if args.only is None or (args.only == "smollm2") == bench.name.startswith("SmolLM2"):
                results.append((bench, compare(bench, Path(workdir))))
    report(results, Console())
    if args.json is not None:
        args.json.write_text(json.dumps(as_json(results), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
