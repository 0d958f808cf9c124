"""N-gram speculative decoding against none, on one loaded model (``scenarios/speculation.py``).

    python scripts/bench_speculation.py                       # SmolLM2, the issue's table
    python scripts/bench_speculation.py --quick               # 1 stream each, 32 tokens
    python scripts/bench_speculation.py --model PATH --k 4 --streams 1 4 --json out.json
    python scripts/bench_speculation.py --step-cost           # the back-off's stand-in table
    python scripts/bench_speculation.py --llama-server none   # without llama.cpp's server

The model is loaded as the server loads it by default (``--dtype bfloat16 --quantization
auto``: a GGUF file computes on its own blocks); before 2026-12-05 this script loaded it in
dense float32, the figures of that time are for that model.

Workloads: input-grounded prompts (rewrite, extract, code edit, a chat quoting itself) at 1 and
4 streams, free-form stories at 1, 16 and 64; greedy, speculation off then on, the outputs
compared token for token, in ``--rounds`` rounds alternating which setting goes first (a
round's two runs share the machine's load; the median of the rounds' ratios is reported).
With a GGUF model (``smollm2`` is one) and llama.cpp's server at ``--llama-server``, the grounded
prompts at 1 stream also go to two llama.cpp servers, its ``--spec-type ngram-simple`` off and
on, in alternating rounds. ``--step-cost``: one step of R decode rows, plain and each
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
from scenarios.speculation import (
    LLAMA_SERVER,
    llama_server_side_by_side,
    side_by_side,
    step_cost,
)

from app.models.load.plan import load_checkpoint
from app.models.load.smollm2 import smollm2_gguf_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="bundled name or a model path")
    parser.add_argument("--k", type=int, default=4, help="--speculative-ngram")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument(
        "--dtype", default="bfloat16", help="the model's dtype (the server's default: bfloat16)"
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        help="as the server's --quantization (default auto: a GGUF file on its own blocks)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="off/on rounds, order alternating")
    parser.add_argument("--quick", action="store_true", help="1 stream each, 32 tokens")
    parser.add_argument("--step-cost", action="store_true", help="measure the back-off instead")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--llama-server",
        default=str(LLAMA_SERVER),
        help="llama.cpp's server binary for the 1-stream comparison ('none': skip it)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console()
    slots = 32 if args.step_cost else (4 if args.quick else 64)
    runner = load_checkpoint(
        args.model,
        max_num_seqs=slots,
        max_model_len=1024,
        dtype=args.dtype,
        quantization=args.quantization,
    )
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
        runs = []
        for workload, streams in plan:
            runs.append(side_by_side(runner, workload, streams, args.k, tokens, args.rounds))
            console.print(f"{workload}, {streams} streams: {runs[-1].speedup:.2f}x")
        table = Table(
            "workload", "streams", "off tok/s", "on tok/s", "on/off", "rounds", "accepted", "same"
        )
        for r in runs:
            rate = "-" if r.acceptance is None else f"{r.acceptance:.0%}"
            table.add_row(
                r.workload,
                str(r.streams),
                f"{r.off_tok_s:.1f}",
                f"{r.on_tok_s:.1f}",
                f"{r.speedup:.2f}",
                " ".join(f"{x:.2f}" for x in r.ratios),
                rate,
                "yes" if r.identical else "NO",
            )
        console.print(table)
        figures = [{**asdict(r), "speedup": r.speedup} for r in runs]
        llama = None
        gguf = smollm2_gguf_path() if args.model == "smollm2" else Path(args.model)
        binary = Path(args.llama_server)
        if args.llama_server != "none" and binary.is_file() and gguf.suffix == ".gguf":
            threads = torch.get_num_threads()
            try:
                llama = llama_server_side_by_side(
                    gguf, args.k, tokens, args.rounds, threads, binary
                )
            except RuntimeError as exc:  # its server failed: ours are measured, keep them
                console.print(f"llama.cpp comparison failed: {exc}")
                console.print("(on an AMX CPU try LLAMA_ARG_REPACK=0: its repacked kernels)")
        if llama is not None:
            table = Table("llama.cpp server, grounded, 1 stream", "off tok/s", "on tok/s")
            for column in ("on/off", "rounds", "accepted", "same"):
                table.add_column(column)
            table.add_row(
                f"--spec-type {llama.spec_type}, {threads} threads",
                f"{llama.off_tok_s:.1f}",
                f"{llama.on_tok_s:.1f}",
                f"{llama.speedup:.2f}",
                " ".join(f"{x:.2f}" for x in llama.ratios),
                "-" if llama.acceptance is None else f"{llama.acceptance:.0%}",
                "yes" if llama.identical else "NO",
            )
            console.print(table)
            figures.append({"llama_server": {**asdict(llama), "speedup": llama.speedup}})
        if args.llama_server != "none" and not (binary.is_file() and gguf.suffix == ".gguf"):
            console.print(f"llama.cpp comparison skipped: no {binary}, or {gguf} is no GGUF")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
