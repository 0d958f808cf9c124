"""Mixtral (8x7B, 8x22B): Mistral's attention with a mixture of experts in place of every
layer's MLP (``block_sparse_moe``: router ``gate``, experts ``w1`` gate, ``w3`` up, ``w2``
down), the top ``num_experts_per_tok`` of ``num_local_experts`` by softmax probability,
renormalised (top-k then softmax, the same thing). llama.cpp's converter writes Mixtral as
``general.architecture = llama`` with ``llama.expert_count`` and the experts stacked
(``ffn_gate_exps``, ...), its Q/K rows permuted: such a GGUF is read by the llama
architecture, whose GGUF names include the stacked experts.
"""

from __future__ import annotations

from dataclasses import replace

from app.models.architectures.spec import HF_NAMES, Architecture

MIXTRAL = Architecture(
    name="mixtral",
    hf_model_types=("mixtral",),
    gguf_architectures=(),
    gguf_permutes_qk=True,
    hf_names=replace(
        HF_NAMES,
        ffn_router="model.layers.{i}.block_sparse_moe.gate.weight",
        expert_gate="model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
        expert_up="model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
        expert_down="model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
    ),
)
