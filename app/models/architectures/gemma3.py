"""Gemma 3 (text: 270M, 1B, and the language model of 4B-27B): a Llama-style block with
these differences (transformers' ``modeling_gemma3.py``, llama.cpp's gemma3 graph):

* a GeGLU MLP (tanh-approximated GELU) and the embedding rows multiplied by ``sqrt(hidden)``;
* four RMSNorms per block: before and after attention, before and after the MLP; each
  multiplies by ``1 + w`` in a Hugging Face checkpoint, where llama.cpp's converter stores
  ``1 + w`` itself;
* per-head RMSNorm of queries and keys before rope (as Qwen3), a ``head_dim`` of its own;
* local and global layers: every sixth layer global, the others attend within
  ``sliding_window`` with rope base 10,000; global layers use ``rope_theta`` and the rope
  scaling. The paged cache keeps every layer's blocks and masks local layers to the window
  (:class:`app.models.hparams.LocalAttention`);
* attention scale ``query_pre_attn_scalar ** -0.5`` from config.json, ``1 / sqrt(head_dim)``
  from a GGUF (llama.cpp's rule, see :mod:`app.models.checkpoints.local_layers`).

The GGUF's Q/K rows are not permuted (llama.cpp runs gemma3 with its split-half "NEOX" rope).
Hugging Face names: ``post_attention_layernorm`` is the norm *after* attention here (Llama's
name for the norm before the MLP, which Gemma calls ``pre_feedforward_layernorm``).
"""

from __future__ import annotations

from dataclasses import replace

from app.models.architectures.spec import HF_NAMES, Architecture
from app.models.hparams import Activation

GEMMA3 = Architecture(
    name="gemma3",
    hf_model_types=("gemma3_text",),
    gguf_architectures=("gemma3",),
    qk_norm=True,
    ffn_activation=Activation.GELU_TANH,
    post_norms=True,
    scaled_embedding=True,
    hf_norm_shift=1.0,
    sliding_window_pattern=6,
    local_rope_freq_base=10000.0,
    query_pre_attn_scalar=True,
    hf_names=replace(
        HF_NAMES,
        ffn_norm="model.layers.{i}.pre_feedforward_layernorm.weight",
        attn_post_norm="model.layers.{i}.post_attention_layernorm.weight",
        ffn_post_norm="model.layers.{i}.post_feedforward_layernorm.weight",
    ),
)
