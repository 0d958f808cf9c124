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
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.models.gguf_file import GGUFFile  # noqa: E402
from app.models.int4 import Int4Linear  # noqa: E402
from app.models.int8 import Int8Linear  # noqa: E402
from app.models.model_tensors import ModelTensors  # noqa: E402
from app.models.projections import LinearKernel, PackedLinear  # noqa: E402
from app.models.smollm2 import smollm2_gguf_path  # noqa: E402

PROJECTIONS = (
    ("attn_q", "attn_k", "attn_v"),
    ("attn_output",),
    ("ffn_gate", "ffn_up"),
    ("ffn_down",),
)


def load(layers: int) -> dict[str, list[tuple[Callable[[torch.Tensor], torch.Tensor], int]]]:
    """Per kernel name, ``(projection, in_features)`` for every matrix of ``layers`` layers."""
    file = GGUFFile(smollm2_gguf_path())
    architecture = file.architecture()
    tensors = ModelTensors(file, architecture, file.hparams(architecture))
    kernels: dict[str, list[tuple[Callable[[torch.Tensor], torch.Tensor], int]]] = {
        "bf16": [],
        "int8": [],
        "int4": [],
    }
    for i in range(layers):
        for group in PROJECTIONS:
            parts = [tensors.q4_codes(name, i) for name in group]
            weight = torch.cat([torch.from_numpy(p.dequantize()) for p in parts])
            in_features = weight.shape[1]
            kernels["bf16"].append(
                (PackedLinear.pack(weight.to(torch.bfloat16)).__call__, in_features)
            )
            int8 = Int8Linear.quantize(weight, torch.bfloat16, LinearKernel.DENSE)
            kernels["int8"].append(
                (
                    lambda x, q=int8.qweight, s=int8.scales: torch.ops.aten._weight_int8pack_mm(
                        x, q, s
                    ),
                    in_features,
                )
            )
            int4 = Int4Linear.from_codes(parts)
            kernels["int4"].append((int4.int4.__call__, in_features))
    return kernels


def time_steps(
    projections: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]],
    inputs: dict[int, torch.Tensor],
    steps: int,
) -> float:
    """Seconds per step: every projection once, ``steps`` times."""
    start = time.perf_counter()
    for _ in range(steps):
        for projection, in_features in projections:
            projection(inputs[in_features])
    return (time.perf_counter() - start) / steps


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
