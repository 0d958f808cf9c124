"""Time every projection of one SmolLM2 step (30 layers x fused QKV, output, fused gate/up,
down; the LM head excluded) with three weight formats, on the CPU:

* ``bf16``: packed bfloat16 (oneDNN, ``mkldnn._linear_pointwise``), the model's default;
* ``int8``: ``aten._weight_int8pack_mm`` with per-row scales (``Int8Linear``'s kernel);
* ``int4``: ``aten._weight_int4pack_mm_for_cpu`` with the GGUF's Q4_1 codes (``Int4Linear``'s
  kernel, called directly, whatever ``INT4_MAX_ROWS`` says).

    python scripts/bench_int4.py                       # 1 and 2 rows, 1 and 2 threads
    python scripts/bench_int4.py --rows 1,2,4,8,16 --threads 2 --rounds 9

Each round runs every (threads, kernel) pair once per row count, the order rotating from round
to round, so a noisy neighbour slows them all alike; a pair's figure is the median over rounds
of ``--steps`` steps. Prints a table of ms per step and the ratio to ``bf16`` of the same round
setting.

The weights and the timing loop: ``scenarios/int4_kernels.py``.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from scenarios.int4_kernels import load, time_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2", help="comma-separated row counts")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="steps timed per round and pair")
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    threads_list = [int(t) for t in args.threads.split(",")]
    kernels = load(args.layers)
    names = list(kernels)
    widths = sorted({in_features for _, in_features in kernels["bf16"]})
    generator = torch.Generator().manual_seed(0)
    inputs = {
        rows: {k: torch.randn(rows, k, generator=generator).to(torch.bfloat16) for k in widths}
        for rows in rows_list
    }
    pairs = [(threads, name) for threads in threads_list for name in names]
    times: dict[tuple[int, int, str], list[float]] = {}
    with torch.inference_mode():
        for threads, name in pairs:  # warm-up, one step each
            torch.set_num_threads(threads)
            for rows in rows_list:
                time_steps(kernels[name], inputs[rows], 1)
        for round_index in range(args.rounds):
            shift = round_index % len(pairs)
            for threads, name in pairs[shift:] + pairs[:shift]:
                torch.set_num_threads(threads)
                for rows in rows_list:
                    seconds = time_steps(kernels[name], inputs[rows], args.steps)
                    times.setdefault((threads, rows, name), []).append(seconds)
    print(
        f"ms per step, all {len(kernels['bf16'])} projections of {args.layers} layers "
        f"(median of {args.rounds} rounds x {args.steps} steps; min in brackets)"
    )
    ratio_names = " | ".join(f"{n}/bf16" for n in names[1:])
    print(f"| threads | rows | {' | '.join(names)} | {ratio_names} |")
    print("| --- " * (2 + 2 * len(names) - 1) + "|")
    for threads in threads_list:
        for rows in rows_list:
            medians = {n: statistics.median(times[(threads, rows, n)]) * 1e3 for n in names}
            cells = [
                f"{medians[n]:.2f} ({min(times[(threads, rows, n)]) * 1e3:.2f})" for n in names
            ]
            ratios = [f"{medians[n] / medians['bf16']:.2f}" for n in names[1:]]
            print(f"| {threads} | {rows} | {' | '.join(cells)} | {' | '.join(ratios)} |")


if __name__ == "__main__":
    main()
