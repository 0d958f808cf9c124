"""A Hugging Face ``config.json`` read into :class:`app.models.hparams.HParams`, without
transformers.

Both generations of the file are read:

* transformers 4 writes ``rope_theta`` at the top level and the scaling as ``rope_scaling``
  (``{"rope_type": "llama3", "factor": 8.0, ...}``, older files ``"type"`` instead of
  ``"rope_type"``; ``null`` for none);
* transformers 5 writes both in ``rope_parameters`` (``{"rope_type": "default", "rope_theta":
  ...}``).

Sliding windows: a Mistral config with ``sliding_window`` set, or a Qwen config with
``use_sliding_window: true``, has its context capped at the window (see
:mod:`app.models.architectures.mistral`); the loader logs it. Gemma 3's windows are per layer
and cap nothing (:mod:`app.models.checkpoints.local_layers`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from app.models.architectures import Architecture
from app.models.checkpoints.local_layers import (
    LAYER_TYPES,
    config_attention_scale,
    config_local_attention,
)
from app.models.hparams import Activation, Experts, HParams, RopeScaling, RopeScalingKind
from app.models.refusal import UnsupportedModel, whole_number

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "su")
# config.json's hidden_activation / hidden_act values of each MLP activation
ACTIVATIONS = {
    "silu": Activation.SILU,
    "gelu_pytorch_tanh": Activation.GELU_TANH,
    "gelu_tanh": Activation.GELU_TANH,
}


def hparams_from_config(
    config: dict[str, Any], architecture: Architecture, *, has_output_weight: bool
) -> HParams:
    """The hyper-parameters of ``config`` (a parsed config.json).

    Args:
        has_output_weight: the checkpoint holds an output matrix (``lm_head.weight``): decides
            tied embeddings when the config does not say.

    Raises:
        UnsupportedModel: a quantised checkpoint, an activation other than SiLU, MLP biases,
            an unsupported rope type (named), a missing key, or an untied config without an
            output matrix.
    """
    quantization = config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise UnsupportedModel(f"quantized checkpoints ({method}) are not supported")
    activation = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    if ACTIVATIONS.get(activation) is not architecture.ffn_activation:
        expected = [
            name for name, kind in ACTIVATIONS.items() if kind is architecture.ffn_activation
        ]
        raise UnsupportedModel(
            f"activation {activation!r} is not supported for {architecture.name} "
            f"(only {', '.join(expected)})"
        )
    if config.get("mlp_bias"):
        raise UnsupportedModel("mlp_bias is not supported")
    for unsupported in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(unsupported) is not None:
            raise UnsupportedModel(f"{unsupported} is not supported")
    if config.get("use_bidirectional_attention"):
        raise UnsupportedModel("bidirectional attention (an embedding model) is not supported")

    def required(key: str) -> Any:
        if config.get(key) is None:
            raise UnsupportedModel(f"config.json has no {key!r}")
        return whole_number(f"config.json's {key!r}", config[key])

    hidden = required("hidden_size")
    heads = required("num_attention_heads")
    tied = bool(config.get("tie_word_embeddings", not has_output_weight))
    if not tied and not has_output_weight:
        raise UnsupportedModel("tie_word_embeddings is false but there is no output matrix")
    theta, scaling, local_theta = _rope(config, architecture)
    window = _sliding_window(config, architecture)
    context = required("max_position_embeddings")
    block_count = required("num_hidden_layers")
    head_dim = int(config.get("head_dim") or hidden // max(heads, 1))
    rope_dims = _rope_dims(config, head_dim)
    if rope_dims is not None and not architecture.partial_rotary:
        raise UnsupportedModel(f"partial rotary ({rope_dims} of {head_dim}) not supported")
    return HParams(
        architecture=architecture.name,
        block_count=block_count,
        embedding_length=hidden,
        feed_forward_length=required("intermediate_size"),
        head_count=heads,
        head_count_kv=int(config.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rope_freq_base=theta,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        context_length=context if window is None else min(context, window),
        vocab_size=required("vocab_size"),
        tied_embeddings=tied,
        rope_scaling=scaling,
        qkv_bias=architecture.qkv_bias or bool(config.get("attention_bias")),
        qk_norm=architecture.qk_norm,
        sliding_window=window,
        local_attention=config_local_attention(
            config, architecture, block_count=block_count, local_rope_freq_base=local_theta
        ),
        ffn_activation=architecture.ffn_activation,
        post_norms=architecture.post_norms,
        embedding_scale=math.sqrt(hidden) if architecture.scaled_embedding else None,
        attention_scale=config_attention_scale(config, architecture),
        rope_dims=rope_dims,
        experts=_experts(config, architecture),
    )


def _experts(config: dict[str, Any], architecture: Architecture) -> Experts | None:
    """The mixture of experts of a Qwen3-MoE (``num_experts``) or Mixtral
    (``num_local_experts``) config, or None."""
    count = config.get("num_experts") or config.get("num_local_experts")
    if not count:
        return None
    if architecture.hf_names.expert_gate is None:
        raise UnsupportedModel(f"a mixture of experts is not supported for {architecture.name}")
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) != 1:
        raise UnsupportedModel("layers without experts (mlp_only_layers) are not supported")
    key = architecture.expert_norm_key
    return Experts(
        count=int(count),
        used=int(config.get("num_experts_per_tok") or 0),
        feed_forward_length=int(config.get("moe_intermediate_size") or config["intermediate_size"]),
        normalize=True if key is None else bool(config.get(key, False)),
    )


def _rope_dims(config: dict[str, Any], head_dim: int) -> int | None:
    """The rotated dimensions of a head for a ``partial_rotary_factor`` below 1 (transformers
    5 keeps it in ``rope_parameters``, 4 at the top level: ``int(head_dim * factor)``), else
    None."""
    parameters = config.get("rope_parameters")
    factor = parameters.get("partial_rotary_factor") if isinstance(parameters, dict) else None
    factor = float(factor or config.get("partial_rotary_factor") or 1.0)
    return None if factor >= 1.0 else int(head_dim * factor)


def _rope(
    config: dict[str, Any], architecture: Architecture
) -> tuple[float, RopeScaling | None, float | None]:
    """``(theta, scaling, local theta)`` from transformers 5's ``rope_parameters`` or
    transformers 4's ``rope_theta`` + ``rope_scaling``. An architecture with local layers
    (Gemma 3) has transformers 5's parameters per layer type: ``full_attention`` gives theta
    and scaling, ``sliding_attention`` the local theta (plain rope); the local theta is None
    when the config does not say."""
    parameters = config.get("rope_parameters")
    local_theta = None
    if isinstance(parameters, dict) and any(isinstance(v, dict) for v in parameters.values()):
        if architecture.sliding_window_pattern is None or set(parameters) - set(LAYER_TYPES):
            raise UnsupportedModel("per-layer rope_parameters are not supported")
        local = parameters.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModel("rope scaling on sliding-window layers is not supported")
        local_theta = local.get("rope_theta")
        parameters = parameters.get("full_attention")
    theta, scaling = _global_rope(config, dict(parameters or config.get("rope_scaling") or {}))
    return theta, scaling, None if local_theta is None else float(local_theta)


def _global_rope(
    config: dict[str, Any], parameters: dict[str, Any]
) -> tuple[float, RopeScaling | None]:
    theta = float(parameters.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        supported = ", ".join(SUPPORTED_ROPE_TYPES)
        raise UnsupportedModel(f"rope type {rope_type!r} is not supported (supported: {supported})")
    if rope_type == "default":
        return theta, None
    if rope_type in ("longrope", "su"):
        return theta, _longrope(config, parameters)
    factor = float(parameters.get("factor", 1.0))
    if rope_type == "linear":
        return theta, None if factor == 1.0 else RopeScaling(RopeScalingKind.LINEAR, factor=factor)
    original = parameters.get(
        "original_max_position_embeddings", config.get("original_max_position_embeddings", 8192)
    )
    return theta, RopeScaling(
        RopeScalingKind.LLAMA3,
        factor=factor,
        low_freq_factor=float(parameters.get("low_freq_factor", 1.0)),
        high_freq_factor=float(parameters.get("high_freq_factor", 4.0)),
        original_context_length=int(original),
    )


def _longrope(config: dict[str, Any], parameters: dict[str, Any]) -> RopeScaling:
    """Phi-3's scaling as transformers computes it (``_compute_longrope_parameters``): the
    attention factor given, or ``sqrt(1 + ln(factor) / ln(original))`` with ``factor`` given
    or ``max_position_embeddings / original`` (1 when that is <= 1)."""
    original = parameters.get(
        "original_max_position_embeddings", config.get("original_max_position_embeddings")
    )
    if original is None:
        raise UnsupportedModel("longrope without original_max_position_embeddings")
    original = int(original)
    factor = float(parameters.get("factor") or config["max_position_embeddings"] / original)
    attention = parameters.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        RopeScalingKind.LONGROPE,
        factor=factor,
        original_context_length=original,
        short_factors=tuple(float(f) for f in parameters["short_factor"]),
        long_factors=tuple(float(f) for f in parameters["long_factor"]),
        attention_factor=float(attention),
    )


def _sliding_window(config: dict[str, Any], architecture: Architecture) -> int | None:
    """The window every layer attends over (the context is capped at it), or None: full
    attention, or windows on some layers only (``HParams.local_attention``)."""
    window = config.get("sliding_window")
    switch = architecture.sliding_window_switch
    if architecture.sliding_window_pattern is not None:
        return None
    if window is None or (switch is not None and not config.get(switch, False)):
        return None
    return int(window)
