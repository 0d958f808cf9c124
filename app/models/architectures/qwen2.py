"""Qwen2 and Qwen2.5: Llama's block with biases on the Q, K and V projections.

The biases live in the fused QKV projection (so the fused decode kernels serve it unchanged).
GGUF Q/K rows are not permuted (llama.cpp runs qwen2 with its split-half "NEOX" rope). The
sliding window is on only with ``use_sliding_window: true``.
"""

from __future__ import annotations

from app.models.architectures.spec import Architecture

QWEN2 = Architecture(
    name="qwen2",
    hf_model_types=("qwen2",),
    gguf_architectures=("qwen2",),
    qkv_bias=True,
    sliding_window_switch="use_sliding_window",
)
