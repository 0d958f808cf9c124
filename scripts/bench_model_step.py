"""Benchmark the real model's ``step`` (no HTTP): decode tok/s against the memory-bandwidth
limit, mixed vs alternating prefill, threads, agreement with float32, and RSS
(``scenarios/model_step.py``).

    python scripts/bench_model_step.py                   # everything, ~5 minutes
    python scripts/bench_model_step.py --parts decode --batches 1,16,64 --trials 7

Parts (``--parts``, comma-separated):

* ``bandwidth``: GB/s of reading a 1 GiB tensor (``sum``) and of copying it, with 1 and 2
  threads; the decode limit of each configuration is that GB/s over the bytes one decode step
  must read (every projection weight once, plus each row's KV cache).
* ``decode``: every configuration (``--configs``) loaded in this one process; for each batch
  size, ``--trials`` rounds, each running ``--steps`` decode steps of every configuration in
  turn (order alternating), so a noisy neighbour hits them all alike. Reports the median and
  best tok/s and the ratio to the bandwidth limit.
* ``threads``: the same with 1 and 2 torch threads interleaved (first configuration).
* ``mixed``: 15 decode rows and one 100-token prompt chunk in one step ("mixed", what the
  scheduler builds when ``--max-num-batched-tokens`` >= 115) against a decode step followed by
  the chunk alone ("alternating").
* ``chunks``: one short prompt chunk's step (``--chunk-sizes`` tokens) from position 0 and
  after a ``--chunk-prefix``-token cached prefix, through the fused C kernels (one row per
  token) against the eager path, interleaved, for the bfloat16 configurations: what
  ``FUSED_PREFILL_MAX_TOKENS`` and ``FUSED_PREFILL_KEY_BUDGET`` (app/models/forward/forward_plan.py)
  were chosen from.
* ``agreement``: teacher-forced greedy agreement of each configuration with float32 on a fixed
  prompt set (at every position both have seen the float32 tokens), and the largest logit
  difference.
* ``rss``: each configuration in its own subprocess with 16 slots x 2048 positions: RSS after
  loading, after a 16-row prefill, and with the whole cache written (every position of every
  slot touched, as 16 full-length sequences would).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from scenarios.model_step import (
    Config,
    measure_agreement,
    measure_bandwidth,
    measure_chunks,
    measure_decode,
    measure_mixed,
    measure_rss,
    measure_rss_child,
    measure_threads,
)

from app.models.load.plan import load_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts",
        default="bandwidth,decode,threads,mixed,chunks,agreement,rss",
        help="what to measure",
    )
    parser.add_argument("--configs", default="float32:none,bfloat16:none,bfloat16:int8")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--chunk-sizes", default="2,4,8,16,24,32,48,64")
    parser.add_argument("--chunk-prefix", type=int, default=320)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--agreement-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path, default=Path("out/bench_model_step.json"))
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss_child:
        print(json.dumps(measure_rss_child(Config(*args.rss_child.split(":")))))
        return
    args.batches = [int(b) for b in args.batches.split(",")]
    args.chunk_sizes = [int(n) for n in args.chunk_sizes.split(",")]
    parts = set(args.parts.split(","))
    configs = [Config(*c.split(":")) for c in args.configs.split(",")]
    report: dict = {
        "load_average_at_start": os.getloadavg(),
        "threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
    }
    if "bandwidth" in parts:
        report["bandwidth"] = measure_bandwidth()
        print(json.dumps(report["bandwidth"]), flush=True)
    runners = {}
    if parts & {"decode", "threads", "mixed", "chunks", "agreement"}:
        max_slots = max(max(args.batches), 16)
        # a decode loop runs its slots' positions on through every trial
        decoded = args.prompt_len + args.warmup + args.trials * args.steps + 1
        runners = {
            c.name: load_checkpoint(
                "smollm2",
                max_num_seqs=max_slots,
                max_model_len=max(512, decoded),
                dtype=c.dtype,
                quantization=c.quantization,
            )
            for c in configs
        }
    if "decode" in parts:
        bandwidth = report.get("bandwidth", {}).get(f"read_gb_s_{torch.get_num_threads()}_threads")
        report["decode"] = measure_decode(runners, args, bandwidth)
    if "threads" in parts:
        report["threads_1_vs_2"] = measure_threads(runners[configs[0].name], args)
    if "mixed" in parts:
        report["mixed_vs_alternating"] = {
            name: measure_mixed(runner, args) for name, runner in runners.items()
        }
    if "chunks" in parts:
        report["chunks_fused_vs_eager"] = {
            name: measure_chunks(runner, args)
            for name, runner in runners.items()
            if runner.model.fused_decode is not None
        }
    if "agreement" in parts:
        reference = runners.get("float32") or load_checkpoint(
            "smollm2", max_num_seqs=1, max_model_len=512
        )
        report["agreement_with_float32"] = {
            name: measure_agreement(reference, runner, args.agreement_tokens)
            for name, runner in runners.items()
            if name != "float32"
        }
        print(json.dumps(report["agreement_with_float32"]), flush=True)
    runners.clear()
    if "rss" in parts:
        report["rss_16_slots_x_2048"] = measure_rss(configs)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
