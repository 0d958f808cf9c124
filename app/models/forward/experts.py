"""A mixture-of-experts MLP over a step's packed tokens (Qwen3-MoE, Mixtral).

The router's softmax probabilities (float32) pick each token's ``used`` best experts, weighted
by those probabilities (renormalised to sum 1 when ``Experts.normalize``), as transformers'
``Qwen3MoeSparseMoeBlock`` / ``MixtralSparseMoeBlock`` compute them. Tokens are grouped by
expert: each expert that some token chose runs once, over the rows that chose it, and an
expert no token chose costs nothing; the weighted outputs are added back per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from app.models.hparams import Experts
from app.models.weights.projections import project
from app.models.weights.record import ExpertWeights


def mixture_of_experts(
    weights: ExpertWeights, x: torch.Tensor, routing: Experts, exact: torch.Tensor | None
) -> torch.Tensor:
    """The experts' weighted sum ``[N, hidden]`` (the dtype of ``x``) for normed tokens
    ``x [N, hidden]``. ``exact``: int64 indices of the tokens of ``batch_invariant`` rows,
    computed as :func:`app.models.weights.projections.project` computes exact rows within
    each expert's group."""
    logits = F.linear(x, weights.router).float()
    chosen_weights, chosen = logits.softmax(dim=-1).topk(routing.used, dim=-1)
    if routing.normalize:
        chosen_weights = chosen_weights / chosen_weights.sum(dim=-1, keepdim=True)
    chosen_weights = chosen_weights.to(x.dtype)
    is_exact = None
    if exact is not None:
        is_exact = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        is_exact[exact] = True
    ffn = routing.feed_forward_length
    out = torch.zeros_like(x)
    for expert in chosen.unique().tolist():
        rows, rank = (chosen == expert).nonzero(as_tuple=True)
        group_exact = None
        if is_exact is not None and bool(is_exact[rows].any()):
            group_exact = is_exact[rows].nonzero().flatten()
        gate_up = project(weights.gate_up[expert], x[rows], group_exact)
        activated = F.silu(gate_up[:, :ffn]).mul_(gate_up[:, ffn:])
        expert_out = project(weights.down[expert], activated, group_exact)
        out.index_add_(0, rows, expert_out * chosen_weights[rows, rank, None])
    return out
