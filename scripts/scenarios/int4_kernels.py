"""Every projection of one SmolLM2 step in three weight formats (bf16 packed, int8, int4), on
the CPU: the weights and the timing loop of ``scripts/bench_int4.py`` (its docstring says what is
compared and how)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from app.models.checkpoints.gguf_file import GGUFFile
from app.models.checkpoints.model_tensors import ModelTensors
from app.models.load.smollm2 import smollm2_gguf_path
from app.models.weights.int4 import Int4Linear
from app.models.weights.int8 import Int8Linear
from app.models.weights.projections import LinearKernel, PackedLinear

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
