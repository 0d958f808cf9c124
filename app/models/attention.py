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

Decode rows are attended ``DECODE_KEY_BUDGET`` gathered positions at a time (``rows x
key_length``), not all at once: the gathered copy is memory outside the KV pool, and gathering
every row of a step at once made it grow with slots x context (SmolLM2 bfloat16, 63 decode rows
of ~700 positions beside a 449-token chunk: +35 MiB of resident heap over the prefills alone,
~0.55 MiB a row; docs/MODEL_PERF.md, the many-slots workload). Each chunk keeps
the group's key axis, so every row computes exactly as it did in one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from app.models.forward_plan import DecodeGroup, ForwardPlan, PrefillGroup
from app.models.kv_cache import KVCache

# Most key positions (rows x key_length) gathered for one SDPA call over decode rows: 16,384
# positions are 12 MiB of keys and values per layer for SmolLM2 in bfloat16 (3 KV heads of 64),
# 22 rows of 720 positions or 8 of 2,048. Bounds the step's attention working set whatever the
# number of slots and their lengths (one row longer than this is still one call).
DECODE_KEY_BUDGET = 16384


def decode_row_chunks(count: int, key_length: int) -> list[tuple[int, int]]:
    """``[start, stop)`` row ranges of a decode group of ``count`` rows whose gathered keys
    hold at most ``DECODE_KEY_BUDGET`` positions each (at least one row each)."""
    per_call = max(1, DECODE_KEY_BUDGET // key_length)
    return [(start, min(start + per_call, count)) for start in range(0, count, per_call)]


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
    chunks = decode_row_chunks(group.count, group.key_length)
    outputs = [_decode_rows(layer, queries, group, cache, start, stop) for start, stop in chunks]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _decode_rows(
    layer: int, queries: torch.Tensor, group: DecodeGroup, cache: KVCache, start: int, stop: int
) -> torch.Tensor:
    """Attention of decode rows ``[start, stop)``: ``[stop - start, n_heads * head_dim]``."""
    count, length = stop - start, group.key_length
    positions = group.key_positions[start * length : stop * length]
    keys, values = cache.gather(layer, positions, count)
    kv_heads = keys.shape[1]
    rows = queries[start:stop]
    if group.fold_query_heads:
        # [count, n_kv_heads, group_size, D]: the query heads of one KV head are that head's
        # query rows.
        q = rows.reshape(count, kv_heads, -1, queries.shape[-1])
    else:
        q = rows.unsqueeze(2)  # [count, n_heads, 1, D], SDPA's GQA
    mask = None if group.mask is None else group.mask[start:stop]
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, enable_gqa=not group.fold_query_heads
    )
    return out.reshape(count, -1)


def _prefill(
    layer: int, queries: torch.Tensor, group: PrefillGroup, cache: KVCache
) -> torch.Tensor:
    length = group.stop - group.start
    keys, values = cache.gather(layer, group.key_positions, 1)
    q = queries[group.start : group.stop].transpose(0, 1).unsqueeze(0)  # [1, n_heads, T, D]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=group.mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(length, -1)  # [T, n_heads * D]
