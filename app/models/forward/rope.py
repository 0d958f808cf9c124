"""Rotary position embedding: the frequencies of a model (with its scaling) and the tables the
forward reads.

Layout: Hugging Face's ``rotate_half`` form, which pairs element ``i`` of a head with element
``i + head_dim / 2``. Every weight reaches the forward in that layout: a GGUF of the ``llama``
architecture stores Q/K rows permuted for llama.cpp's adjacent-pair rope, and the loader undoes
the permutation (:mod:`app.models.checkpoints.model_tensors`); Qwen2/Qwen3 GGUFs are stored
unpermuted
(llama.cpp runs them with its "NEOX" rope, which is the split-half form).

Frequencies: ``inv_freq[i] = theta ** (-2i / head_dim)`` (RoFormer, Su et al. 2021), then

* ``linear``: divided by ``factor`` (position interpolation, Chen et al. 2023);
* ``llama3``: Meta's Llama 3.1 rule, as transformers' ``_compute_llama3_parameters`` and
  llama.cpp's converter compute it: with ``wavelen = 2 pi / inv_freq``, wavelengths below
  ``original / high_freq_factor`` are kept, those above ``original / low_freq_factor`` divided
  by ``factor``, and in between ``inv_freq / ((1 - s) / factor + s)`` with
  ``s = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)``;
* ``freq_factors``: divided by the file's own per-frequency factors (llama.cpp's
  ``rope_freqs.weight``, which is the ``llama3`` rule already evaluated);
* ``longrope`` (Phi-3): divided by the long factors when the served context (``max_model_len``)
  exceeds the original one, else by the short ones (llama.cpp's choice, by the context it is
  started with; transformers chooses by the length of each forward, the same for sequences
  that stay on one side of the original context), and cos/sin times the attention factor.

Partial rotary (Phi-4-mini): only the first ``rotary_dims`` of a head rotate (their two halves
pair up); the tables are ``rotary_dims`` wide and the rest of the head passes unchanged.
"""

from __future__ import annotations

import math

import torch

from app.models.hparams import HParams, RopeScaling, RopeScalingKind


def inverse_frequencies(
    hparams: HParams, *, local: bool = False, context: int | None = None
) -> torch.Tensor:
    """float64 ``[rotary_dims / 2]``: the rotation speed (radians per position) of each pair.

    ``local``: of the layers that attend within a window (``hparams.local_attention``): their
    own base and no scaling (Gemma 3: the scaling is the global layers' only). ``context``:
    the positions served, which picks longrope's long or short factors (None: short). Raises
    ValueError for ``local`` when the model has no local layers."""
    half = hparams.rotary_dims // 2
    exponents = torch.arange(0, half, dtype=torch.float64) / half
    if local:
        if hparams.local_attention is None:
            raise ValueError("local rope tables of a model without local layers")
        return 1.0 / (hparams.local_attention.rope_freq_base**exponents)
    inv_freq = 1.0 / (hparams.rope_freq_base**exponents)
    scaling = hparams.rope_scaling
    if scaling is None:
        return inv_freq
    return inv_freq / _divisors(inv_freq, scaling, context)


def _divisors(inv_freq: torch.Tensor, scaling: RopeScaling, context: int | None) -> torch.Tensor:
    if scaling.kind is RopeScalingKind.LONGROPE:
        extended = context is not None and context > scaling.original_context_length
        factors = scaling.long_factors if extended else scaling.short_factors
        return torch.tensor(factors, dtype=torch.float64)
    if scaling.kind is RopeScalingKind.LINEAR:
        return torch.full_like(inv_freq, scaling.factor)
    if scaling.kind is RopeScalingKind.FREQ_FACTORS:
        return torch.tensor(scaling.freq_factors, dtype=torch.float64)
    original = float(scaling.original_context_length)
    low, high, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = 1.0 / ((1.0 - smooth) / factor + smooth)
    divisors = torch.where(wavelen > original / low, factor, blended)
    return torch.where(wavelen < original / high, 1.0, divisors)


def rope_tables(
    hparams: HParams,
    positions: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
    local: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[positions, rotary_dims]`` in ``dtype`` on ``device``, computed
    in float64 and rounded once; ``local``: the local layers' (:func:`inverse_frequencies`);
    longrope's tables are for a context of ``positions`` and carry its attention factor.

    ``cos`` holds each pair's cosine twice (both halves); ``sin`` holds the sine with the first
    half negated, so that for ``swapped = (x2, x1)`` the rotation of ``x = (x1, x2)`` is
    ``x * cos + swapped * sin = (x1 cos - x2 sin, x2 cos + x1 sin)`` (see
    :func:`app.models.forward.decoder.apply_rope` and ``rope_head`` in
    ``fused_decode_attention.c``).
    """
    inv_freq = inverse_frequencies(hparams, local=local, context=positions)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)
    sin = torch.cat((-angles.sin(), angles.sin()), dim=-1)
    scaling = hparams.rope_scaling
    if not local and scaling is not None and scaling.kind is RopeScalingKind.LONGROPE:
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    return cos.to(device, dtype), sin.to(device, dtype)
