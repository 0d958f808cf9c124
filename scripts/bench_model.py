"""The real model end to end: our server through HTTP, side by side with ``transformers``
``generate`` on the same weights (and llama.cpp's ``llama-server`` when given its path); the
pieces are ``scenarios/model_serving.py`` and ``scenarios/transformers_reference.py``.

    python scripts/bench_model.py                  # full run, ~10 minutes on the 2-core CPU
    python scripts/bench_model.py --quick          # ~2 minutes: one round, shorter outputs
    python scripts/bench_model.py --llama-server ~/llama.cpp/build/bin/llama-server

What it measures, in this order (every figure of one run comes from the same machine state, so
the *ratios* are the result; absolute numbers move with whatever else runs on the cores):

1. **throughput**: for each server configuration (``--configs``), a server subprocess
   (``python -m app serve --model smollm2``), then waves of 1, 16 and 64 streams started
   together, each asking 128 greedy tokens with ``ignore_eos`` (``--rounds`` waves per size,
   after one warm-up wave). A wave's tok/s is its completion tokens over its wall time (first
   request sent to last stream done, prefill included).
2. **transformers**: ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` in float32 and
   bfloat16, one static left-padded batch of the same prompts per wave size, ``generate`` with
   ``min_new_tokens == max_new_tokens``; tok/s the same way. Its greedy tokens are the
   reference our streams are compared with (identical sequences, matching prefix).
3. **TTFT under load**: 15 streams decode; a 100-token prompt arrives; its time to first token
   against the same request's TTFT on the idle server (its own prefill), in decode steps (the
   15 streams' median inter-token time while it was admitted).
4. **memory**: RSS of a server with 16 slots x 2048 positions after every slot's cache has been
   written to its last position (16 prompts of 2040 tokens), next to its RSS after loading.

``--llama-server PATH`` adds llama.cpp's server on the same GGUF to step 1 (OpenAI-compatible
``/v1/completions``; one slot per stream). Prints a table and writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scenarios.model_comparison import Comparison, print_table, run_comparison
from scenarios.model_serving import ServerSetup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, 32 tokens, no RSS fill")
    parser.add_argument(
        "--configs",
        default="bfloat16:none,bfloat16:int8",
        help="dtype:quantization[:threads][:eager] of our server, comma-separated ('eager': "
        "--fused-decode false); the first is the default one (TTFT and memory are measured "
        "on it)",
    )
    parser.add_argument("--sizes", default="1,16,64", help="streams per wave")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=2,
        help="torch threads of our server and of transformers; llama.cpp's -t",
    )
    parser.add_argument("--hf-dtypes", default="float32,bfloat16", help="'' for none")
    parser.add_argument("--llama-server", help="path of llama.cpp's llama-server binary")
    parser.add_argument("--json", type=Path, default=Path("out/bench_model.json"))
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.max_tokens = 1, 32
        args.hf_dtypes = "bfloat16"
    import torch

    torch.set_num_threads(args.torch_threads)  # transformers runs in this process
    comparison = Comparison(
        configs=tuple(ServerSetup.parse(c) for c in args.configs.split(",")),
        sizes=tuple(int(s) for s in args.sizes.split(",")),
        rounds=args.rounds,
        max_tokens=args.max_tokens,
        threads=args.torch_threads,
        hf_dtypes=tuple(d for d in args.hf_dtypes.split(",") if d),
        llama_server=args.llama_server,
        quick=args.quick,
    )
    report = run_comparison(comparison)
    print_table(report, comparison.sizes)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
