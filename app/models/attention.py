"""Eager attention over the KV cache for one layer, in the groups a :class:`ForwardPlan` made.

Grouped-query attention is computed without repeating K/V: for prompt chunks SDPA's
``enable_gqa`` maps query head ``h`` to KV head ``h // group_size``; for decode rows the
``group_size`` query heads that share a KV head are folded into the query-length axis when
torch runs more than one thread or the step has a seeded row (see
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
    span = slice(group.slot_start, group.slot_stop)
    keys = cache.keys[layer, span, :, : group.key_length]
    values = cache.values[layer, span, :, : group.key_length]
    kv_heads = keys.shape[1]
    if group.fold_query_heads:
        # [count, n_kv_heads, group_size, D]: the query heads of one KV head are that head's
        # query rows.
        q = queries[: group.count].reshape(group.count, kv_heads, -1, queries.shape[-1])
    else:
        q = queries[: group.count].unsqueeze(2)  # [count, n_heads, 1, D], SDPA's GQA
    if not group.dense:
        spanned = q.new_zeros((group.slot_stop - group.slot_start, *q.shape[1:]))
        q = spanned.index_copy_(0, group.row_offsets, q)
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=group.mask, enable_gqa=not group.fold_query_heads
    )
    if not group.dense:
        out = out.index_select(0, group.row_offsets)
    return out.reshape(group.count, -1)


def _prefill(
    layer: int, queries: torch.Tensor, group: PrefillGroup, cache: KVCache
) -> torch.Tensor:
    length = group.stop - group.start
    span = slice(group.slot, group.slot + 1)
    keys = cache.keys[layer, span, :, : group.key_length]
    values = cache.values[layer, span, :, : group.key_length]
    q = queries[group.start : group.stop].transpose(0, 1).unsqueeze(0)  # [1, n_heads, T, D]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=group.mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(length, -1)  # [T, n_heads * D]
