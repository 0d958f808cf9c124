"""The C view of a decoder whose projections all compute on GGUF blocks: the ``sl_decoder``,
``sl_decoder_layer`` and ``sl_block_projection`` structures of ``fused_decode.h`` as
:mod:`ctypes` structures, filled once per KV cache from the model's tensors, so that
``sl_decode_layers`` (:meth:`app.models.kernels.fused_decode.FusedDecodeKernels.decode_layers`)
runs every layer of a step in one call.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from app.models.forward.kv_cache import KV_BLOCK_SIZE
from app.models.kernels.ggml_quant import GGMLKernels, PreparedSegments

_c_void_p = ctypes.c_void_p
_c_int64 = ctypes.c_int64
_c_float = ctypes.c_float


class _BlockProjection(ctypes.Structure):
    """``sl_block_projection`` (fused_decode.h)."""

    _fields_ = (
        ("n_segments", _c_int64),
        ("qtypes", _c_void_p),
        ("weights", _c_void_p),
        ("seg_rows", _c_void_p),
        ("out_features", _c_int64),
        ("bias", _c_void_p),
    )


class _DecoderLayer(ctypes.Structure):
    """``sl_decoder_layer`` (fused_decode.h)."""

    _fields_ = (
        ("qkv", _BlockProjection),
        ("output", _BlockProjection),
        ("gate_up", _BlockProjection),
        ("down", _BlockProjection),
        ("attn_norm", _c_void_p),
        ("ffn_norm", _c_void_p),
        ("attn_post_norm", _c_void_p),
        ("ffn_post_norm", _c_void_p),
        ("q_norm", _c_void_p),
        ("k_norm", _c_void_p),
        ("keys", _c_void_p),
        ("values", _c_void_p),
        ("rope_cos", _c_void_p),
        ("rope_sin", _c_void_p),
        ("window", _c_int64),
    )


class _Decoder(ctypes.Structure):
    """``sl_decoder`` (fused_decode.h)."""

    _fields_ = (
        ("matmul", _c_void_p),
        ("isa", _c_int64),
        ("threads", _c_int64),
        ("n_layers", _c_int64),
        ("layers", ctypes.POINTER(_DecoderLayer)),
        ("hidden", _c_int64),
        ("ffn", _c_int64),
        ("n_heads", _c_int64),
        ("n_kv_heads", _c_int64),
        ("head_dim", _c_int64),
        ("pool_len", _c_int64),
        ("block_size", _c_int64),
        ("gelu_tanh", _c_int64),
        ("eps", _c_float),
        ("attention_scale", _c_float),
    )


@dataclass(frozen=True, slots=True)
class BlockLayer:
    """One decoder layer as :func:`decoder_layout` takes it.

    Attributes:
        projections: QKV, output, gate/up and down: each its prepared GGUF-block arguments and
            float32 bias (``[out]`` or None).
        attn_norm, ffn_norm: ``[hidden]`` bfloat16 RMSNorm weights, or None when folded.
        qk_norm: ``[n_heads + n_kv_heads, head_dim]`` bfloat16 per-head norm, or None.
        keys, values: the layer's K/V cache, ``[n_kv_heads, pool_len, head_dim]`` bfloat16.
        rope_cos, rope_sin: ``[max_positions, head_dim]`` bfloat16: this layer's rope tables.
        attn_post_norm, ffn_post_norm: ``[hidden]`` bfloat16 norms of the attention and MLP
            outputs before their residual adds (Gemma 3), or None.
        window: 0, or the layer's sliding window (Gemma 3's local layers).
    """

    projections: tuple[tuple[PreparedSegments, torch.Tensor | None], ...]
    attn_norm: torch.Tensor | None
    ffn_norm: torch.Tensor | None
    qk_norm: torch.Tensor | None
    keys: torch.Tensor
    values: torch.Tensor
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    attn_post_norm: torch.Tensor | None = None
    ffn_post_norm: torch.Tensor | None = None
    window: int = 0


@dataclass(frozen=True, slots=True)
class DecoderLayout:
    """A model's layers as ``sl_decode_layers`` reads them: C structures of pointers into
    tensors that ``keep`` holds, so they stay valid while the layout lives."""

    decoder: _Decoder
    layers: ctypes.Array
    keep: tuple[object, ...]

    @property
    def pointer(self) -> int:
        """The address of the ``sl_decoder``."""
        return ctypes.addressof(self.decoder)


def decoder_layout(
    ggml: GGMLKernels,
    layers: list[BlockLayer],
    *,
    ffn: int,
    n_heads: int,
    n_kv_heads: int,
    eps: float,
    gelu_tanh: bool = False,
    attention_scale: float | None = None,
) -> DecoderLayout:
    """The C view of a model whose projections are all GGUF blocks, built once per KV cache.
    ``gelu_tanh``: the gated MLP's activation is GELU (tanh approximation), else SiLU;
    ``attention_scale``: the scores' factor (None: ``1 / sqrt(head_dim)``).

    Raises:
        ValueError: a tensor that is not contiguous bfloat16 or float32.
    """
    keep: list[object] = []

    def pointer(tensor: torch.Tensor | None) -> int | None:
        if tensor is None:
            return None
        if tensor.dtype not in (torch.bfloat16, torch.float32) or not tensor.is_contiguous():
            raise ValueError(f"a layout tensor must be contiguous, got {tensor.dtype}")
        keep.append(tensor)
        return tensor.data_ptr()

    structs = (_DecoderLayer * len(layers))()
    hidden = head_dim = pool_len = 0
    for struct, layer in zip(structs, layers, strict=True):
        projections = []
        for prepared, bias in layer.projections:
            keep.append(prepared)
            projections.append(
                _BlockProjection(
                    len(prepared.segments),
                    ctypes.addressof(prepared.qtypes),
                    ctypes.addressof(prepared.pointers),
                    ctypes.addressof(prepared.seg_rows),
                    prepared.out_features,
                    pointer(bias),
                )
            )
        struct.qkv, struct.output, struct.gate_up, struct.down = projections
        q_norm = k_norm = None
        if layer.qk_norm is not None:
            q_norm, k_norm = pointer(layer.qk_norm[0]), pointer(layer.qk_norm[n_heads])
        struct.attn_norm, struct.ffn_norm = pointer(layer.attn_norm), pointer(layer.ffn_norm)
        struct.attn_post_norm = pointer(layer.attn_post_norm)
        struct.ffn_post_norm = pointer(layer.ffn_post_norm)
        struct.q_norm, struct.k_norm = q_norm, k_norm
        struct.keys, struct.values = pointer(layer.keys), pointer(layer.values)
        struct.rope_cos, struct.rope_sin = pointer(layer.rope_cos), pointer(layer.rope_sin)
        struct.window = layer.window
        hidden = layer.projections[1][0].out_features
        _, pool_len, head_dim = layer.keys.shape
    decoder = _Decoder(
        ctypes.cast(ggml.library.sl_quant_matmul, _c_void_p).value,
        int(ggml.isa),
        1,
        len(layers),
        ctypes.cast(structs, ctypes.POINTER(_DecoderLayer)),
        hidden,
        ffn,
        n_heads,
        n_kv_heads,
        head_dim,
        pool_len,
        KV_BLOCK_SIZE,
        int(gelu_tanh),
        eps,
        attention_scale or 0.0,
    )
    return DecoderLayout(decoder, structs, tuple(keep))
