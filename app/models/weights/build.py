"""Building :class:`app.models.weights.record.ModelWeights` from a checkpoint, in one weight format.

Per layer, in Hugging Face layout (:class:`app.models.checkpoints.model_tensors.ModelTensors`): Q, K
and V are stacked into one projection, gate and up into another (one matmul each), with the RMSNorm
weight folded into their input columns (``W @ (g * x) == (W * g) @ x``), so the forward's
normalisation is a per-token scale (:mod:`app.models.forward.decoder`). Biases go into the
projection. int4 keeps the norms apart (a per-column factor would break its 32-column groups).

Embedding and LM head (tied: one matrix for both):

* dense, packed for oneDNN: the packed head cannot serve lookups, so the lookup reads the file's
  rows (:class:`app.models.weights.embeddings.FileRowsEmbedding`; ``F.linear`` would reorder the
  matrix on every call: 1.2-2x slower, docs/MODEL_PERF.md);
* dense, not packed: tied to the very tensor;
* int8 / int4: an int8 head; tied, the lookup reads its int8 rows;
* gguf: the file's blocks when the kernels compute their type (tied: the lookup decodes rows of
  the same blocks; a large Q8_0 head also gets a :class:`HeadSketch` for greedy rows), else dense.

gguf keeps the file's blocks for every projection whose matrices are all of a type the kernels
compute (:data:`app.models.kernels.ggml_quant.KERNEL_TYPES`), with its norm apart as int4 does;
a projection with a matrix of another type (F16, BF16, F32, Q2_K, Q3_K) is dense, its norm
folded, and named in :attr:`ModelWeights.dense_projections`. An untied embedding on the CPU is
read from the file's rows (no copy in memory).
"""

from __future__ import annotations

import warnings
from functools import partial

import numpy as np
import torch

from app.models.checkpoints.model_tensors import ModelTensors
from app.models.kernels.ggml_quant import KERNEL_TYPES, GGMLKernels, QuantSegment
from app.models.refusal import UnsupportedModel
from app.models.weights.block_arena import BlockArena
from app.models.weights.embeddings import DenseEmbedding, Embedding, FileRowsEmbedding
from app.models.weights.ggml import DENSE_FROM_ROWS, GGMLEmbedding, GGMLLinear, blocks_max_rows
from app.models.weights.head_sketch import HeadSketch
from app.models.weights.int4 import Int4Linear, int4_kernel_status
from app.models.weights.int8 import Int8Embedding, Int8Linear
from app.models.weights.projections import (
    DenseLinear,
    LinearKernel,
    Projection,
    WideLinear,
    dense_projection,
)
from app.models.weights.record import ExpertWeights, LayerWeights, ModelWeights, Quantization

QKV = ("attn_q", "attn_k", "attn_v")
GATE_UP = ("ffn_gate", "ffn_up")


def load_weights(
    tensors: ModelTensors,
    *,
    dtype: torch.dtype,
    device: torch.device,
    quantization: Quantization = Quantization.NONE,
    kernel: LinearKernel = LinearKernel.DENSE,
    ggml: GGMLKernels | None = None,
    wide_copies: bool = False,
    decode_wide_calls: bool = False,
    arena: BlockArena | None = None,
) -> ModelWeights:
    """Read, fuse, fold, cast (or quantise) and move every weight.

    ``ggml``: the GGUF-block kernels, required for ``Quantization.GGUF``; ``wide_copies``:
    gguf keeps a dense copy of each projection on the blocks for wide steps; without them,
    ``decode_wide_calls``: wide calls decode the blocks for the call (both
    :class:`app.models.weights.ggml.GGMLLinear`; the load plan decides). ``arena``: gguf
    blocks are copied into it (2 MiB pages, :mod:`app.models.weights.block_arena`) instead of
    staying the file's mapped bytes.

    Raises:
        ValueError: gguf without its kernels, off the CPU or on a checkpoint without blocks;
            int8/int4 without bfloat16, int4 off the CPU or without its kernel,
            ``kernel`` ONEDNN off the CPU or without bfloat16, ONEDNN_FLOAT32 off the CPU.
        UnsupportedModel: int4 asked for a file whose projections are not all Q4_0/Q4_1.
    """
    if quantization is Quantization.GGUF:
        if ggml is None or device.type != "cpu":
            raise ValueError("gguf weights need the GGUF-block kernels on the CPU")
    elif quantization is not Quantization.NONE and dtype != torch.bfloat16:
        raise ValueError(
            f"{quantization.value} weights need dtype bfloat16 (the kernel's activations)"
        )
    if quantization is Quantization.INT4:
        available, reason = int4_kernel_status()
        if device.type != "cpu" or not available:
            raise ValueError(f"int4 needs torch's CPU int4 kernel: {reason} on {device}")
    if kernel is LinearKernel.ONEDNN and (device.type != "cpu" or dtype != torch.bfloat16):
        raise ValueError("the oneDNN packed bfloat16 kernel needs bfloat16 on the CPU")
    if kernel is LinearKernel.ONEDNN_FLOAT32 and device.type != "cpu":
        raise ValueError("the oneDNN packed float32 kernel runs on the CPU only")
    builder = _LayerBuilder(
        tensors, dtype, device, quantization, kernel, ggml, wide_copies, decode_wide_calls
    )
    builder.arena = arena
    layers = tuple(builder.layer(i) for i in range(tensors.hparams.block_count))
    embedding, lm_head = builder.embedding_and_head()
    return ModelWeights(
        embedding=embedding,
        lm_head=lm_head,
        layers=layers,
        output_norm=builder.vector("output_norm"),
        kernel=kernel,
        quantization=quantization,
        dense_projections=tuple(builder.dense_projections),
    )


class _LayerBuilder:
    """The choices of one load (dtype, device, format, kernel) applied tensor by tensor."""

    def __init__(
        self,
        tensors: ModelTensors,
        dtype: torch.dtype,
        device: torch.device,
        quantization: Quantization,
        kernel: LinearKernel,
        ggml: GGMLKernels | None = None,
        wide_copies: bool = False,
        decode_wide_calls: bool = False,
    ) -> None:
        self.tensors, self.wide_copies = tensors, wide_copies
        self.dense_from_rows = DENSE_FROM_ROWS if decode_wide_calls and not wide_copies else 0
        self.blocks_max_rows = blocks_max_rows()  # beside a wide copy
        self.dtype, self.device = dtype, device
        self.quantization, self.kernel, self.ggml = quantization, kernel, ggml
        # gguf: "name (type)" of each matrix whose projection stayed dense
        self.dense_projections: list[str] = []
        self.arena: BlockArena | None = None  # where gguf blocks are copied, if anywhere

    def vector(self, part: str, layer: int | None = None) -> torch.Tensor:
        """A 1-D weight (a norm) in the model dtype on the device."""
        return self._to_model(self.tensors.read(part, layer))

    def layer(self, i: int) -> LayerWeights:
        if self.tensors.hparams.experts is not None:
            return self._expert_layer(i)
        if self.quantization is Quantization.GGUF:
            qkv, attn_norm = self._file_blocks(i, QKV, norm="attn_norm")
            attn_output, _ = self._file_blocks(i, ("attn_output",))
            gate_up, ffn_norm = self._file_blocks(i, GATE_UP, norm="ffn_norm")
            down, _ = self._file_blocks(i, ("ffn_down",))
        elif self.quantization is Quantization.INT4:
            qkv, attn_output = self._int4(i, QKV), self._int4(i, ("attn_output",))
            gate_up, down = self._int4(i, GATE_UP), self._int4(i, ("ffn_down",))
            attn_norm, ffn_norm = self.vector("attn_norm", i), self.vector("ffn_norm", i)
        else:
            qkv = self._dense(i, QKV, norm="attn_norm")
            attn_output = self._dense(i, ("attn_output",))
            gate_up = self._dense(i, GATE_UP, norm="ffn_norm")
            down = self._dense(i, ("ffn_down",))
            attn_norm = ffn_norm = None
        return LayerWeights(
            qkv=qkv,
            attn_output=attn_output,
            gate_up=gate_up,
            down=down,
            attn_norm=attn_norm,
            ffn_norm=ffn_norm,
            qk_norm=self._qk_norm(i),
            attn_post_norm=self._post_norm("attn_post_norm", i),
            ffn_post_norm=self._post_norm("ffn_post_norm", i),
        )

    def embedding_and_head(self) -> tuple[Embedding, Projection]:
        tensors, hp = self.tensors, self.tensors.hparams
        head_part = "token_embedding" if hp.tied_embeddings else "output"
        if self.quantization is Quantization.GGUF:
            kind = tensors.tensor_type(head_part)
            if kind in KERNEL_TYPES and self.ggml is not None:
                segment = self._segment(head_part, None)
                wide = self._wide((segment,), hp.embedding_length, None)
                head = GGMLLinear(
                    self.ggml,
                    (segment,),
                    hp.embedding_length,
                    wide=wide,
                    out_dtype=torch.float32,
                    blocks_max_rows=self.blocks_max_rows,
                    sketch=HeadSketch.build(self.ggml, segment, hp.embedding_length),
                )
                if hp.tied_embeddings:
                    lookup = GGMLEmbedding(self.ggml, segment, hp.embedding_length, self.dtype)
                    return lookup, head
                return self._untied_embedding(), head
            self.dense_projections.append(f"{tensors.name(head_part)} ({kind})")
        head_f32 = torch.from_numpy(tensors.read(head_part))
        lm_head: Projection
        if self.quantization in (Quantization.INT8, Quantization.INT4):  # an int8 head
            int8 = Int8Linear.quantize(head_f32.to(self.device), self.dtype, self.kernel)
            del head_f32
            if hp.tied_embeddings:
                return Int8Embedding(int8.qweight, int8.scales), int8
            return self._untied_embedding(), int8
        dense = head_f32.to(device=self.device, dtype=self.dtype).contiguous()
        del head_f32
        lm_head = dense_projection(dense, self.kernel)
        if hp.tied_embeddings and isinstance(lm_head, DenseLinear):
            return DenseEmbedding(lm_head.weight), lm_head  # tied to the very tensor
        return self._untied_embedding(), lm_head

    def _untied_embedding(self) -> Embedding:
        """A lookup of the file's embedding rows that does not share the LM head's memory."""
        if self.device.type == "cpu":
            return FileRowsEmbedding(self.tensors.rows("token_embedding"), self.dtype)
        return DenseEmbedding(self._to_model(self.tensors.read("token_embedding")))

    def _dense(self, i: int, parts: tuple[str, ...], *, norm: str | None = None) -> Projection:
        weight = torch.from_numpy(_stack([self.tensors.read(p, i) for p in parts]))
        if norm is not None:
            weight *= torch.from_numpy(self.tensors.read(norm, i))[None, :]
        bias = self._bias(i, parts)
        if self.quantization is Quantization.INT8:
            return Int8Linear.quantize(weight.to(self.device), self.dtype, self.kernel, bias)
        return dense_projection(weight.to(device=self.device, dtype=self.dtype), self.kernel, bias)

    def _file_blocks(
        self, i: int, parts: tuple[str, ...], *, norm: str | None = None
    ) -> tuple[Projection, torch.Tensor | None]:
        """The projection of ``parts`` on the file's blocks and its norm's weight apart, or,
        when a part is of a type the kernels do not compute, dense with the norm folded."""
        kinds = [self.tensors.tensor_type(part, i) for part in parts]
        if self.ggml is None or any(kind not in KERNEL_TYPES for kind in kinds):
            self.dense_projections += [
                f"{self.tensors.name(part, i)} ({kind})"
                for part, kind in zip(parts, kinds, strict=True)
            ]
            return self._dense(i, parts, norm=norm), None
        bias = self._bias(i, parts)
        segments = tuple(self._segment(part, i) for part in parts)
        hp = self.tensors.hparams
        in_features = {"attn_output": hp.q_width, "ffn_down": hp.feed_forward_length}
        width = in_features.get(parts[0], hp.embedding_length)
        wide = self._wide(segments, width, bias)
        float_bias = None if bias is None else bias.float()
        linear = GGMLLinear(
            self.ggml,
            segments,
            width,
            float_bias,
            wide=wide,
            dense_from_rows=self.dense_from_rows,
            blocks_max_rows=self.blocks_max_rows,
        )
        return linear, None if norm is None else self.vector(norm, i)

    def _wide(
        self, segments: tuple[QuantSegment, ...], width: int, bias: torch.Tensor | None
    ) -> WideLinear | None:
        """The dense copy of a projection on the blocks (``segments``, rows of ``width``) for
        wide steps (the norm not folded: the forward applies it to the activations), when the
        load keeps them. The blocks are decoded by the kernels straight into the copy's dtype
        (a float32 matrix in between took Gemma 3's 262k-row head to 1.3 GB at load)."""
        if not self.wide_copies:
            return None
        assert self.ggml is not None  # wide copies are planned for blocks only
        rows, dtype = sum(segment.rows for segment in segments), self.dtype
        weight = torch.empty(rows, width, dtype=dtype)
        first = 0
        for segment in segments:
            ids = torch.arange(segment.rows, dtype=torch.int64)
            out = weight[first : first + segment.rows]
            self.ggml.dequantize_rows(segment, width, ids, dtype, out=out)
            first += segment.rows
        return dense_projection(weight, self.kernel, bias)

    def _segment(self, part: str, i: int | None) -> QuantSegment:
        """The blocks of one matrix in Hugging Face row order (llama.cpp's Q/K permutation
        undone): copied into the arena where there is one (the 32-weight formats' rows
        interleaved on the way, ``GGMLKernels.repack8``), else the file's mapped bytes (or
        the process's copy of reordered rows), faulted in by the first step."""
        blocks = self.tensors.raw_blocks(part, i)
        assert blocks is not None and self.ggml is not None  # GGUF blocks (checked by the plan)
        kind = self.tensors.tensor_type(part, i)
        blocks = np.ascontiguousarray(blocks, dtype=np.uint8)  # no copy for the file's view
        if self.arena is not None and self.ggml.interleaves(kind, blocks.shape[0]):
            taken = self.arena.take(blocks, partial(self.ggml.repack8, kind))
            return QuantSegment(kind, taken, interleaved=True)
        if self.arena is not None:
            return QuantSegment(kind, self.arena.take(blocks))
        if blocks.flags.writeable:  # rows reordered: the process's own copy
            return QuantSegment(kind, torch.from_numpy(blocks))
        return QuantSegment(kind, mapped_tensor(blocks))

    def _int4(self, i: int, parts: tuple[str, ...]) -> Int4Linear:
        codes = []
        for part in parts:
            part_codes = self.tensors.q4_codes(part, i)
            if part_codes is None:
                name = self.tensors.name(part, i)
                raise UnsupportedModel(
                    f"--quantization int4 needs Q4_0/Q4_1 projections; {name} is "
                    f"{self.tensors.tensor_type(part, i)}"
                )
            codes.append(part_codes)
        return Int4Linear.from_codes(codes, kernel=self.kernel, bias=self._bias(i, parts))

    def _bias(self, i: int, parts: tuple[str, ...]) -> torch.Tensor | None:
        """The stacked biases of ``parts`` in the model dtype (zeros for a part without one),
        or None when none of them has a bias."""
        biases = [self.tensors.read_bias(part, i) for part in parts]
        if all(b is None for b in biases):
            return None
        hp = self.tensors.hparams
        widths = {"attn_q": hp.q_width, "attn_k": hp.kv_width, "attn_v": hp.kv_width}
        filled = [
            np.zeros(widths.get(part, hp.embedding_length), np.float32) if b is None else b
            for part, b in zip(parts, biases, strict=True)
        ]
        return self._to_model(_stack(filled))

    def _qk_norm(self, i: int) -> torch.Tensor | None:
        hp = self.tensors.hparams
        if not hp.qk_norm:
            return None
        q_norm = self.tensors.read("attn_q_norm", i)
        k_norm = self.tensors.read("attn_k_norm", i)
        rows = [q_norm] * hp.head_count + [k_norm] * hp.head_count_kv
        return self._to_model(np.stack(rows))

    def _expert_layer(self, i: int) -> LayerWeights:
        """A layer whose MLP is a mixture of experts: the attention as any layer's, the
        experts each a gate/up and a down projection (on the file's blocks for gguf where the
        kernels compute the type, else dense or int8), the MLP norm apart."""
        if self.quantization is Quantization.INT4:
            raise UnsupportedModel("--quantization int4 does not serve a mixture of experts")
        if self.quantization is Quantization.GGUF:
            qkv, attn_norm = self._file_blocks(i, QKV, norm="attn_norm")
            attn_output, _ = self._file_blocks(i, ("attn_output",))
        else:
            qkv, attn_norm = self._dense(i, QKV, norm="attn_norm"), None
            attn_output = self._dense(i, ("attn_output",))
        experts = self.tensors.hparams.experts
        assert experts is not None
        gate_up = tuple(
            self._expert(i, e, ("expert_gate", "expert_up")) for e in range(experts.count)
        )
        down = tuple(self._expert(i, e, ("expert_down",)) for e in range(experts.count))
        return LayerWeights(
            qkv=qkv,
            attn_output=attn_output,
            gate_up=None,
            down=None,
            attn_norm=attn_norm,
            ffn_norm=self.vector("ffn_norm", i),
            qk_norm=self._qk_norm(i),
            experts=ExpertWeights(self.vector("ffn_router", i), gate_up, down),
        )

    def _expert(self, i: int, expert: int, parts: tuple[str, ...]) -> Projection:
        """One expert's projection of ``parts`` (stacked), without a folded norm."""
        tensors = self.tensors
        kinds = [tensors.expert_type(part, i) for part in parts]
        if self.quantization is Quantization.GGUF and self.ggml is not None:
            if all(kind in KERNEL_TYPES for kind in kinds):
                segments = []
                for part, kind in zip(parts, kinds, strict=True):
                    blocks = tensors.expert_blocks(part, i, expert)
                    assert blocks is not None
                    raw = torch.from_numpy(np.array(blocks, dtype=np.uint8, order="C"))
                    segments.append(QuantSegment(kind, raw))
                hp = tensors.hparams
                assert hp.experts is not None
                width = hp.experts.feed_forward_length if parts == ("expert_down",) else None
                return GGMLLinear(self.ggml, tuple(segments), width or hp.embedding_length)
            if expert == 0:
                self.dense_projections += [
                    f"{tensors.name(p, i)} ({k})" for p, k in zip(parts, kinds, strict=True)
                ]
        weight = torch.from_numpy(_stack([tensors.read_expert(p, i, expert) for p in parts]))
        if self.quantization is Quantization.INT8:
            return Int8Linear.quantize(weight.to(self.device), self.dtype, self.kernel)
        return dense_projection(weight.to(device=self.device, dtype=self.dtype), self.kernel)

    def _post_norm(self, part: str, i: int) -> torch.Tensor | None:
        return self.vector(part, i) if self.tensors.hparams.post_norms else None

    def _to_model(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device=self.device, dtype=self.dtype).contiguous()


def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def mapped_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over a read-only view of the file's mapping, without a copy. torch has no
    read-only tensors and warns once for a non-writable array; the block kernels only read
    these bytes and nothing writes a weight in place (a write would fault on the read-only
    pages)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)
