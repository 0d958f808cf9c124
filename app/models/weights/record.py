"""The weight record the shared forward consumes, the same for every architecture.

An architecture differs from another only in what its file holds (:mod:`app.models.
architectures`); by the time weights reach :class:`LayerWeights` those differences are data: a
bias inside the QKV projection (Qwen2), a ``qk_norm`` tensor (Qwen3), un-permuted Q/K rows
(llama GGUFs). :func:`app.models.weights.build.load_weights` builds the record.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from app.models.weights.embeddings import Embedding
from app.models.weights.projections import LinearKernel, Projection

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Quantization(Enum):
    """How the projection matrices (and the LM head) are stored (``--quantization``; ``auto``
    is resolved to one of these by :func:`app.models.loading.resolve_quantization`).

    NONE: dense in the model dtype (oneDNN-packed for bfloat16 on the CPU).
    INT8: weight-only int8, re-quantised at load (:mod:`app.models.weights.int8`).
    INT4: the GGUF's own Q4_0/Q4_1 codes in torch's CPU int4 kernel
        (:mod:`app.models.weights.int4`), an int8 LM head.
    GGUF: the GGUF file's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) in the
        C kernels of :mod:`app.models.kernels.ggml_quant` (:mod:`app.models.weights.ggml`),
        the LM head and a tied embedding too; a projection stored in another type is dense.
    """

    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"
    GGUF = "gguf"


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """A layer's mixture of experts (:class:`app.models.hparams.Experts`).

    Attributes:
        router: ``[experts, hidden]`` model dtype, the router's matrix (``ffn_norm`` applied to
            its input apart, as to the experts').
        gate_up: per expert, gate and up stacked, ``[2 * ffn, hidden]``.
        down: per expert, ``[hidden, ffn]``.
    """

    router: torch.Tensor
    gate_up: tuple[Projection, ...]
    down: tuple[Projection, ...]


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One transformer block. Matrices are ``[out_features, in_features]``.

    Attributes:
        qkv: Q, K and V projections stacked (and their biases, if any), ``attn_norm``'s weight
            folded into their input columns: ``[(n_heads + 2 * n_kv_heads) * head_dim, hidden]``.
        attn_output: ``[hidden, n_heads * head_dim]``.
        gate_up: gate and up projections stacked, ``ffn_norm``'s weight folded in:
            ``[2 * ffn, hidden]``.
        down: ``[hidden, ffn]``.
        attn_norm, ffn_norm: ``[hidden]`` model dtype, the RMSNorm weights when they could not
            be folded (int4: a per-column factor would break the 32-column groups of the
            codes); None when folded.
        qk_norm: ``[n_heads + n_kv_heads, head_dim]`` model dtype, the per-head RMSNorm weight
            of every query head then every key head (Qwen3: ``q_norm`` repeated ``n_heads``
            times, ``k_norm`` ``n_kv_heads`` times); None when the architecture has none.
        attn_post_norm, ffn_post_norm: ``[hidden]`` model dtype, the RMSNorm weights of the
            attention output and of the MLP output before their residual adds (Gemma); None
            when the architecture has none.
        experts: the mixture of experts in place of the MLP (``gate_up`` and ``down`` None,
            ``ffn_norm`` set), or None.
    """

    qkv: Projection
    attn_output: Projection
    gate_up: Projection | None
    down: Projection | None
    attn_norm: torch.Tensor | None = None
    ffn_norm: torch.Tensor | None = None
    qk_norm: torch.Tensor | None = None
    attn_post_norm: torch.Tensor | None = None
    ffn_post_norm: torch.Tensor | None = None
    experts: ExpertWeights | None = None


@dataclass(frozen=True, slots=True)
class ModelWeights:
    """All weights of one model.

    Attributes:
        embedding: the token lookup.
        lm_head: the output projection (tied: the embedding's matrix; see
            :func:`app.models.weights.build.load_weights` for which tensor each shares).
        layers: one record per block.
        output_norm: ``[hidden]``, the final RMSNorm's weight (not folded: the LM head may be
            tied to the embedding).
        kernel: how the dense projections are computed.
        quantization: how the projections are stored.
        dense_projections: gguf: "name (type)" of each matrix whose projection stayed dense
            (a type the GGUF-block kernels do not compute); empty otherwise.
    """

    embedding: Embedding
    lm_head: Projection
    layers: tuple[LayerWeights, ...]
    output_norm: torch.Tensor
    kernel: LinearKernel
    quantization: Quantization
    dense_projections: tuple[str, ...] = ()
