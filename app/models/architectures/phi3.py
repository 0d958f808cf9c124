"""Phi-3 and Phi-4-mini (``Phi3ForCausalLM``): Llama's block with fused projections and
Microsoft's rope.

* Q, K and V are one matrix (``qkv_proj``, rows ``[q | k | v]``; GGUF ``attn_qkv``), gate and
  up another (``gate_up_proj``, the gate's rows first; GGUF ``ffn_up`` of ``2 * ffn`` rows):
  the loader reads each part as rows of the fused matrix, so the forward's own fused QKV and
  gate/up projections come out the same.
* ``longrope`` (legacy ``su``) rope scaling, short and long per-frequency factors and an
  attention factor (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini); a GGUF holds the factors as
  ``rope_factors_short.weight`` / ``rope_factors_long.weight`` and the factor as
  ``phi3.rope.scaling.attn_factor``.
* ``partial_rotary_factor`` (Phi-4-mini: 0.75 of each head rotates); GGUF
  ``rope.dimension_count``.
* Tied embeddings in Phi-4-mini. A config ``sliding_window`` (Phi-3-mini-4k: 2047) caps the
  context at the window, as Mistral's does.

GGUF Q/K rows are not permuted (llama.cpp runs phi3 with its split-half "NEOX" rope).
"""

from __future__ import annotations

from dataclasses import replace

from app.models.architectures.spec import GGUF_NAMES, HF_NAMES, Architecture

PHI3 = Architecture(
    name="phi3",
    hf_model_types=("phi3",),
    gguf_architectures=("phi3",),
    fused_qkv=True,
    fused_gate_up=True,
    partial_rotary=True,
    hf_names=replace(
        HF_NAMES,
        attn_qkv="model.layers.{i}.self_attn.qkv_proj.weight",
        ffn_gate_up="model.layers.{i}.mlp.gate_up_proj.weight",
    ),
    gguf_names=replace(
        GGUF_NAMES,
        attn_qkv="blk.{i}.attn_qkv.weight",
        ffn_gate_up="blk.{i}.ffn_up.weight",
    ),
)
