"""N-gram speculative decoding against none, on one loaded model (``scenarios/speculation.py``).

    python scripts/bench_speculation.py                       # SmolLM2, the issue's table
    python scripts/bench_speculation.py --quick               # 1 stream each, 32 tokens
    python scripts/bench_speculation.py --model PATH --k 4 --streams 1 4 --json out.json
    python scripts/bench_speculation.py --step-cost           # the back-off's measurement

Workloads: input-grounded prompts (rewrite, extract, code edit, a chat quoting itself) at 1 and
4 streams, free-form stories at 1, 16 and 64; greedy, speculation off then on, the outputs
compared token for token. ``--step-cost``: one step of R decode rows, plain and each
verifying K drafted tokens (R = 1, 2, 4, 8, 16, 32), the cost ratio per R.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from scenarios.speculation import side_by_side, step_cost

from app.models.load.plan import load_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="bundled name or a model path")
    parser.add_argument("--k", type=int, default=4, help="--speculative-ngram")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--quick", action="store_true", help="1 stream each, 32 tokens")
    parser.add_argument("--step-cost", action="store_true", help="measure the back-off instead")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console()
    slots = 32 if args.step_cost else (4 if args.quick else 64)
    runner = load_checkpoint(args.model, max_num_seqs=slots, max_model_len=1024)
    if args.step_cost:
        costs = [step_cost(runner, rows, args.k, 256, 5) for rows in (1, 2, 4, 8, 16, 32)]
        table = Table("rows", "plain ms", f"verify {args.k} ms", "ratio")
        for c in costs:
            table.add_row(str(c.rows), f"{c.plain_ms:.1f}", f"{c.verify_ms:.1f}", f"{c.ratio:.2f}")
        console.print(table)
        figures = [asdict(c) for c in costs]
    else:
        plan = [("grounded", 1), ("free-form", 1)]
        if not args.quick:
            plan = [("grounded", 1), ("grounded", 4), ("free-form", 1), ("free-form", 16)]
            plan.append(("free-form", 64))
        tokens = 32 if args.quick else args.max_tokens
        runs = [side_by_side(runner, w, n, args.k, tokens) for w, n in plan]
        table = Table("workload", "streams", "off tok/s", "on tok/s", "on/off", "accepted", "same")
        for r in runs:
            rate = "-" if r.acceptance is None else f"{r.acceptance:.0%}"
            table.add_row(
                r.workload,
                str(r.streams),
                f"{r.off_tok_s:.1f}",
                f"{r.on_tok_s:.1f}",
                f"{r.speedup:.2f}",
                rate,
                "yes" if r.identical else "NO",
            )
        console.print(table)
        figures = [{**asdict(r), "speedup": r.speedup} for r in runs]
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
