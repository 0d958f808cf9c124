"""The GGUF-block kernels of this checkout against another checkout's, call by call in one
process: what resolves a 3-5% change of a kernel on a shared, noisy machine, where served runs
move by 1.3-1.5x between rounds (docs/MODEL_PERF.md, twenty-fifth session).

    python scripts/bench_kernels_ab.py --base /tmp/wt0                      # SmolLM2's shapes
    python scripts/bench_kernels_ab.py --base /tmp/wt0 --isa avx2 --rows 64,128,896 \\
        --shapes Q4_1:3072x576,Q4_K:2048x2048

Both checkouts' ``app/models/kernels`` are built with this checkout's build (``build.py``: the
machine's compiler, cached by a hash of the sources) and loaded side by side. For each shape
(``TYPE:NxK``: N weight rows of K weights, random blocks with fp16 scales in 1e-3..2e-2,
interleaved eight rows at a time as a load repacks them) and activation row count, both
libraries compute the same bfloat16 rows; their outputs must be the same bits; then
``--rounds`` rounds each time ``--calls`` calls of each library, the order alternating. Reports
the median microseconds of a call per library and new / base. ``--isa`` forces an instruction
set (both must be ones the CPU has); ``--threads`` sets torch's (the kernels' OpenMP team).

Writes ``--json`` (default ``out/bench_kernels_ab.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.models.kernels import ggml_quant  # noqa: E402
from app.models.kernels.build import build_library  # noqa: E402

# SmolLM2's projections (fused qkv, o, fused gate_up, down) and its LM head
SMOLLM2_SHAPES = "Q4_1:960x576,Q4_1:576x576,Q4_1:3072x576,Q4_1:576x1536,Q8_0:49152x576"
# byte offsets of a block's fp16 scales (d, and dmin or m where the format has one): random
# bytes there could be NaN, inf or huge (the kernel tests take random_blocks from here too)
SCALE_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(kind: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """uint8 ``[rows, bytes per row]`` of ``kind``: random codes, fp16 scales in 1e-3..2e-2."""
    rng = np.random.default_rng(seed)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, (rows, columns // block_size, block_bytes), dtype=np.uint8)
    for offset in SCALE_FIELDS[kind]:
        scales = rng.uniform(1e-3, 2e-2, (rows, columns // block_size)).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(*scales.shape, 2)
    return blocks.reshape(rows, -1)


def load(source_dir: Path, isa: ggml_quant.Isa) -> ggml_quant.GGMLKernels:
    """The kernels built from ``source_dir`` (this checkout's build and declarations; of this
    checkout's source files, those that ``source_dir`` has: a base before a new file).

    Raises:
        KernelBuildError: the build failed; SystemExit: the CPU lacks ``isa``.
    """
    sources = tuple(name for name in ggml_quant.SOURCES if (source_dir / name).exists())
    library, path, threaded = build_library("ggml_quant", source_dir, sources, ggml_quant.CFLAGS)
    ggml_quant.declare(library)
    kernels = ggml_quant.GGMLKernels(library, path, isa, threaded, True)
    if not kernels.supports(isa):
        raise SystemExit(f"this CPU has no {isa.name}")
    return kernels


def segment_for(kernels: ggml_quant.GGMLKernels, kind: str, rows: int, columns: int):
    """A random matrix as a load would hold it (interleaved where the format has x8)."""
    blocks = random_blocks(kind, rows, columns, seed=rows + columns)
    if not kernels.interleaves(kind, rows):
        return ggml_quant.QuantSegment(kind, torch.from_numpy(blocks))
    out = np.empty_like(blocks)
    kernels.repack8(kind, blocks, out)
    return ggml_quant.QuantSegment(kind, torch.from_numpy(out), interleaved=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the other checkout's root")
    parser.add_argument("--shapes", default=SMOLLM2_SHAPES, help="TYPE:NxK,...")
    parser.add_argument("--rows", default="1,16,64", help="activation row counts")
    parser.add_argument("--isa", choices=["avx2", "avx512"], default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("out/bench_kernels_ab.json"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    native, _ = ggml_quant.load_ggml_quant()
    if native is None:
        raise SystemExit("the GGUF-block kernels do not build here")
    isa = ggml_quant.Isa[args.isa.upper()] if args.isa else native.isa
    libraries = {
        "new": load(ROOT / "app/models/kernels", isa),
        "base": load(args.base / "app/models/kernels", isa),
    }
    report: dict[str, object] = {"base": str(args.base), "isa": isa.name, "shapes": {}}
    for shape in args.shapes.split(","):
        kind, size = shape.split(":")
        n, k = (int(part) for part in size.split("x"))
        # each build repacks the same blocks itself (a change may change the x8 layout)
        prepared = {
            name: kernels.prepare((segment_for(kernels, kind, n, k),))
            for name, kernels in libraries.items()
        }
        lines = {}
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            x = x.to(torch.bfloat16)
            outputs = {
                name: kernels.matmul(prepared[name], x, isa=isa)
                for name, kernels in libraries.items()
            }
            if not torch.equal(outputs["new"], outputs["base"]):
                raise SystemExit(f"{shape}, {rows} rows: the two builds' outputs differ")
            times: dict[str, list[float]] = {"new": [], "base": []}
            for round_index in range(args.rounds):
                order = ("new", "base") if round_index % 2 else ("base", "new")
                for name in order:
                    started = time.perf_counter()
                    for _ in range(args.calls):
                        libraries[name].matmul(prepared[name], x, isa=isa)
                    times[name].append((time.perf_counter() - started) / args.calls * 1e6)
            new_us, base_us = statistics.median(times["new"]), statistics.median(times["base"])
            lines[str(rows)] = {
                "new_us": round(new_us, 1),
                "base_us": round(base_us, 1),
                "new_over_base": round(new_us / base_us, 3),
            }
            print(
                f"{shape:>18} {rows:>5} rows: new {new_us:9.1f} us, base {base_us:9.1f} us,"
                f" new/base {new_us / base_us:.3f}",
                flush=True,
            )
        report["shapes"][shape] = lines  # type: ignore[index]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
