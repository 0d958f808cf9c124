"""Qwen3 (dense): Llama's block with a per-head RMSNorm of queries and keys before rope, and a
``head_dim`` of its own (128 in every released size, not ``hidden / heads``).

The q/k norm runs inside the fused decode kernel (``fused_decode_attention.c``) as well as on
the eager path. GGUF Q/K rows are not permuted. The sliding window is on only with
``use_sliding_window: true``.
"""

from __future__ import annotations

from app.models.architectures.spec import Architecture

QWEN3 = Architecture(
    name="qwen3",
    hf_model_types=("qwen3",),
    gguf_architectures=("qwen3",),
    qk_norm=True,
    sliding_window_switch="use_sliding_window",
)
