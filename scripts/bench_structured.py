"""Structured output's cost on SmolLM2 (``scenarios/structured_output.py``).

    python scripts/bench_structured.py                  # 3 rounds, 64 tokens, 1 and 16 streams
    python scripts/bench_structured.py --rounds 1 --max-tokens 16 --streams 1   # smallest run

Prints completion tok/s with and without a JSON-schema constraint (medians and the ratio per
round, interleaved in one process) and the compile time of the schema corpus.
"""

from __future__ import annotations

import argparse
import json

from scenarios.structured_output import run_compile, run_throughput, summary

from app.llm import LLM


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--model", default="smollm2", help="smollm2, mock or a path")
    args = parser.parse_args(argv)
    llm = LLM(
        args.model,
        max_num_seqs=max(args.streams),
        max_model_len=1024,
        torch_threads=args.torch_threads,
    )
    rounds = run_throughput(
        llm, rounds=args.rounds, max_tokens=args.max_tokens, streams=tuple(args.streams)
    )
    compiled = run_compile(llm)
    for line in summary(rounds, compiled):
        print(line)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "rounds": [
                        {
                            "streams": r.streams,
                            "free": r.free_tok_s,
                            "json_schema": r.constrained_tok_s,
                        }
                        for r in rounds
                    ],
                    "compile_ms": compiled.compile_ms,
                    "first_mask_ms": compiled.first_mask_ms,
                },
                out,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
