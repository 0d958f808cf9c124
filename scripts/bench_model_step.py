"""Benchmark the real model's ``step``: load time, RSS, decode tokens/s per batch size.

Each dtype is measured in its own subprocess so that its RSS is its own. For every batch size
``B``: ``B`` slots are prefilled with a prompt of ``--prompt-len`` tokens (one step per slot),
then ``--steps`` decode steps run with all ``B`` rows in one batch; decode tokens/s is
``B * steps / seconds`` over those steps (greedy unless ``--temperature`` > 0), best of
``--trials`` runs (the median is kept too: on a shared machine other processes steal cores, and
two OpenMP threads suffer badly when one of them is descheduled).

    python scripts/bench_model_step.py --dtypes float32,bfloat16 --batches 1,8,16,64 \\
        --json out/bench_model_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.models.base import SamplingParams, StepBatch, StepRow  # noqa: E402


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _measure_one(args: argparse.Namespace) -> dict:
    import torch

    from app.models.smollm2 import load_smollm2

    batches = [int(b) for b in args.batches.split(",")]
    started = time.perf_counter()
    runner = load_smollm2(
        max_num_seqs=max(batches),
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
    )
    load_s = time.perf_counter() - started
    result = {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "backend": runner.capabilities.backend,
        "threads": torch.get_num_threads(),
        "load_s": round(load_s, 2),
        "rss_after_load_mib": round(_rss_mib(), 1),
        "kv_bytes_per_slot": runner.cache.bytes_per_slot,
        "max_model_len": args.max_model_len,
        "prompt_len": args.prompt_len,
        "load_average_at_start": os.getloadavg()[0],
        "decode": [],
    }
    sampling = SamplingParams(temperature=args.temperature, top_p=0.95, seed=1)
    prompt = tuple((17 + 31 * i) % 40000 + 100 for i in range(args.prompt_len))
    for batch in batches:
        next_tokens = []
        for slot in range(batch):
            out = runner.step(StepBatch((StepRow(slot, prompt, 0, True, sampling),)))
            next_tokens.append(out.next_token_ids[0])
        position = args.prompt_len
        for _ in range(args.warmup):
            rows = tuple(
                StepRow(s, (next_tokens[s],), position, True, sampling) for s in range(batch)
            )
            next_tokens = list(runner.step(StepBatch(rows)).next_token_ids)
            position += 1
        trial_seconds = []
        for _ in range(args.trials):
            started = time.perf_counter()
            for _ in range(args.steps):
                rows = tuple(
                    StepRow(s, (next_tokens[s],), position, True, sampling) for s in range(batch)
                )
                next_tokens = list(runner.step(StepBatch(rows)).next_token_ids)
                position += 1
            trial_seconds.append(time.perf_counter() - started)
        best, median = min(trial_seconds), sorted(trial_seconds)[len(trial_seconds) // 2]
        result["decode"].append(
            {
                "batch": batch,
                "tokens_per_s": round(batch * args.steps / best, 1),
                "tokens_per_s_median": round(batch * args.steps / median, 1),
                "ms_per_step": round(1000 * best / args.steps, 2),
            }
        )
        for slot in range(batch):
            runner.release(slot)
    result["rss_end_mib"] = round(_rss_mib(), 1)
    return result


def _print_table(results: list[dict]) -> None:
    print(
        f"{'dtype':<10} {'quant':<6} {'load s':>7} {'RSS MiB':>8} {'KV/slot MiB':>11} "
        f"{'batch':>5} {'tok/s':>8} {'median':>8} {'ms/step':>8}"
    )
    for r in results:
        for d in r["decode"]:
            print(
                f"{r['dtype']:<10} {r['quantization']:<6} {r['load_s']:>7} "
                f"{r['rss_after_load_mib']:>8} {r['kv_bytes_per_slot'] / 2**20:>11.2f} "
                f"{d['batch']:>5} {d['tokens_per_s']:>8} {d['tokens_per_s_median']:>8} "
                f"{d['ms_per_step']:>8}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--quantizations", default="none")
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, default=Path("out/bench_model_step.json"))
    parser.add_argument("--dtype", help=argparse.SUPPRESS)  # child mode: one configuration
    parser.add_argument("--quantization", default="none", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.dtype:
        print(json.dumps(_measure_one(args)))
        return

    results = []
    for dtype in args.dtypes.split(","):
        for quantization in args.quantizations.split(","):
            child = [sys.executable, __file__, "--dtype", dtype, "--quantization", quantization]
            for name in (
                "batches",
                "prompt_len",
                "steps",
                "warmup",
                "max_model_len",
                "temperature",
                "device",
            ):
                child += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
            done = subprocess.run(child, capture_output=True, text=True, env=os.environ)
            if done.returncode != 0:
                print(done.stderr, file=sys.stderr)
                raise SystemExit(f"{dtype}/{quantization} failed")
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    _print_table(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
