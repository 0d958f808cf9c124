"""Planning one forward: which packed tokens go where, and how attention is grouped.

One step's rows are *packed* into one sequence of ``N`` tokens (no padding), so every matmul
runs once over all of them. Only attention depends on which slot a token belongs to; it runs
in groups planned by :class:`ForwardPlan`:

* **single-token rows** (decode steps, and one-token prompts) in *one* attention call, however
  different their lengths: each row's keys and values are gathered from the paged cache through
  its block table (whole blocks, padded with the null block to the longest row), with a mask
  that hides each row's positions ``>= its length``, so stale cache content is never attended
  to (the fused C decode kernel reads the blocks in place instead: ``DecodeGroup.block_tables``);
* **each multi-token row** (a prompt chunk) in its own attention call over its gathered blocks,
  with a causal mask offset by the row's start position. Padding would make every row as long
  as the longest chunk, in the matmuls as well as in attention. Measured (bfloat16, 2-core
  CPU): 15 decode rows plus one 128-token chunk take 228 ms packed as here; a forward over 16
  rows of 128 tokens, the least that padding would cost, takes 622 ms.

Positions in the pool are "flat": position ``p`` of a row with table ``T`` is pool row
``T[p // KV_BLOCK_SIZE] * KV_BLOCK_SIZE + p % KV_BLOCK_SIZE`` of every head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from app.models.base import NULL_BLOCK
from app.models.forward.attention_masks import additive_mask
from app.models.forward.kv_cache import KV_BLOCK_SIZE, KVCache, align_keys, blocks_for

# When a step with prompt chunks still runs as single-token rows in the fused C kernels
# (ForwardPlan.token_rows) instead of the eager path's SDPA and glue ops: at most this many
# tokens in each chunk, at most FUSED_PREFILL_KEY_BUDGET keys attended by all (sum of position
# + 1: the kernel reads a row's keys once per row, SDPA once per chunk). SmolLM2 int4, one
# chunk fused / eager: from position 0, 0.72-0.85 at 2-48 tokens, 0.98 at 64; after 320 cached
# positions 0.70-0.94 at 2-48 (up to ~16k keys), 1.01 at 64 (22k). Per chunk, as a wave of
# short prompts took 0.45-0.70 of the eager time (16 x 16 to 64 x 4; docs/MODEL_PERF.md).
FUSED_PREFILL_MAX_TOKENS = 48
FUSED_PREFILL_KEY_BUDGET = 16384


@dataclass(frozen=True, slots=True)
class RowSpec:
    """What the forward needs to know about one row (a slot's new tokens this step)."""

    slot: int
    token_ids: Sequence[int]
    position: int
    want_logits: bool
    # True: compute this row exactly as it would be computed in any other batch (a seeded
    # request, API.md); costs extra matmul calls once a step has more rows than a call may hold
    # exactly (see app.models.weights.projections).
    batch_invariant: bool = False
    # The row's block table (KVBlocks.block_ids); None: the slot's fixed blocks
    # (KVCache.slot_blocks, a cache made for slots).
    block_ids: Sequence[int] | None = None
    # Logits at the row's last num_logits positions when it wants logits (a speculative row
    # verifying num_logits - 1 drafted tokens); 1: the last position only.
    num_logits: int = 1


@dataclass(frozen=True, slots=True)
class PrefillGroup:
    """Attention work of one multi-token row: packed tokens ``[start, stop)`` of ``slot``.

    ``mask`` is ``[1, 1, T, key_length]``, additive
    (:func:`app.models.forward.attention_masks.additive_mask`): query ``i`` sees keys
    ``<= position + i``; ``key_length`` is ``position + T`` padded to ``KEY_ALIGN``
    (SDPA's own ``is_causal`` would tie the result to the chunk's length). ``key_positions``
    is ``[key_length]`` int64, the flat pool position of each key (its whole blocks).
    ``batch_invariant``: the row's request chose its seed, so each token is attended as a decode
    row is (:func:`app.models.forward.attention.attend`), whatever the chunk's length.
    """

    slot: int
    start: int
    stop: int
    key_length: int
    mask: torch.Tensor
    key_positions: torch.Tensor
    batch_invariant: bool = False


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Attention work of all single-token rows: packed tokens ``[0, count)``.

    Attributes:
        key_length: longest ``position + 1`` among the rows, padded to ``KEY_ALIGN`` (keys
            read per row: whole blocks).
        block_tables: ``[count, key_length / KV_BLOCK_SIZE]`` int64, each row's blocks, padded
            with the null block.
        row_lengths: each row's ``position + 1``.
        key_positions: ``[count * key_length]`` int64, the flat pool position of each row's
            keys, row-major (what the eager path gathers); made on first use, as ``mask``.
        mask: ``[count, 1, 1, key_length]``, additive, hiding each row's positions ``>= its
            length``; None when no position needs hiding (every row has length
            ``key_length``). The fused decode kernels read neither: a 1-row SmolLM2 step spent
            0.22 of its 0.33 ms of planning on them and on ``ForwardPlan.cache_index``.
        fold_query_heads: how grouped-query attention is laid out: the ``group_size`` query
            heads of a KV head as its ``group_size`` query rows (True), or SDPA's own
            ``enable_gqa`` with one query row per head (False). The CPU flash kernel splits its
            work differently. With 1 thread ``enable_gqa`` is ~1.4x faster. With 2 threads,
            whole decode steps without HTTP ran 0.90-0.95x as long with ``enable_gqa`` at 64
            rows, but in the server (HTTP, interleaved A/B, 6 waves each) folding gave 4% more
            tokens/s at 16 streams and 6% more at 64 (probably the event loop sharing the
            cores: fewer, larger SDPA tasks suffer less from it), and the two tied at 1 and 4
            streams. So: folded with more than one thread, and always in a step with a
            ``batch_invariant`` row: the CPU kernel can round a lone query row (query length
            1) an ulp away from the same row computed inside a longer query block, so a
            seeded row's one-token prompt chunk would not compute as it does inside a longer
            chunk; folded (query length ``group_size``), it does
            (``tests/models/test_batch_invariance.py``, one thread). True on other devices
            (not measured).
    """

    count: int
    key_length: int
    block_tables: torch.Tensor
    row_lengths: tuple[int, ...]
    dtype: torch.dtype
    fold_query_heads: bool
    made: dict[str, torch.Tensor | None] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def key_positions(self) -> torch.Tensor:
        if "key_positions" not in self.made:
            tables = self.block_tables.cpu()
            self.made["key_positions"] = _key_positions(tables).to(self.block_tables.device)
        return self.made["key_positions"]  # type: ignore[return-value]

    @property
    def mask(self) -> torch.Tensor | None:
        if "mask" not in self.made:
            mask = None
            if min(self.row_lengths) != self.key_length:
                lengths = torch.tensor(self.row_lengths)
                allowed = torch.arange(self.key_length)[None, :] < lengths[:, None]
                device = self.block_tables.device
                mask = additive_mask(allowed[:, None, None, :], self.dtype, device)
            self.made["mask"] = mask
        return self.made["mask"]


@dataclass(frozen=True, slots=True)
class TokenRows:
    """Every packed token of a step as a single-token row, for the fused C attention kernel
    (:meth:`app.models.kernels.fused_decode.FusedDecodeKernels.decode_attention`): decode rows as
    they
    are, and each token of a short prompt chunk as a row of its own at its position, with its
    sequence's block table (the kernel writes every row's K/V before any row attends, so a
    chunk's tokens see each other causally).

    Attributes:
        count: ``N``, the packed tokens.
        key_length: longest ``position + 1``, padded to ``KEY_ALIGN``.
        block_tables: ``[N, key_length / KV_BLOCK_SIZE]`` int64, each token's block table,
            padded with the null block.
    """

    count: int
    key_length: int
    block_tables: torch.Tensor


@dataclass(frozen=True, slots=True)
class ForwardPlan:
    """Everything one forward needs, built once per step and shared by all layers.

    Packed order: the single-token rows sorted by slot, then each multi-token row.

    Attributes:
        token_ids, positions, slots: ``[N]`` int64, one entry per packed token.
        flat_positions: ``[N]`` int64, where each token's K/V go in the pool (see the module
            docstring).
        cache_index: ``[N * n_kv_heads]`` int64, where each token's K/V go
            (:meth:`app.models.forward.kv_cache.KVCache.write_index` of ``kv_cache``), made on
            first use (the eager path's; the fused kernels write through the block tables).
        decode: the single-token rows' attention group, or None when there are none.
        prefills: one group per multi-token row.
        logits_index: ``[R]`` int64, packed index of the last token of each row that wants
            logits (its last ``num_logits`` tokens, in order), in the order of the rows given
            to :meth:`build`.
        exact_tokens: int64 packed indices of the tokens of ``batch_invariant`` rows, or None
            when there are none.
        exact_logits: int64 indices into the logits rows of the ``batch_invariant`` rows that
            want logits, or None when there are none.
        token_rows: the step as single-token rows (:class:`TokenRows`) when the fused kernel
            may take it (no ``batch_invariant`` row, prompt chunks within the limits of
            ``_plan_token_rows``), else None.
        row_starts: ``slot -> packed index`` of each row's first token (prompt logprobs read
            a row's hidden states there).
        drafted_tokens: packed tokens that are drafts rows verify (``num_logits - 1`` each):
            kernels chosen by row count count the step without them, so a drafted position
            takes its decode row's kernels (:meth:`app.models.forward.decoder.DecoderModel`).
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    flat_positions: torch.Tensor
    kv_cache: KVCache
    decode: DecodeGroup | None
    prefills: tuple[PrefillGroup, ...]
    logits_index: torch.Tensor
    exact_tokens: torch.Tensor | None = None
    exact_logits: torch.Tensor | None = None
    row_starts: dict[int, int] | None = None
    token_rows: TokenRows | None = None
    drafted_tokens: int = 0
    made: dict[str, torch.Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def cache_index(self) -> torch.Tensor:
        if "cache_index" not in self.made:
            self.made["cache_index"] = self.kv_cache.write_index(self.flat_positions)
        return self.made["cache_index"]

    @classmethod
    def build(cls, rows: Sequence[RowSpec], *, cache: KVCache) -> ForwardPlan:
        """Plan a forward over ``rows`` (distinct slots, each with >= 1 token, each block table
        covering the row's positions)."""
        dtype, device = cache.keys.dtype, cache.keys.device
        single = sorted((r for r in rows if len(r.token_ids) == 1), key=lambda r: r.slot)
        multi = [r for r in rows if len(r.token_ids) > 1]
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        flat: list[int] = []
        exact_tokens: list[int] = []
        last_index: dict[int, int] = {}
        row_starts: dict[int, int] = {}
        tables = {row.slot: _table_of(row, cache) for row in rows}
        for row in (*single, *multi):
            row_starts[row.slot] = len(token_ids)
            if row.batch_invariant:
                exact_tokens.extend(range(len(token_ids), len(token_ids) + len(row.token_ids)))
            token_ids.extend(row.token_ids)
            span = range(row.position, row.position + len(row.token_ids))
            positions.extend(span)
            table = tables[row.slot]
            flat.extend(table[p // KV_BLOCK_SIZE] * KV_BLOCK_SIZE + p % KV_BLOCK_SIZE for p in span)
            slots.extend([row.slot] * len(row.token_ids))
            last_index[row.slot] = len(token_ids) - 1
        logit_rows = [r for r in rows if r.want_logits]
        logits_index: list[int] = []
        exact_logits: list[int] = []
        for r in logit_rows:
            span = range(len(logits_index), len(logits_index) + r.num_logits)
            if r.batch_invariant:
                exact_logits.extend(span)
            last = last_index[r.slot]
            logits_index.extend(range(last - r.num_logits + 1, last + 1))

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        prefills = []
        start = len(single)
        for row in multi:
            stop = start + len(row.token_ids)
            prefills.append(_plan_prefill(row, tables[row.slot], start, stop, dtype, device))
            start = stop
        flat_tensor = as_tensor(flat)
        decode = _plan_decode(single, tables, dtype, device) if single else None
        return cls(
            token_ids=as_tensor(token_ids),
            positions=as_tensor(positions),
            slots=as_tensor(slots),
            flat_positions=flat_tensor,
            kv_cache=cache,
            decode=decode,
            prefills=tuple(prefills),
            logits_index=as_tensor(logits_index),
            exact_tokens=as_tensor(exact_tokens) if exact_tokens else None,
            exact_logits=as_tensor(exact_logits) if exact_logits else None,
            row_starts=row_starts,
            token_rows=None if exact_tokens else _plan_token_rows(decode, multi, tables, device),
            drafted_tokens=sum(r.num_logits - 1 for r in logit_rows),
        )


def _table_of(row: RowSpec, cache: KVCache) -> Sequence[int]:
    table = row.block_ids if row.block_ids is not None else cache.slot_blocks(row.slot)
    if len(table) < blocks_for(row.position + len(row.token_ids)):
        raise ValueError(f"slot {row.slot}: block table does not cover the row")
    return table


def _key_positions(tables: torch.Tensor) -> torch.Tensor:
    """``[rows, blocks]`` block ids -> ``[rows * blocks * KV_BLOCK_SIZE]`` flat positions."""
    offsets = torch.arange(KV_BLOCK_SIZE, dtype=torch.int64)
    return (tables[:, :, None] * KV_BLOCK_SIZE + offsets).flatten()


def _plan_decode(
    rows: Sequence[RowSpec],
    tables: dict[int, Sequence[int]],
    dtype: torch.dtype,
    device: torch.device,
) -> DecodeGroup:
    row_lengths = [row.position + 1 for row in rows]
    key_length = align_keys(max(row_lengths))
    width = key_length // KV_BLOCK_SIZE
    padded_rows = []
    for row in rows:
        used = list(tables[row.slot][: blocks_for(row.position + 1)])
        padded_rows.append(used + [NULL_BLOCK] * (width - len(used)))
    padded = torch.tensor(padded_rows, dtype=torch.int64)
    return DecodeGroup(
        count=len(rows),
        key_length=key_length,
        block_tables=padded.to(device),
        row_lengths=tuple(row_lengths),
        dtype=dtype,
        fold_query_heads=device.type != "cpu"
        or torch.get_num_threads() > 1
        or any(row.batch_invariant for row in rows),
    )


def _plan_prefill(
    row: RowSpec,
    table: Sequence[int],
    start: int,
    stop: int,
    dtype: torch.dtype,
    device: torch.device,
) -> PrefillGroup:
    key_length = align_keys(row.position + stop - start)
    query_positions = torch.arange(row.position, row.position + stop - start)
    allowed = torch.arange(key_length)[None, :] <= query_positions[:, None]
    mask = additive_mask(allowed[None, None], dtype, device)
    blocks = torch.tensor(table[: key_length // KV_BLOCK_SIZE], dtype=torch.int64)
    return PrefillGroup(
        slot=row.slot,
        start=start,
        stop=stop,
        key_length=key_length,
        mask=mask,
        key_positions=_key_positions(blocks[None]).to(device),
        batch_invariant=row.batch_invariant,
    )


def _plan_token_rows(
    decode: DecodeGroup | None,
    multi: Sequence[RowSpec],
    tables: dict[int, Sequence[int]],
    device: torch.device,
) -> TokenRows | None:
    """The step as single-token rows (decode rows first, then each chunk's tokens: the packed
    order), or None when one of its prompt chunks holds more than ``FUSED_PREFILL_MAX_TOKENS``
    tokens or they attend to more than ``FUSED_PREFILL_KEY_BUDGET`` keys in all. A row
    verifying drafts does not count: it stays with its decode rows at any context (else greedy
    tokens changed once (K + 1) x position passed the budget, ~position 1,800 with K = 8)."""
    if not multi:
        assert decode is not None
        return TokenRows(decode.count, decode.key_length, decode.block_tables)
    chunks = [(r.position, len(r.token_ids)) for r in multi if r.num_logits == 1]
    ends = [row.position + len(row.token_ids) for row in multi]
    longest = max((n for _, n in chunks), default=0)
    keys = sum(n * (2 * p + n + 1) // 2 for p, n in chunks)  # position + 1 over each token
    if longest > FUSED_PREFILL_MAX_TOKENS or keys > FUSED_PREFILL_KEY_BUDGET:
        return None
    key_length = align_keys(max(ends + ([decode.key_length] if decode is not None else [])))
    width = key_length // KV_BLOCK_SIZE
    parts = []
    if decode is not None:
        padding = (0, width - decode.block_tables.shape[1])
        parts.append(F.pad(decode.block_tables.cpu(), padding, value=NULL_BLOCK))
    for row, end in zip(multi, ends, strict=True):
        used = list(tables[row.slot][: blocks_for(end)])
        table = torch.tensor(used + [NULL_BLOCK] * (width - len(used)), dtype=torch.int64)
        parts.append(table.expand(len(row.token_ids), width))
    block_tables = torch.cat(parts).to(device)
    return TokenRows(int(block_tables.shape[0]), key_length, block_tables)
