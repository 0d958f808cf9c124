"""Which fused decode step a model takes, and the C view of its layers.

A step of single-token rows (``ForwardPlan.token_rows``) runs the glue between projections in
the fused C kernels of :mod:`app.models.kernels.fused_decode` when the model is CPU bfloat16 and
its block is one they compute (:func:`fused_decode_for`: Llama-style and Gemma 3 blocks). With
every projection on GGUF blocks, the whole layer loop is one C call over a
:class:`~app.models.kernels.decoder_layout.DecoderLayout` (:func:`block_layout`); otherwise
:class:`app.models.forward.decoder.DecoderModel` runs the loop in Python over the same kernels
(dense projections, or a dense copy taking a wide step's call). The greedy sampler's argmax
runs in the same library where it is built (:func:`greedy_argmax`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from app.models.forward.kv_cache import KVCache
from app.models.hparams import Activation, HParams
from app.models.kernels.decoder_layout import BlockLayer, DecoderLayout, decoder_layout
from app.models.kernels.fused_decode import (
    FusedDecodeKernels,
    check_attention_shapes,
    load_fused_decode,
)
from app.models.sampling.sampler import argmax_rows
from app.models.weights.ggml import EXACT_ROWS_ANY, GGMLLinear
from app.models.weights.record import ModelWeights


def fused_decode_for(
    hparams: HParams, dtype: torch.dtype, device: torch.device
) -> tuple[FusedDecodeKernels | None, str]:
    """The fused decode kernels if this model can use them, else None; and why (the model's
    ``fused_decode_status``). A failed build is a reason, not an error."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None, f"eager decode ({dtype} on {device}; fused kernels are CPU bfloat16 only)"
    beyond = _beyond_fused_kernels(hparams)
    if beyond:
        return None, (
            f"eager decode ({hparams.architecture}: {', '.join(beyond)}; the fused kernels "
            "compute Llama-style and Gemma 3 blocks)"
        )
    unfit = check_attention_shapes(hparams.head_count, hparams.head_count_kv, hparams.head_dim)
    if unfit is not None:
        return None, f"eager decode ({unfit})"
    kernels, how = load_fused_decode()
    if kernels is None:
        return None, f"eager decode (fused kernels: {how})"
    return kernels, how


def greedy_argmax(
    kernels: FusedDecodeKernels | None,
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The sampler's argmax on the fused kernels (their rows on torch's threads), or None
    without them (the sampler's own, ``argmax_rows``). CPU logits of another dtype or layout
    take ``argmax_rows`` too. Same indices either way; Gemma 3's 64 rows of 262,144 bfloat16
    logits: 1.2 against 2.6 ms on the AMX Xeon."""
    if kernels is None:
        return None

    def argmax(logits: torch.Tensor) -> torch.Tensor:
        fits = logits.dtype in (torch.bfloat16, torch.float32) and logits.stride(-1) == 1
        if not fits or logits.device.type != "cpu":
            return argmax_rows(logits)
        return kernels.argmax_rows(logits, threads=torch.get_num_threads())

    return argmax


def _beyond_fused_kernels(hparams: HParams) -> list[str]:
    """What of this model no fused decode step computes (empty: the C layer loop fits)."""
    beyond = []
    if hparams.rotary_dims != hparams.head_dim:
        beyond.append("partial rotary")
    if hparams.experts is not None:
        beyond.append("mixture of experts")
    return beyond


def block_layout(
    hparams: HParams,
    weights: ModelWeights,
    cache: KVCache,
    rope: tuple[torch.Tensor, torch.Tensor],
    local_rope: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[DecoderLayout | None, int]:
    """The C view of a model's layers over ``cache`` for ``sl_decode_layers``, and the most
    rows one call takes; ``(None, 0)`` when a layer does not compute on GGUF blocks (dense or
    int4 projections, a mixture of experts).

    Args:
        rope: ``(cos, sin)``, ``[max_model_len, head_dim]`` each: the global layers' tables.
        local_rope: the same for layers that attend within a window, or None (one table).

    Raises:
        ValueError: a tensor that is not contiguous bfloat16 or float32.
    """
    layers = []
    max_rows = EXACT_ROWS_ANY
    local = hparams.local_attention
    for index, layer in enumerate(weights.layers):
        is_local = local is not None and local.layers[index]
        tables = local_rope if is_local and local_rope is not None else rope
        projections = (layer.qkv, layer.attn_output, layer.gate_up, layer.down)
        if layer.experts is not None or not all(isinstance(p, GGMLLinear) for p in projections):
            return None, 0
        for p in projections:  # the most rows a call computes on the blocks (then a dense
            # copy or a decoded matrix takes it, which a prompt wave's steps reach)
            max_rows = min(max_rows, p.exact_rows)  # type: ignore[union-attr]
        layers.append(
            BlockLayer(
                tuple((p.prepared, p.bias) for p in projections),  # type: ignore[union-attr]
                layer.attn_norm,
                layer.ffn_norm,
                layer.qk_norm,
                cache.keys[index],
                cache.values[index],
                *tables,
                layer.attn_post_norm,
                layer.ffn_post_norm,
                local.window if is_local and local is not None else 0,
            )
        )
    layout = decoder_layout(
        weights.layers[0].qkv.kernels,  # type: ignore[union-attr]
        layers,
        ffn=hparams.feed_forward_length,
        n_heads=hparams.head_count,
        n_kv_heads=hparams.head_count_kv,
        eps=hparams.rms_norm_eps,
        gelu_tanh=hparams.ffn_activation is Activation.GELU_TANH,
        attention_scale=hparams.attention_scale,
    )
    return layout, max_rows
