"""A compact Llama forward in torch, with a per-slot KV cache, for batched serving.

One call to :meth:`LlamaModel.forward` computes one scheduler step for every row at once. The
tokens of all rows are *packed* into one sequence of ``N`` tokens (no padding), so every matmul
(fused QKV, output projection, fused gate/up, down, LM head) runs once over all of them.
Only attention depends on which slot a token belongs to; it runs in groups planned by
:class:`ForwardPlan`:

* **single-token rows** (decode steps, and one-token prompts) in *one* SDPA call, however
  different their lengths: the slots ``[slot_start, slot_stop)`` spanned by those rows are read
  as a view of the cache (no copy), padded to the longest length, with a mask that
  hides each slot's positions ``>= its length`` (and every position of a slot in the span that
  has no row this step), so stale cache content is never attended to;
* **each multi-token row** (a prompt chunk) in its own SDPA call with a causal mask offset by
  the row's start position. Padding would make every row as long as the longest chunk, in
  the matmuls as well as in attention. Measured (bfloat16, 2-core CPU): 15 decode rows plus
  one 128-token chunk take 228 ms packed as here; a forward over 16 rows of 128 tokens, the
  least that padding would cost, takes 622 ms.

Grouped-query attention is computed without repeating K/V: for prompt chunks SDPA's
``enable_gqa`` maps query head ``h`` to KV head ``h // group_size``; for decode rows the
``group_size`` query heads that share a KV head are folded into the query-length axis when
torch runs more than one thread or the step has a seeded row (see :class:`DecodeGroup`).

Few kernels per layer (on a 2-core CPU a decode step of one row is mostly per-op overhead, see
``docs/MODEL_PERF.md``):

* the RMSNorm weights of ``attn_norm`` and ``ffn_norm`` are folded into the input columns of the
  fused QKV and gate/up matrices at load (``W @ (g * x) == (W * g) @ x``), so the normalisation
  is a per-token scale, ``x * (1 / rms(x))``: four small ops instead of ``F.rms_norm``'s eight;
* the residual adds are fused into the output and down projections (:meth:`Linear.add_to`).

Weights come from :mod:`app.models.gguf_file` in Hugging Face layout (Q/K un-permuted), so the
rope here is Hugging Face's ``rotate_half`` form. The LM head is tied to the embedding.
How a projection is computed is chosen once, at load, by :func:`select_linear_kernel`.
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from app.models.fused_decode import (
    FusedDecodeKernels,
    check_attention_shapes,
    load_fused_decode,
)
from app.models.gguf_file import GGUFFile, LlamaHParams, map_q8_0_rows, read_llama_tensor
from app.models.int4 import Int4Linear, int4_kernel_status

logger = logging.getLogger(__name__)

Q8_0_TYPE = gguf.GGMLQuantizationType.Q8_0

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Quantization(Enum):
    """How the projection matrices (and the LM head) are stored."""

    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"  # the GGUF's own Q4_1 codes, torch's CPU int4 kernel (app.models.int4)


class LinearKernel(Enum):
    """How a dense (unquantised) projection is computed.

    DENSE: ``F.linear`` on a plain ``[out, in]`` weight; any device, any dtype.
    ONEDNN: bfloat16 on a CPU with oneDNN: the weight is reordered once, at load, into oneDNN's
        blocked layout (``mkldnn._reorder_linear_weight``) and multiplied with
        ``mkldnn._linear_pointwise``. ``F.linear`` reorders a bfloat16 weight on every call;
        measured on the 2-core CPU, the packed weight is ~1.5x faster at 1 row and ~1.3x at 64.
    """

    DENSE = "dense"
    ONEDNN = "onednn"


# Row counts up to which the int8 kernel is used (weight-only int8, one byte per weight, read
# once per step). Above it the int8 model computes with bfloat16 copies of the same quantised
# weights: the int8 kernel is a GEMV at heart and loses to bfloat16 GEMM from 2-4 rows on
# (docs/MODEL_PERF.md).
INT8_MAX_ROWS = 2

# Batch invariance (API.md: a seeded request gets the same tokens whatever else is in the batch).
# Measured on the 2-core CPU (torch 2.13, docs/MODEL_PERF.md, "Batch invariance"):
# * a bfloat16 matmul (oneDNN, packed or not, with or without the fused add) computes each row of
#   a call of at most 32 rows exactly as it computes that row alone; from 33 rows on, some rows
#   come out one rounding different. ``EXACT_ROWS_ONEDNN_BF16`` rows per call keep a row exact.
# * SDPA's CPU kernel gives a query row the same result whatever the batch and however long the
#   padded key axis, *provided* the key axis is a multiple of 16: a row whose real keys end in a
#   partial vector of 16 is reduced differently. Key lengths are padded to ``KEY_ALIGN`` (16:
#   AVX-512's float32 lanes, a multiple of AVX2's 8), which makes prefill chunk boundaries
#   invisible too and gives a one-token row the same result as the same position inside a
#   prompt chunk.
EXACT_ROWS_ONEDNN_BF16 = 32
KEY_ALIGN = 16


def align_keys(length: int) -> int:
    """``length`` (positions) rounded up to a multiple of ``KEY_ALIGN``."""
    return -(-length // KEY_ALIGN) * KEY_ALIGN


def exact_rows_per_call(device: torch.device, dtype: torch.dtype) -> int:
    """Most rows one dense matmul call may hold so that every row's result equals the result
    of that row alone: 32 for bfloat16 on the CPU (measured), else 1 (float32 on the CPU takes
    a GEMV for one row and a GEMM, with other roundings, for more; other devices unmeasured)."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        return EXACT_ROWS_ONEDNN_BF16
    return 1


def select_linear_kernel(device: torch.device, dtype: torch.dtype) -> tuple[LinearKernel, str]:
    """The fastest dense projection kernel that works here, and why (rule R14)."""
    if device.type != "cpu":
        return LinearKernel.DENSE, f"F.linear on {device.type}"
    if dtype != torch.bfloat16:
        return LinearKernel.DENSE, f"F.linear: oneDNN packing is used for bfloat16 only ({dtype})"
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return LinearKernel.DENSE, "F.linear: this CPU or torch build has no oneDNN bfloat16"
    try:
        probe = torch.ones(8, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(probe)
        result = torch.ops.mkldnn._linear_pointwise(probe[:1], packed, None, "none", [], "")
        if result.shape != (1, 8) or result.float()[0, 0].item() != 16.0:
            return LinearKernel.DENSE, "F.linear: oneDNN packed matmul gave a wrong probe result"
    except RuntimeError as error:
        return LinearKernel.DENSE, f"F.linear: oneDNN packed matmul unavailable ({error})"
    return LinearKernel.ONEDNN, "oneDNN packed bfloat16 weights"


@dataclass(frozen=True, slots=True)
class DenseLinear:
    """``y = x @ weight.T`` with ``weight [out, in]`` in the model dtype.

    ``exact_rows``: see :func:`exact_rows_per_call`."""

    weight: torch.Tensor
    exact_rows: int = 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x @ weight.T`` in one kernel; ``residual`` is not modified."""
        return torch.addmm(residual, x, self.weight.t())


@dataclass(frozen=True, slots=True)
class PackedLinear:
    """``y = x @ weight.T`` with the weight in oneDNN's blocked layout (see ``LinearKernel``).

    ``packed`` is an opaque ``torch._mkldnn`` tensor; ``x`` must be contiguous.
    """

    packed: torch.Tensor
    exact_rows = EXACT_ROWS_ONEDNN_BF16

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedLinear:
        return cls(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x @ weight.T``, the add fused into the matmul's epilogue."""
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, None, "add")


WideLinear = DenseLinear | PackedLinear


@dataclass(frozen=True, slots=True)
class Int8Linear:
    """Weight-only int8: ``weight ~= qweight * scales[:, None]`` (symmetric, per output row).

    ``x [M, in]`` with ``M <= INT8_MAX_ROWS`` goes through ``aten._weight_int8pack_mm``
    (bfloat16 activations); larger ``M`` through ``wide``, a bfloat16 projection of the same
    int8 values times the same scales, so every path computes with the same weights (up to
    bfloat16 rounding of their products) and only the kernel changes with the batch size.
    (Power-of-two scales would make those products exact, but they cost accuracy: greedy
    agreement with float32 93.2% instead of 95.6%; and a bfloat16 model is not batch-invariant
    anyway, see docs/MODEL_PERF.md.)
    """

    qweight: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # [out], model dtype
    wide: WideLinear
    # The int8 kernel computes a row the same in calls of 1..8 rows (measured), so rows that
    # must be batch-invariant always take it, in calls of at most INT8_MAX_ROWS.
    exact_rows = INT8_MAX_ROWS

    @classmethod
    def quantize(
        cls, weight: torch.Tensor, dtype: torch.dtype, kernel: LinearKernel = LinearKernel.DENSE
    ) -> Int8Linear:
        """Quantise a float32 ``weight [out, in]``; scales are rounded to ``dtype`` first."""
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(dtype)
        qweight = torch.round(weight / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        dequantized = (qweight.float() * scales.float()[:, None]).to(dtype)
        return cls(qweight.contiguous(), scales.contiguous(), _wide_linear(dequantized, kernel))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= INT8_MAX_ROWS:
            return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
        return self.wide(x)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x @ weight.T``; ``residual`` is not modified."""
        if x.shape[0] <= INT8_MAX_ROWS:
            return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales).add_(residual)
        return self.wide.add_to(residual, x)


Linear = DenseLinear | PackedLinear | Int8Linear | Int4Linear


def _wide_linear(weight: torch.Tensor, kernel: LinearKernel) -> WideLinear:
    """A dense projection of ``weight`` (already in the model dtype and on its device)."""
    if kernel is LinearKernel.ONEDNN:
        return PackedLinear.pack(weight)
    return DenseLinear(weight.contiguous(), exact_rows_per_call(weight.device, weight.dtype))


@dataclass(frozen=True, slots=True)
class DenseEmbedding:
    """Token lookup in ``weight [vocab, hidden]`` (model dtype)."""

    weight: torch.Tensor

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


@dataclass(frozen=True, slots=True)
class Int8Embedding:
    """Token lookup in the int8 LM head (the embedding is tied to it): ``qweight[id] *
    scales[id]``, so an int8 model keeps no second copy of the 49k x 576 matrix."""

    qweight: torch.Tensor  # int8 [vocab, hidden]
    scales: torch.Tensor  # [vocab], model dtype

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(token_ids, self.qweight).to(self.scales.dtype)
        return rows.mul_(self.scales[token_ids, None])


@dataclass(frozen=True, slots=True)
class Q8_0Embedding:
    """Token lookup in the GGUF's own Q8_0 rows, read through a memory map of the file
    (:func:`app.models.gguf_file.map_q8_0_rows`), for a model whose LM head is packed for oneDNN
    and so cannot serve lookups. No second 49k x 576 matrix is kept in memory; the pages of the
    rows looked up become file cache (at most the tensor's 30 MiB, shared and reclaimable).

    The rows are decoded by ``gguf.quants.dequantize``, as at load: ``d * q`` in float32, exact
    (an fp16 scale times an integer of at most 8 bits fits float32's 24-bit mantissa), then
    rounded to ``dtype``: the very numbers of the dense matrix the LM head was packed from. CPU
    only.
    """

    blocks: np.ndarray  # uint8 [vocab, hidden // 32, 34], memory-mapped
    dtype: torch.dtype

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[N]`` int64 ids -> ``[N, hidden]`` rows in ``dtype``."""
        rows = self.blocks[token_ids.numpy()]  # a copy: [N, blocks, 34]
        values = gguf.quants.dequantize(rows.reshape(len(rows), -1), Q8_0_TYPE)
        return torch.from_numpy(values).to(self.dtype)


Embedding = DenseEmbedding | Int8Embedding | Q8_0Embedding


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One transformer block. Matrices are ``[out_features, in_features]``.

    Attributes:
        qkv: Q, K and V projections stacked, ``attn_norm``'s weight folded into their input
            columns: ``[(n_heads + 2 * n_kv_heads) * head_dim, hidden]``.
        attn_output: ``[hidden, n_heads * head_dim]``.
        gate_up: gate and up projections stacked, ``ffn_norm``'s weight folded in:
            ``[2 * ffn, hidden]``.
        down: ``[hidden, ffn]``.
        attn_norm, ffn_norm: ``[hidden]`` model dtype, the RMSNorm weights when they could not
            be folded (int4: a per-column factor would break the 32-column groups of the
            codes); None when folded.
    """

    qkv: Linear
    attn_output: Linear
    gate_up: Linear
    down: Linear
    attn_norm: torch.Tensor | None = None
    ffn_norm: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class LlamaWeights:
    """All weights of the model.

    Attributes:
        embedding: the token lookup.
        lm_head: the same matrix as a projection (tied: packed for oneDNN, the lookup
            reading the file's Q8_0 rows; else the very tensor the lookup reads; with int8 or
            int4, the int8 matrix the lookup reads too).
        output_norm: ``[hidden]``, the final RMSNorm's weight (not folded: the LM head is tied).
        kernel: how the dense projections are computed.
    """

    embedding: Embedding
    lm_head: Linear
    layers: tuple[LayerWeights, ...]
    output_norm: torch.Tensor
    kernel: LinearKernel
    quantization: Quantization

    @classmethod
    def from_gguf(
        cls,
        file: GGUFFile,
        hparams: LlamaHParams,
        *,
        dtype: torch.dtype,
        device: torch.device,
        quantization: Quantization = Quantization.NONE,
        kernel: LinearKernel = LinearKernel.DENSE,
    ) -> LlamaWeights:
        """Dequantise every tensor to float32, fuse QKV and gate/up, fold the norms, then cast
        (or quantise to int8), pack for ``kernel`` and move.

        Raises:
            ValueError: the file has an untied ``output.weight``, int8 without bfloat16, or
                ``kernel`` ONEDNN off the CPU or without bfloat16.
        """
        if not hparams.tied_embeddings:
            raise ValueError("only tied embeddings (no output.weight) are supported")
        if quantization is not Quantization.NONE and dtype != torch.bfloat16:
            raise ValueError(
                f"{quantization.value} weights need dtype bfloat16 (the kernel's activations)"
            )
        if quantization is Quantization.INT4:
            available, reason = int4_kernel_status()
            if device.type != "cpu" or not available:
                raise ValueError(f"int4 needs torch's CPU int4 kernel: {reason} on {device}")
        if kernel is LinearKernel.ONEDNN and (device.type != "cpu" or dtype != torch.bfloat16):
            raise ValueError("the oneDNN packed kernel needs bfloat16 on the CPU")

        def read(*names: str) -> torch.Tensor:
            arrays = [read_llama_tensor(file, name, hparams) for name in names]
            return torch.from_numpy(arrays[0] if len(arrays) == 1 else np.concatenate(arrays))

        def linear(weight: torch.Tensor) -> Linear:
            if quantization is Quantization.INT8:
                return Int8Linear.quantize(weight.to(device), dtype, kernel)
            return _wide_linear(weight.to(device=device, dtype=dtype), kernel)

        def normed_linear(norm: str, *names: str) -> Linear:
            return linear(read(*names) * read(norm)[None, :])

        if quantization is Quantization.INT4:
            layers = tuple(
                _int4_layer(file, hparams, i, dtype, kernel) for i in range(hparams.block_count)
            )
        else:
            layers = tuple(
                LayerWeights(
                    qkv=normed_linear(
                        f"blk.{i}.attn_norm.weight",
                        f"blk.{i}.attn_q.weight",
                        f"blk.{i}.attn_k.weight",
                        f"blk.{i}.attn_v.weight",
                    ),
                    attn_output=linear(read(f"blk.{i}.attn_output.weight")),
                    gate_up=normed_linear(
                        f"blk.{i}.ffn_norm.weight",
                        f"blk.{i}.ffn_gate.weight",
                        f"blk.{i}.ffn_up.weight",
                    ),
                    down=linear(read(f"blk.{i}.ffn_down.weight")),
                )
                for i in range(hparams.block_count)
            )
        embedding_f32 = read("token_embd.weight")
        embedding: Embedding
        lm_head: Linear
        if quantization is not Quantization.NONE:  # int4 too: the LM head is Q8_0 in the file
            lm_head = Int8Linear.quantize(embedding_f32.to(device), dtype, kernel)
            embedding = Int8Embedding(lm_head.qweight, lm_head.scales)
        else:
            dense = embedding_f32.to(device=device, dtype=dtype).contiguous()
            rows = _q8_0_rows_or_none(file, "token_embd.weight")
            if kernel is LinearKernel.ONEDNN and rows is not None:
                # Packed (F.linear reorders the 54 MiB matrix on every call: 1.2-2x slower);
                # lookups then read the file's Q8_0 rows, the same values (docs/MODEL_PERF.md).
                lm_head = PackedLinear.pack(dense)
                embedding = Q8_0Embedding(rows, dtype)
            else:  # tied to the very tensor
                embedding = DenseEmbedding(dense)
                lm_head = DenseLinear(dense, exact_rows_per_call(dense.device, dense.dtype))
            del dense
        return cls(
            embedding=embedding,
            lm_head=lm_head,
            layers=layers,
            output_norm=read("output_norm.weight").to(device=device, dtype=dtype).contiguous(),
            kernel=kernel,
            quantization=quantization,
        )


def _q8_0_rows_or_none(file: GGUFFile, name: str) -> np.ndarray | None:
    """:func:`map_q8_0_rows`, or None when the tensor is stored in another type."""
    try:
        return map_q8_0_rows(file, name)
    except ValueError:
        return None


def _int4_layer(
    file: GGUFFile, hparams: LlamaHParams, index: int, dtype: torch.dtype, kernel: LinearKernel
) -> LayerWeights:
    """Layer ``index`` with Q4_1 int4 projections and its RMSNorm weights kept apart."""

    def int4(*names: str) -> Int4Linear:
        return Int4Linear.from_gguf(
            file, hparams, [f"blk.{index}.{n}.weight" for n in names], kernel=kernel
        )

    def norm(name: str) -> torch.Tensor:
        weight = read_llama_tensor(file, f"blk.{index}.{name}.weight", hparams)
        return torch.from_numpy(weight).to(dtype).contiguous()

    return LayerWeights(
        qkv=int4("attn_q", "attn_k", "attn_v"),
        attn_output=int4("attn_output"),
        gate_up=int4("ffn_gate", "ffn_up"),
        down=int4("ffn_down"),
        attn_norm=norm("attn_norm"),
        ffn_norm=norm("ffn_norm"),
    )


def _lazily_zeroed(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A zero tensor whose memory, on the CPU, is a private anonymous mapping: the OS hands out
    zeroed pages on first touch, so the resident memory of a KV cache grows with the positions
    actually written rather than with ``max_model_len`` at start-up. Huge pages are declined
    (``MADV_NOHUGEPAGE``): one 2 MiB page would make a whole stretch of other slots resident
    as soon as one of them writes its first position."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = max(1, numel * torch.empty((), dtype=dtype).element_size())
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive
    return raw[: nbytes if numel else 0].view(dtype).view(shape)


class KVCache:
    """Keys and values of every slot, preallocated once.

    ``keys`` and ``values`` are ``[num_layers, max_num_seqs, n_kv_heads, align_keys(max_model_len),
    head_dim]`` tensors of the model dtype on the model device, so one slot's one head is a
    contiguous ``[max_model_len, head_dim]`` block (what attention reads). Bytes per slot:
    ``2 * num_layers * n_kv_heads * max_model_len * head_dim * itemsize`` (SmolLM2, 2048
    positions: 90 MiB in float32, 45 MiB in bfloat16).

    The cache stores tensors only: which positions of a slot are valid is the runner's
    bookkeeping, passed in through :class:`ForwardPlan`. It is zero at allocation (lazily, on
    the CPU: see :func:`_lazily_zeroed`) and never cleared again: a masked-out position gets
    attention weight 0, but ``0 * NaN`` would still be NaN, so never-written memory must hold
    finite values; stale values from a previous occupant are finite and are masked out.
    """

    def __init__(
        self,
        hparams: LlamaHParams,
        *,
        max_num_seqs: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (
            hparams.block_count,
            max_num_seqs,
            hparams.head_count_kv,
            align_keys(max_model_len),  # attention reads whole KEY_ALIGN blocks
            hparams.head_dim,
        )
        self.keys = _lazily_zeroed(shape, dtype, device)
        self.values = _lazily_zeroed(shape, dtype, device)

    @property
    def bytes_per_slot(self) -> int:
        return 2 * self.keys[:, 0].numel() * self.keys.element_size()

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_slot * self.keys.shape[1]

    def write_index(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows of a layer's ``[slots * heads * positions, head_dim]`` view for ``[N]`` tokens.

        Returns ``[N * n_kv_heads]`` int64, token-major (the order of ``keys.reshape(-1, D)``
        for keys ``[N, n_kv_heads, D]``).
        """
        _, _, kv_heads, max_len, _ = self.keys.shape
        heads = torch.arange(kv_heads, device=slots.device)
        return (
            (slots[:, None] * kv_heads + heads[None, :]) * max_len + positions[:, None]
        ).flatten()

    def write(
        self, layer: int, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store ``keys``/``values [N, n_kv_heads, D]`` at the rows :meth:`write_index` gave."""
        head_dim = self.keys.shape[-1]
        self.keys[layer].view(-1, head_dim).index_copy_(0, index, keys.reshape(-1, head_dim))
        self.values[layer].view(-1, head_dim).index_copy_(0, index, values.reshape(-1, head_dim))


@dataclass(frozen=True, slots=True)
class RowSpec:
    """What the forward needs to know about one row (a slot's new tokens this step)."""

    slot: int
    token_ids: Sequence[int]
    position: int
    want_logits: bool
    # True: compute this row exactly as it would be computed in any other batch (a seeded
    # request, API.md); costs extra matmul calls once a step has more rows than a call may hold
    # exactly (see exact_rows_per_call).
    batch_invariant: bool = False


@dataclass(frozen=True, slots=True)
class PrefillGroup:
    """Attention work of one multi-token row: packed tokens ``[start, stop)`` of ``slot``.

    ``mask`` is ``[1, 1, T, key_length]``, additive (see :func:`_additive_mask`): query ``i``
    sees keys ``<= position + i``; ``key_length`` is ``position + T`` padded to ``KEY_ALIGN``
    (SDPA's own ``is_causal`` would tie the result to the chunk's length).
    """

    slot: int
    start: int
    stop: int
    key_length: int
    mask: torch.Tensor


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Attention work of all single-token rows: packed tokens ``[0, count)``.

    Attributes:
        slot_start, slot_stop: the span of slots read as one view of the cache.
        row_offsets: ``[count]`` int64, ``slot - slot_start`` of each packed token.
        key_length: longest ``position + 1`` among the rows, padded to ``KEY_ALIGN`` (keys
            read per slot).
        mask: ``[slot_stop - slot_start, 1, 1, key_length]``, additive; a slot of the
            span with no row may attend only to position 0, so its (discarded) output is finite.
            None when no position needs hiding (every slot of the span has a row of length
            ``key_length``).
        dense: True when every slot of the span has a row (no scatter/gather needed).
        fold_query_heads: how grouped-query attention is laid out: the ``group_size`` query
            heads of a KV head as its ``group_size`` query rows (True), or SDPA's own
            ``enable_gqa`` with one query row per head (False). The CPU flash kernel splits its
            work differently. With 1 thread ``enable_gqa`` is ~1.4x faster. With 2 threads,
            whole decode steps without HTTP ran 0.90-0.95x as long with ``enable_gqa`` at 64
            rows, but in the server (HTTP, interleaved A/B, 6 waves each) folding gave 4% more
            tokens/s at 16 streams and 6% more at 64 (probably the event loop sharing the
            cores: fewer, larger SDPA tasks suffer less from it), and the two tied at 1 and 4
            streams. So: folded with more than one thread, and always in a step with a
            ``batch_invariant`` row: the CPU kernel can round a lone query row (query length
            1) an ulp away from the same row computed inside a longer query block, so a
            seeded row's one-token prompt chunk would not compute as it does inside a longer
            chunk; folded (query length ``group_size``), it does
            (``tests/models/test_batch_invariance.py``, one thread). True on other devices
            (not measured).
    """

    count: int
    slot_start: int
    slot_stop: int
    row_offsets: torch.Tensor
    key_length: int
    mask: torch.Tensor | None
    dense: bool
    fold_query_heads: bool


@dataclass(frozen=True, slots=True)
class ForwardPlan:
    """Everything one forward needs, built once per step and shared by all layers.

    Packed order: the single-token rows sorted by slot, then each multi-token row.

    Attributes:
        token_ids, positions, slots: ``[N]`` int64, one entry per packed token.
        cache_index: ``[N * n_kv_heads]`` int64, where each token's K/V go
            (:meth:`KVCache.write_index`).
        decode: the single-token rows' attention group, or None when there are none.
        prefills: one group per multi-token row.
        logits_index: ``[R]`` int64, packed index of the last token of each row that wants
            logits, in the order of the rows given to :meth:`build`.
        exact_tokens: int64 packed indices of the tokens of ``batch_invariant`` rows, or None
            when there are none.
        exact_logits: int64 indices into the logits rows of the ``batch_invariant`` rows that
            want logits, or None when there are none.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    cache_index: torch.Tensor
    decode: DecodeGroup | None
    prefills: tuple[PrefillGroup, ...]
    logits_index: torch.Tensor
    exact_tokens: torch.Tensor | None = None
    exact_logits: torch.Tensor | None = None

    @classmethod
    def build(cls, rows: Sequence[RowSpec], *, cache: KVCache) -> ForwardPlan:
        """Plan a forward over ``rows`` (distinct slots, each with >= 1 token)."""
        dtype, device = cache.keys.dtype, cache.keys.device
        single = sorted((r for r in rows if len(r.token_ids) == 1), key=lambda r: r.slot)
        multi = [r for r in rows if len(r.token_ids) > 1]
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        exact_tokens: list[int] = []
        last_index: dict[int, int] = {}
        for row in (*single, *multi):
            if row.batch_invariant:
                exact_tokens.extend(range(len(token_ids), len(token_ids) + len(row.token_ids)))
            token_ids.extend(row.token_ids)
            positions.extend(range(row.position, row.position + len(row.token_ids)))
            slots.extend([row.slot] * len(row.token_ids))
            last_index[row.slot] = len(token_ids) - 1
        logit_rows = [r for r in rows if r.want_logits]
        exact_logits = [i for i, r in enumerate(logit_rows) if r.batch_invariant]

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        prefills = []
        start = len(single)
        for row in multi:
            stop = start + len(row.token_ids)
            prefills.append(_plan_prefill(row, start, stop, dtype, device))
            start = stop
        position_tensor, slot_tensor = as_tensor(positions), as_tensor(slots)
        return cls(
            token_ids=as_tensor(token_ids),
            positions=position_tensor,
            slots=slot_tensor,
            cache_index=cache.write_index(slot_tensor, position_tensor),
            decode=_plan_decode(single, dtype, device) if single else None,
            prefills=tuple(prefills),
            logits_index=as_tensor([last_index[r.slot] for r in logit_rows]),
            exact_tokens=as_tensor(exact_tokens) if exact_tokens else None,
            exact_logits=as_tensor(exact_logits) if exact_logits else None,
        )


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """0 where ``allowed``, -inf elsewhere, in the model dtype: built once per step so that SDPA
    does not convert a boolean mask in every layer. Every query row allows >= 1 key."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill_(~allowed, float("-inf")).to(device)


def _plan_decode(rows: Sequence[RowSpec], dtype: torch.dtype, device: torch.device) -> DecodeGroup:
    slot_start, slot_stop = rows[0].slot, rows[-1].slot + 1
    row_lengths = [row.position + 1 for row in rows]
    key_length = align_keys(max(row_lengths))
    offsets = [row.slot - slot_start for row in rows]
    dense = len(rows) == slot_stop - slot_start
    mask = None
    if not (dense and min(row_lengths) == key_length):
        lengths = torch.ones(slot_stop - slot_start, dtype=torch.int64)  # rowless: position 0
        lengths[offsets] = torch.tensor(row_lengths)
        allowed = torch.arange(key_length)[None, :] < lengths[:, None]
        mask = _additive_mask(allowed[:, None, None, :], dtype, device)
    return DecodeGroup(
        count=len(rows),
        slot_start=slot_start,
        slot_stop=slot_stop,
        row_offsets=torch.tensor(offsets, dtype=torch.int64, device=device),
        key_length=key_length,
        mask=mask,
        dense=dense,
        fold_query_heads=device.type != "cpu"
        or torch.get_num_threads() > 1
        or any(row.batch_invariant for row in rows),
    )


def _plan_prefill(
    row: RowSpec, start: int, stop: int, dtype: torch.dtype, device: torch.device
) -> PrefillGroup:
    key_length = align_keys(row.position + stop - start)
    query_positions = torch.arange(row.position, row.position + stop - start)
    allowed = torch.arange(key_length)[None, :] <= query_positions[:, None]
    mask = _additive_mask(allowed[None, None], dtype, device)
    return PrefillGroup(slot=row.slot, start=start, stop=stop, key_length=key_length, mask=mask)


class LlamaModel:
    """The forward pass. Holds weights and rope tables; reads and writes a :class:`KVCache`.

    ``fused_decode``: let decode-only steps without a seeded row, on the CPU in bfloat16, use
    the fused kernels of :mod:`app.models.fused_decode`; ``fused_decode_status`` says whether
    they are used, and why not.
    """

    def __init__(
        self,
        hparams: LlamaHParams,
        weights: LlamaWeights,
        *,
        max_model_len: int,
        fused_decode: bool = True,
    ):
        self.hparams = hparams
        self.weights = weights
        dtype, device = weights.output_norm.dtype, weights.output_norm.device
        self.dtype, self.device = dtype, device
        half = hparams.head_dim // 2
        inv_freq = 1.0 / (
            hparams.rope_freq_base ** (torch.arange(0, half, dtype=torch.float64) / half)
        )
        angles = torch.arange(max_model_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
        # [max_model_len, head_dim] each (see _apply_rope); computed in float64, stored in the
        # model dtype.
        self._rope_cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(device, dtype)
        self._rope_sin = torch.cat((-angles.sin(), angles.sin()), dim=-1).to(device, dtype)
        self._rms_eps = torch.tensor(hparams.rms_norm_eps, dtype=torch.float32, device=device)
        self.fused_decode: FusedDecodeKernels | None = None
        self.fused_decode_status = "eager decode (--fused-decode false)"
        if fused_decode:
            self.fused_decode, self.fused_decode_status = _fused_decode_for(hparams, dtype, device)

    @property
    def quantization(self) -> Quantization:
        return self.weights.quantization

    def forward(self, plan: ForwardPlan, cache: KVCache) -> torch.Tensor:
        """Run all layers over the packed tokens, writing their K/V into ``cache``.

        Returns logits ``[len(plan.logits_index), vocab]`` in the model dtype (a bfloat16
        model's LM head rounds to bfloat16, as Hugging Face's does). Call under
        ``torch.inference_mode()``.
        """
        if (
            self.fused_decode is not None
            and plan.decode is not None
            and not plan.prefills
            and plan.exact_tokens is None
        ):
            return self._forward_fused_decode(plan, cache, self.fused_decode)
        w, hp = self.weights, self.hparams
        hidden = w.embedding(plan.token_ids)
        cos = self._rope_cos[plan.positions][:, None, :]
        sin = self._rope_sin[plan.positions][:, None, :]
        q_width = hp.head_count * hp.head_dim
        qk_width = q_width + hp.head_count_kv * hp.head_dim
        ffn = hp.feed_forward_length
        num_tokens = hidden.shape[0]
        exact = plan.exact_tokens
        for index, layer in enumerate(w.layers):
            qkv = _project(layer.qkv, self._normed(hidden, layer.attn_norm), exact)
            qk = _apply_rope(qkv[:, :qk_width].view(num_tokens, -1, hp.head_dim), cos, sin)
            queries = qk[:, : hp.head_count]
            keys = qk[:, hp.head_count :]
            values = qkv[:, qk_width:].view(num_tokens, hp.head_count_kv, hp.head_dim)
            cache.write(index, plan.cache_index, keys, values)
            attended = self._attention(index, queries, plan, cache)
            hidden = _project(layer.attn_output, attended, exact, residual=hidden)
            gate_up = _project(layer.gate_up, self._normed(hidden, layer.ffn_norm), exact)
            activated = F.silu(gate_up[:, :ffn]).mul_(gate_up[:, ffn:])
            hidden = _project(layer.down, activated, exact, residual=hidden)
        if plan.logits_index.numel() == 0:  # only prompt chunks that sample nothing
            return hidden.new_empty((0, hp.vocab_size))
        last = F.rms_norm(
            hidden[plan.logits_index], w.output_norm.shape, w.output_norm, hp.rms_norm_eps
        )
        return _project(w.lm_head, last, plan.exact_logits)

    def _forward_fused_decode(
        self, plan: ForwardPlan, cache: KVCache, kernels: FusedDecodeKernels
    ) -> torch.Tensor:
        """:meth:`forward` for a step of only single-token rows, none of them
        ``batch_invariant``, with the glue between projections in four fused calls per layer
        (:mod:`app.models.fused_decode`). Same results as the eager path up to rounding order
        (tested), not bit-equal: a seeded row never comes here."""
        w, hp = self.weights, self.hparams
        eps = hp.rms_norm_eps
        decode = plan.decode
        assert decode is not None
        # torch's threads share the attention (they sit idle between the projections).
        threads = min(torch.get_num_threads(), decode.count)
        # Softmax scores of one KV head's query group, every position up to the longest row,
        # per thread.
        scores = torch.empty((threads, hp.group_size * decode.key_length), dtype=torch.float32)
        hidden = w.embedding(plan.token_ids)
        normed = kernels.rms_norm(hidden, w.layers[0].attn_norm, eps)
        for index, layer in enumerate(w.layers):
            attended = kernels.decode_attention(
                layer.qkv(normed),
                self._rope_cos,
                self._rope_sin,
                plan.positions,
                plan.slots,
                cache.keys[index],
                cache.values[index],
                scores,
                n_heads=hp.head_count,
                n_kv_heads=hp.head_count_kv,
                threads=threads,
            )
            attn_out = layer.attn_output(attended)
            normed = kernels.rms_norm(attn_out, layer.ffn_norm, eps, residual=hidden)
            hidden = attn_out  # now holds the residual sum
            down = layer.down(kernels.silu_mul(layer.gate_up(normed)))
            # The next layer's attention norm (None: folded into its QKV). After the last layer
            # only the residual add is wanted: the output norm is torch's, as on the eager path
            # (through this kernel, greedy agreement with float32 fell from 98.7% to 98.3% at
            # 32 rows x 24 steps).
            following = w.layers[index + 1].attn_norm if index + 1 < len(w.layers) else None
            normed = kernels.rms_norm(down, following, eps, residual=hidden)
            hidden = down
        if plan.logits_index.numel() == 0:
            return hidden.new_empty((0, hp.vocab_size))
        last = F.rms_norm(
            hidden[plan.logits_index], w.output_norm.shape, w.output_norm, hp.rms_norm_eps
        )
        return _project(w.lm_head, last, None)

    def _normed(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """RMSNorm of ``x [N, hidden]``: ``x / rms(x)``, times ``weight`` unless it was folded
        into the next projection (``weight`` None)."""
        normed = x * self._inv_rms(x)
        return normed if weight is None else normed.mul_(weight)

    def _inv_rms(self, x: torch.Tensor) -> torch.Tensor:
        """``1 / sqrt(mean(x ** 2) + eps)`` per row, ``[N, 1]`` in the dtype of ``x``.

        Computed in float32 and rounded once, as Hugging Face's RMSNorm does. (Rounding the
        norm to bfloat16 first saves one small op but measurably costs: greedy agreement with
        float32 fell from 98.4% to 96.9% on the benchmark's prompts.)"""
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        inv = torch.rsqrt(torch.addcmul(self._rms_eps, norm, norm, value=1.0 / x.shape[-1]))
        return inv if inv.dtype == x.dtype else inv.to(x.dtype)

    def _attention(
        self, layer: int, queries: torch.Tensor, plan: ForwardPlan, cache: KVCache
    ) -> torch.Tensor:
        """Attention output ``[N, n_heads * head_dim]`` for packed ``queries [N, n_heads, D]``."""
        outputs = []
        if plan.decode is not None:
            outputs.append(self._decode_attention(layer, queries, plan.decode, cache))
        for group in plan.prefills:
            outputs.append(self._prefill_attention(layer, queries, group, cache))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _decode_attention(
        self, layer: int, queries: torch.Tensor, group: DecodeGroup, cache: KVCache
    ) -> torch.Tensor:
        span = slice(group.slot_start, group.slot_stop)
        keys = cache.keys[layer, span, :, : group.key_length]
        values = cache.values[layer, span, :, : group.key_length]
        hp = self.hparams
        if group.fold_query_heads:
            # [count, n_kv_heads, group_size, D]: the query heads of one KV head are that
            # head's query rows.
            q = queries[: group.count].reshape(group.count, hp.head_count_kv, hp.group_size, -1)
        else:
            q = queries[: group.count].unsqueeze(2)  # [count, n_heads, 1, D], SDPA's GQA
        if not group.dense:
            spanned = q.new_zeros((group.slot_stop - group.slot_start, *q.shape[1:]))
            q = spanned.index_copy_(0, group.row_offsets, q)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=group.mask, enable_gqa=not group.fold_query_heads
        )
        if not group.dense:
            out = out.index_select(0, group.row_offsets)
        return out.reshape(group.count, -1)

    def _prefill_attention(
        self, layer: int, queries: torch.Tensor, group: PrefillGroup, cache: KVCache
    ) -> torch.Tensor:
        length = group.stop - group.start
        span = slice(group.slot, group.slot + 1)
        keys = cache.keys[layer, span, :, : group.key_length]
        values = cache.values[layer, span, :, : group.key_length]
        q = queries[group.start : group.stop].transpose(0, 1).unsqueeze(0)  # [1, n_heads, T, D]
        out = F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=group.mask,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1).reshape(length, -1)  # [T, n_heads * D]


def _fused_decode_for(
    hparams: LlamaHParams, dtype: torch.dtype, device: torch.device
) -> tuple[FusedDecodeKernels | None, str]:
    """The fused decode kernels if this model can use them, else None; and why."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None, f"eager decode ({dtype} on {device}; fused kernels are CPU bfloat16 only)"
    unfit = check_attention_shapes(hparams.head_count, hparams.head_count_kv, hparams.head_dim)
    if unfit is not None:
        return None, f"eager decode ({unfit})"
    kernels, how = load_fused_decode()
    return kernels, how if kernels is not None else f"eager decode (fused kernels: {how})"


def _project(
    linear: Linear,
    x: torch.Tensor,
    exact: torch.Tensor | None,
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T`` (plus ``residual`` when given) for ``x [N, in]``, with the rows listed in
    ``exact`` computed in calls of at most ``linear.exact_rows`` rows, so that each comes out
    as it would alone (batch invariance; see ``exact_rows_per_call``). The other rows take one
    call over all ``N`` (their results there are overwritten for the exact rows)."""

    def call(rows_x: torch.Tensor, rows_residual: torch.Tensor | None) -> torch.Tensor:
        if rows_residual is None:
            return linear(rows_x)
        return linear.add_to(rows_residual, rows_x)

    rows = x.shape[0]
    if exact is None or rows <= linear.exact_rows:
        return call(x, residual)
    if exact.numel() == rows:  # every row is exact: no call over all of them
        return torch.cat(
            [
                call(
                    x[i : i + linear.exact_rows],
                    None if residual is None else residual[i : i + linear.exact_rows],
                )
                for i in range(0, rows, linear.exact_rows)
            ]
        )
    out = call(x, residual)
    for chunk in exact.split(linear.exact_rows):
        chunk_residual = None if residual is None else residual.index_select(0, chunk)
        out.index_copy_(0, chunk, call(x.index_select(0, chunk), chunk_residual))
    return out


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face rotary embedding on ``x [N, heads, D]``.

    ``cos`` is ``[N, 1, D]`` (the angle cosines repeated for both halves) and ``sin`` is
    ``[N, 1, D]`` with the first half negated, so that with ``swapped = (x2, x1)`` the result
    ``x * cos + swapped * sin`` is ``(x1 cos - x2 sin, x2 cos + x1 sin)``: pairs are
    ``(x[i], x[i + D/2])`` (``rotate_half``; see :mod:`app.models.gguf_file`).
    """
    rows, heads, head_dim = x.shape
    swapped = x.view(rows, heads, 2, head_dim // 2).flip(-2).view(rows, heads, head_dim)
    return torch.addcmul(x * cos, swapped, sin)
