"""Eager attention over the KV cache for one layer, in the groups a :class:`ForwardPlan` made.

Keys and values are gathered from the paged cache through each row's block table
(:meth:`app.models.forward.kv_cache.KVCache.gather`, one copy per layer; the fused C decode kernel
reads
blocks in place instead). Grouped-query attention is computed without repeating K/V: for
prompt chunks SDPA's ``enable_gqa`` maps query head ``h`` to KV head ``h // group_size``; for
decode rows the ``group_size`` query heads that share a KV head are folded into the
query-length axis when torch runs more than one thread or the step has a seeded row (see
:class:`app.models.forward.forward_plan.DecodeGroup`). Every call gets an explicit additive mask
over
a key axis padded to ``KEY_ALIGN`` (never ``is_causal``, whose result depends on the chunk
length: batch invariance, :mod:`app.models.forward.kv_cache`).

A prompt chunk of a seeded request (``PrefillGroup.batch_invariant``) is attended token by token
in the decode rows' layout (each token a batch entry of one folded query row, its keys the
chunk's, broadcast without a copy), so a token's attention is the same whether its prompt came
in one chunk, in several, or one token at a time as decode rows: SDPA's CPU kernel does not
promise one query row the same rounding for every query length. Measured on a 2-core AVX2 EPYC
(torch 2.13, SmolLM2's own activations): a prompt row attended within a 150-row chunk and alone
differed by up to 3e-5 in bfloat16 and 3e-8 in float32, which broke a seeded request's batch
invariance at its first token; on the AVX-512/AMX CPU the two agreed. The cost, seeded chunks
only: about twice SDPA's time for a chunk (bfloat16, 512 tokens: 33 against 19 ms a layer from
position 0, 97 against 40 after 1,024 cached positions), no more memory.

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

from app.models.forward.attention_masks import WindowMasks
from app.models.forward.forward_plan import DecodeGroup, ForwardPlan, PrefillGroup
from app.models.forward.kv_cache import KVCache

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


def attend(
    layer: int,
    queries: torch.Tensor,
    plan: ForwardPlan,
    cache: KVCache,
    *,
    window_masks: WindowMasks | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention output ``[N, n_heads * head_dim]`` for packed ``queries [N, n_heads, D]``, whose
    keys and values are already in ``cache``.

    ``window_masks``: a local layer's masks
    (:func:`app.models.forward.attention_masks.window_masks`) instead of the plan's; ``scale``:
    the scores' factor, None for ``1 / sqrt(D)``."""
    outputs = []
    if plan.decode is not None:
        mask = plan.decode.mask if window_masks is None else window_masks.decode
        outputs.append(_decode(layer, queries, plan.decode, cache, mask, scale))
    for index, group in enumerate(plan.prefills):
        mask = group.mask if window_masks is None else window_masks.prefills[index]
        outputs.append(_prefill(layer, queries, group, cache, mask, scale))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _decode(
    layer: int,
    queries: torch.Tensor,
    group: DecodeGroup,
    cache: KVCache,
    mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    chunks = decode_row_chunks(group.count, group.key_length)
    outputs = [
        _decode_rows(layer, queries, group, cache, mask, scale, start, stop)
        for start, stop in chunks
    ]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _decode_rows(
    layer: int,
    queries: torch.Tensor,
    group: DecodeGroup,
    cache: KVCache,
    mask: torch.Tensor | None,
    scale: float | None,
    start: int,
    stop: int,
) -> torch.Tensor:
    """Attention of decode rows ``[start, stop)``: ``[stop - start, n_heads * head_dim]``;
    ``mask`` is the group's (``[count, 1, 1, key_length]``) or None."""
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
    rows_mask = None if mask is None else mask[start:stop]
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=rows_mask, scale=scale, enable_gqa=not group.fold_query_heads
    )
    return out.reshape(count, -1)


def _prefill(
    layer: int,
    queries: torch.Tensor,
    group: PrefillGroup,
    cache: KVCache,
    mask: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """A chunk's attention with ``mask`` (``[1, 1, T, key_length]``: the group's, or a local
    layer's)."""
    length = group.stop - group.start
    keys, values = cache.gather(layer, group.key_positions, 1)
    if group.batch_invariant:
        chunk = queries[group.start : group.stop]
        return _prefill_as_decode_rows(chunk, keys, values, mask, scale)
    q = queries[group.start : group.stop].transpose(0, 1).unsqueeze(0)  # [1, n_heads, T, D]
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1).reshape(length, -1)  # [T, n_heads * D]


def _prefill_as_decode_rows(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """A chunk's attention ``[T, n_heads * head_dim]``, each of its ``T`` tokens (``queries [T,
    n_heads, D]``) a batch entry whose query rows are the query heads of one KV head, as
    :func:`_decode_rows` folds them; ``keys``/``values`` ``[1, n_kv_heads, L, D]`` are expanded
    over the batch (a view) and ``mask [1, 1, T, L]`` gives each token its causal row."""
    length, kv_heads = queries.shape[0], keys.shape[1]
    q = queries.reshape(length, kv_heads, -1, queries.shape[-1])
    out = F.scaled_dot_product_attention(
        q,
        keys.expand(length, -1, -1, -1),
        values.expand(length, -1, -1, -1),
        attn_mask=mask[0, 0, :, None, None, :],
        scale=scale,
    )
    return out.reshape(length, -1)
