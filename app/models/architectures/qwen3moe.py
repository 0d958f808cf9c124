"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k norm) with a
mixture of experts in place of every layer's MLP: a router (``mlp.gate``, GGUF
``ffn_gate_inp``) scores ``num_experts`` SwiGLU experts of ``moe_intermediate_size``, the
``num_experts_per_tok`` best run, weighted by their softmax probabilities, renormalised when
``norm_topk_prob`` (:class:`app.models.hparams.Experts`). Hugging Face files hold each expert's
matrices (``mlp.experts.{e}.gate_proj``); a GGUF stacks them (``ffn_gate_exps``
``[experts, ffn, hidden]``). Layers without experts (``mlp_only_layers``,
``decoder_sparse_step`` above 1) are refused.
"""

from __future__ import annotations

from dataclasses import replace

from app.models.architectures.spec import HF_NAMES, Architecture

QWEN3MOE = Architecture(
    name="qwen3moe",
    hf_model_types=("qwen3_moe",),
    gguf_architectures=("qwen3moe",),
    qk_norm=True,
    sliding_window_switch="use_sliding_window",
    expert_norm_key="norm_topk_prob",
    hf_names=replace(
        HF_NAMES,
        ffn_router="model.layers.{i}.mlp.gate.weight",
        expert_gate="model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
        expert_up="model.layers.{i}.mlp.experts.{e}.up_proj.weight",
        expert_down="model.layers.{i}.mlp.experts.{e}.down_proj.weight",
    ),
)
