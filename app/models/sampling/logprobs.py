"""Raw log-probabilities of sampled tokens (API.md: log-softmax of the logits in float32,
before any processing, as vLLM's default ``raw_logprobs``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.models.base import TokenLogprobs

MAX_LOGPROBS = 20


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], top: Sequence[int]
) -> list[TokenLogprobs]:
    """The log-probability of ``token_ids[i]`` under row ``i`` of ``logits`` and the row's
    ``top[i]`` most likely alternatives.

    Args:
        logits: ``[R, vocab]``, any float dtype (cast to float32 first).
        token_ids: ``R`` ids, the token each row is scored on.
        top: ``R`` counts in ``0..vocab``.

    Returns:
        One :class:`TokenLogprobs` per row. Alternatives are ordered most likely first; equal
        log-probabilities keep ``torch.topk``'s order.
    """
    if logits.shape[0] == 0:
        return []
    logprobs = logits.float().log_softmax(dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    most = max(top)
    if most > 0:
        values, indices = logprobs.topk(min(most, logprobs.shape[-1]), dim=-1)
        values_list, indices_list = values.tolist(), indices.tolist()
    results = []
    for row, (token, logprob, count) in enumerate(zip(token_ids, chosen, top, strict=True)):
        alternatives: tuple[tuple[int, float], ...] = ()
        if count > 0:
            alternatives = tuple(
                zip(indices_list[row][:count], values_list[row][:count], strict=True)
            )
        results.append(TokenLogprobs(int(token), float(logprob), alternatives))
    return results
