"""Benchmark the sampler's cost per step with and without logits processors at 1/16/64 rows
(``scenarios/sampler_cost.py``; no model, no HTTP).

    python scripts/bench_sampler.py                 # 1, 16, 64 rows, 15 trials
    python scripts/bench_sampler.py --quick         # the smallest run (tests)

Prints, per batch size, the median ms per step of each configuration and the ratios
``plain / bare`` (what the pipeline costs rows that use no processor) and
``processors / plain`` (what every processor on every row costs).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from scenarios.sampler_cost import measure_sampler_cost


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64", help="batch sizes, comma-separated")
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5, help="sample calls per timing")
    parser.add_argument("--quick", action="store_true", help="1 and 4 rows, 2 trials, 1 step")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    rows = [1, 4] if args.quick else [int(r) for r in args.rows.split(",")]
    trials, steps = (2, 1) if args.quick else (args.trials, args.steps)
    results = measure_sampler_cost(rows, trials, steps)
    figures = {}
    for cost in results:
        line = {
            "median_ms": {name: round(ms, 4) for name, ms in cost.median_ms.items()},
            "plain_over_bare": round(cost.ratio("plain", "bare"), 3),
            "processors_over_plain": round(cost.ratio("processors", "plain"), 3),
            "greedy_penalties_over_greedy": round(cost.ratio("greedy+penalties", "greedy"), 3),
        }
        figures[str(cost.rows)] = line
        timings = "  ".join(f"{name} {ms:.3f}" for name, ms in cost.median_ms.items())
        print(
            f"{cost.rows:>3} rows  ms/step: {timings}  |  plain/bare {line['plain_over_bare']}"
            f"  processors/plain {line['processors_over_plain']}"
            f"  greedy+pen/greedy {line['greedy_penalties_over_greedy']}"
        )
    if args.json:
        args.json.write_text(json.dumps({"rows": figures, "raw": [asdict(r) for r in results]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
