"""Which layers attend within a sliding window, and the attention scale, as each file format
says them (Gemma 3's local and global layers; :class:`app.models.hparams.LocalAttention`).

* config.json: ``sliding_window``; ``layer_types`` (``"sliding_attention"`` /
  ``"full_attention"`` per layer) or else ``sliding_window_pattern`` (every ``n``-th layer
  global); the local rope base in transformers 5's ``rope_parameters["sliding_attention"]`` or
  transformers 4's ``rope_local_base_freq``. The attention scale is
  ``query_pre_attn_scalar ** -0.5`` (``Gemma3Attention.scaling``).
* GGUF: ``{arch}.attention.sliding_window``; ``{arch}.attention.sliding_window_pattern`` (a
  period, or one flag per layer, true for a windowed layer) and ``{arch}.rope.freq_base_swa``
  where the file has them, else the architecture's defaults (llama.cpp's for gemma3: a period
  of 6 and base 10,000; the converter writes neither). The attention scale is llama.cpp's:
  ``1 / sqrt(head_dim)``, except for its 27B type (62 layers), ``1 / sqrt(hidden / heads)``
  (``f_attention_scale`` in ``llama-model.cpp``), which equals that model's
  ``query_pre_attn_scalar`` of 168.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from app.models.architectures import Architecture
from app.models.hparams import LocalAttention
from app.models.refusal import UnsupportedModel

LAYER_TYPES = {"sliding_attention": True, "full_attention": False}
LLAMA_CPP_27B_LAYERS = 62  # llama.cpp's LLM_TYPE_27B for gemma3 (n_layer == 62)


def periodic_layers(period: int, block_count: int) -> tuple[bool, ...]:
    """Local-layer flags of a period: layer ``i`` is global when ``(i + 1) % period == 0``
    (transformers' ``layer_types`` default and llama.cpp's ``set_swa_pattern``); a period of
    0 makes every layer local (llama.cpp)."""
    if period == 0:
        return (True,) * block_count
    return tuple((i + 1) % period != 0 for i in range(block_count))


def gguf_local_attention(
    field_or: Callable[[str, Any], Any], arch: str, architecture: Architecture, block_count: int
) -> LocalAttention | None:
    """The local layers a GGUF's metadata gives (``field_or(key, default)`` reads a key), or
    None for an architecture without them or a file without a window.

    Raises:
        UnsupportedModel: a per-layer pattern whose length is not the block count.
    """
    if architecture.sliding_window_pattern is None:
        return None
    window = int(field_or(f"{arch}.attention.sliding_window", 0) or 0)
    if window <= 0:
        return None
    pattern = field_or(
        f"{arch}.attention.sliding_window_pattern", architecture.sliding_window_pattern
    )
    if isinstance(pattern, list):
        layers = tuple(bool(flag) for flag in pattern)
        if len(layers) != block_count:
            raise UnsupportedModel(
                f"{arch}.attention.sliding_window_pattern has {len(layers)} flags for "
                f"{block_count} layers"
            )
    else:
        layers = periodic_layers(int(pattern), block_count)
    base = float(field_or(f"{arch}.rope.freq_base_swa", architecture.local_rope_freq_base))
    return LocalAttention(window=window, layers=layers, rope_freq_base=base)


def gguf_attention_scale(
    architecture: Architecture, *, block_count: int, hidden: int, heads: int, head_dim: int
) -> float | None:
    """llama.cpp's attention scale for an architecture scaled by ``query_pre_attn_scalar``
    (module docstring) where it is not ``1 / sqrt(head_dim)``; None (that, the forward's
    default) otherwise."""
    if not architecture.query_pre_attn_scalar:
        return None
    if block_count == LLAMA_CPP_27B_LAYERS and hidden // heads != head_dim:
        return 1.0 / math.sqrt(hidden // heads)
    return None  # 1 / sqrt(head_dim), the forward's default


def config_local_attention(
    config: dict[str, Any],
    architecture: Architecture,
    *,
    block_count: int,
    local_rope_freq_base: float | None,
) -> LocalAttention | None:
    """The local layers of a config.json (``local_rope_freq_base``: read with the rope keys,
    None when absent), or None for an architecture without them or a config without a window.

    Raises:
        UnsupportedModel: an unknown layer type, or a ``layer_types`` of another length.
    """
    if architecture.sliding_window_pattern is None or not config.get("sliding_window"):
        return None
    types = config.get("layer_types")
    if types:
        unknown = sorted(set(types) - set(LAYER_TYPES))
        if unknown:
            raise UnsupportedModel(f"layer types {unknown} are not supported")
        if len(types) != block_count:
            raise UnsupportedModel(f"{len(types)} layer_types for {block_count} layers")
        layers = tuple(LAYER_TYPES[kind] for kind in types)
    else:
        period = config.get(
            "sliding_window_pattern",
            config.get("_sliding_window_pattern", architecture.sliding_window_pattern),
        )
        layers = periodic_layers(int(period), block_count)
    base = local_rope_freq_base or config.get("rope_local_base_freq")
    return LocalAttention(
        window=int(config["sliding_window"]),
        layers=layers,
        rope_freq_base=float(base or architecture.local_rope_freq_base),
    )


def config_attention_scale(config: dict[str, Any], architecture: Architecture) -> float | None:
    """``query_pre_attn_scalar ** -0.5`` for an architecture scaled by it whose config has it,
    else None (``1 / sqrt(head_dim)``)."""
    scalar = config.get("query_pre_attn_scalar")
    if not architecture.query_pre_attn_scalar or not scalar:
        return None
    return float(scalar) ** -0.5
