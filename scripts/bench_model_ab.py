"""Model-level A/B of two checkouts of this repository: decode step time, load time and RSS of
SmolLM2, the two codes interleaved in one run (no HTTP).

    git worktree add /tmp/slotserve-base <commit>      # the code to compare against
    python scripts/bench_model_ab.py --base /tmp/slotserve-base \
        --configs bfloat16:none,bfloat16:int4

Each (checkout, config) pair runs in a worker process of its own (the two checkouts' modules
cannot share one interpreter), started from that checkout with this interpreter, which loads
SmolLM2 through the checkout's own loader and then waits for commands on stdin. For every
round and batch size the driver asks each worker in turn (the order alternating from round to
round, so a noisy neighbour hits both alike) to prefill ``rows`` prompts of ``--context``
tokens and time ``--steps`` decode steps of all rows. It reports, per config and batch size,
the median step time of each checkout and the ratio this checkout / base (below 1: faster),
with each worker's load time and RSS after loading. Only one worker computes at a time.

``--configs`` entries are ``dtype:quantization`` (``auto`` is resolved by a checkout that has
it; give the base ``--base-quantization int4`` to compare against the old ``int4`` flag).
Writes ``out/bench_model_ab.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
PREFILL_ROWS = 8  # prompts per prefill step (the runner's chunk is 512 tokens a row)


# --------------------------------------------------------------------------- worker


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def _load(dtype: str, quantization: str, max_num_seqs: int, max_model_len: int):
    """SmolLM2 through whichever loader this checkout has."""
    try:
        from app.models.load.plan import load_checkpoint
    except ImportError:  # the code before the model layer's rebuild
        from app.models.load.smollm2 import load_smollm2

        return load_smollm2(
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            dtype=dtype,
            quantization=quantization,
        )
    return load_checkpoint(
        "smollm2",
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        dtype=dtype,
        quantization=quantization,
    )


def _prompt(slot: int, length: int) -> tuple[int, ...]:
    return tuple((101 + 37 * i + 1009 * slot) % 40000 + 50 for i in range(length))


def worker(
    dtype: str, quantization: str, max_num_seqs: int, max_model_len: int, threads: int
) -> None:
    import torch

    from app.models.base import SamplingParams, StepBatch, StepRow

    torch.set_num_threads(threads)

    greedy = SamplingParams(temperature=0.0)
    started = time.perf_counter()
    runner = _load(dtype, quantization, max_num_seqs, max_model_len)
    load_s = time.perf_counter() - started
    print(
        json.dumps(
            {
                "load_s": round(load_s, 2),
                "rss_after_load_mib": _rss_mib(),
                "backend": runner.capabilities.backend,
            }
        ),
        flush=True,
    )
    for line in sys.stdin:
        command = json.loads(line)
        rows, steps, context = command["rows"], command["steps"], command["context"]
        for first in range(0, rows, PREFILL_ROWS):  # prompts of context tokens, a few a step
            prefill = tuple(
                StepRow(slot, _prompt(slot, context), 0, True, greedy)
                for slot in range(first, min(rows, first + PREFILL_ROWS))
            )
            runner.step(StepBatch(prefill))
        times = []
        for step in range(steps):
            batch = StepBatch(
                tuple(
                    StepRow(slot, ((slot * 7 + step) % 40000 + 50,), context + step, True, greedy)
                    for slot in range(rows)
                )
            )
            begin = time.perf_counter()
            runner.step(batch)
            times.append((time.perf_counter() - begin) * 1000)
        for slot in range(rows):
            runner.release(slot)
        print(json.dumps({"step_ms": times}), flush=True)


# --------------------------------------------------------------------------- driver


class Worker:
    def __init__(self, checkout: Path, config: str, args: argparse.Namespace) -> None:
        dtype, quantization = config.split(":")
        self.process = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                dtype,
                quantization,
                str(max(args.batches)),
                str(args.context + args.steps + 1),
                str(args.threads),
            ],
            cwd=checkout,
            env={**os.environ, "PYTHONPATH": str(checkout)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.info = self._read()

    def _read(self) -> dict:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.process.wait()}")
        return json.loads(line)

    def run(self, rows: int, steps: int, context: int) -> list[float]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"rows": rows, "steps": steps, "context": context}))
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        return self._read()["step_ms"]

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the checkout to compare with")
    parser.add_argument("--configs", default="bfloat16:none", help="dtype:quantization,...")
    parser.add_argument(
        "--base-quantization", default=None, help="the base's quantization (default: the same)"
    )
    parser.add_argument("--batches", default="1,16,64", help="decode rows per step")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--context", type=int, default=64, help="prompt tokens per row")
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads per worker (1 is robust on a crowded machine: no OpenMP barriers)",
    )
    parser.add_argument("--out", type=Path, default=HERE / "out" / "bench_model_ab.json")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "load": os.getloadavg()}
    for config in args.configs.split(","):
        base_config = config
        if args.base_quantization is not None:
            base_config = f"{config.split(':')[0]}:{args.base_quantization}"
        workers = {
            "this": Worker(HERE, config, args),
            "base": Worker(args.base, base_config, args),
        }
        times: dict[str, dict[int, list[float]]] = {
            name: {rows: [] for rows in args.batches} for name in workers
        }
        for round_index in range(args.rounds):
            order = list(workers) if round_index % 2 == 0 else list(reversed(workers))
            for rows in args.batches:
                for name in order:
                    step_ms = workers[name].run(rows, args.steps, args.context)
                    times[name][rows].append(statistics.median(step_ms[2:]))
        result = {
            "info": {name: w.info for name, w in workers.items()},
            "base_config": base_config,
            "median_step_ms": {},
        }
        for rows in args.batches:
            this, base = (statistics.median(times[n][rows]) for n in ("this", "base"))
            result["median_step_ms"][rows] = {
                "this": round(this, 2),
                "base": round(base, 2),
                "this_over_base": round(this / base, 3),
                "rounds_this": [round(t, 2) for t in times["this"][rows]],
                "rounds_base": [round(t, 2) for t in times["base"][rows]],
            }
        for w in workers.values():
            w.close()
        report[config] = result
        print(json.dumps({config: result}, indent=1), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.path.insert(0, os.getcwd())
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    else:
        main()
