"""Eager attention over the KV cache for one layer, in the groups a :class:`ForwardPlan` made.

Keys and values are gathered from the paged cache through each row's block table
(:meth:`app.models.kv_cache.KVCache.gather`, one copy per layer; the fused C decode kernel reads
blocks in place instead). Grouped-query attention is computed without repeating K/V: for
prompt chunks SDPA's ``enable_gqa`` maps query head ``h`` to KV head ``h // group_size``; for
decode rows the ``group_size`` query heads that share a KV head are folded into the
query-length axis when torch runs more than one thread or the step has a seeded row (see
:class:`app.models.forward_plan.DecodeGroup`). Every call gets an explicit additive mask over
a key axis padded to ``KEY_ALIGN`` (never ``is_causal``, whose result depends on the chunk
length: batch invariance, :mod:`app.models.kv_cache`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from app.models.forward_plan import DecodeGroup, ForwardPlan, PrefillGroup
from app.models.kv_cache import KVCache


def attend(layer: int, queries: torch.Tensor, plan: ForwardPlan, cache: KVCache) -> torch.Tensor:
    """Attention output ``[N, n_heads * head_dim]`` for packed ``queries [N, n_heads, D]``, whose
    keys and values are already in ``cache``."""
    outputs = []
    if plan.decode is not None:
        outputs.append(_decode(layer, queries, plan.decode, cache))
    for group in plan.prefills:
        outputs.append(_prefill(layer, queries, group, cache))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _decode(layer: int, queries: torch.Tensor, group: DecodeGroup, cache: KVCache) -> torch.Tensor:
    keys, values = cache.gather(layer, group.key_positions, group.count)
    kv_heads = keys.shape[1]
    if group.fold_query_heads:
        # [count, n_kv_heads, group_size, D]: the query heads of one KV head are that head's
        # query rows.
        q = queries[: group.count].reshape(group.count, kv_heads, -1, queries.shape[-1])
    else:
        q = queries[: group.count].unsqueeze(2)  # [count, n_heads, 1, D], SDPA's GQA
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=group.mask, enable_gqa=not group.fold_query_heads
    )
    return out.reshape(group.count, -1)


def _prefill(
    layer: int, queries: torch.Tensor, group: PrefillGroup, cache: KVCache
) -> torch.Tensor:
    length = group.stop - group.start
    keys, values = cache.gather(layer, group.key_positions, 1)
    q = queries[group.start : group.stop].transpose(0, 1).unsqueeze(0)  # [1, n_heads, T, D]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=group.mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(length, -1)  # [T, n_heads * D]
