"""A compact Llama forward in torch, with a per-slot KV cache, for batched serving.

One call to :meth:`LlamaModel.forward` computes one scheduler step for every row at once. The
tokens of all rows are *packed* into one sequence of ``N`` tokens (no padding), so every matmul
(fused QKV, output projection, fused gate/up, down, LM head) runs once over all of them.
Only attention depends on which slot a token belongs to; it runs in groups planned by
:class:`ForwardPlan`:

* **single-token rows** (decode steps, and one-token prompts) in *one* SDPA call, however
  different their lengths: the slots ``[slot_start, slot_stop)`` spanned by those rows are read
  as a view of the cache (no copy), padded to the longest length, with a boolean mask that
  hides each slot's positions ``>= its length`` (and every position of a slot in the span that
  has no row this step), so stale cache content is never attended to;
* **each multi-token row** (a prompt chunk) in its own SDPA call with a causal mask offset by
  the row's start position. Padding a 512-token chunk and 15 decode rows to one rectangle
  would do ~16x the attention work, hence the split. Measured on the 2-core CPU this is cheaper
  than padding whenever a chunk is longer than a few tokens.

Grouped-query attention is computed without repeating K/V: the ``group_size`` query heads that
share a KV head are folded into the query-length axis, so SDPA sees ``[B, n_kv_heads,
group_size * T, head_dim]`` queries against ``[B, n_kv_heads, L, head_dim]`` keys.

Weights come from :mod:`app.models.gguf_file` in Hugging Face layout (Q/K un-permuted), so the
rope here is Hugging Face's ``rotate_half`` form. The LM head is tied to the embedding.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from app.models.gguf_file import GGUFFile, LlamaHParams, read_llama_tensor

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One transformer block. Matrices are ``[out_features, in_features]`` in the model dtype.

    Attributes:
        attn_norm: ``[hidden]``.
        qkv: Q, K and V projections stacked: ``[(n_heads + 2 * n_kv_heads) * head_dim, hidden]``.
        attn_output: ``[hidden, n_heads * head_dim]``.
        ffn_norm: ``[hidden]``.
        gate_up: gate and up projections stacked: ``[2 * ffn, hidden]``.
        down: ``[hidden, ffn]``.
    """

    attn_norm: torch.Tensor
    qkv: torch.Tensor
    attn_output: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass(frozen=True, slots=True)
class LlamaWeights:
    """All weights of the model. ``embedding`` (``[vocab, hidden]``) is also the LM head."""

    embedding: torch.Tensor
    layers: tuple[LayerWeights, ...]
    output_norm: torch.Tensor

    @classmethod
    def from_gguf(
        cls, file: GGUFFile, hparams: LlamaHParams, *, dtype: torch.dtype, device: torch.device
    ) -> LlamaWeights:
        """Dequantise every tensor to float32, fuse QKV and gate/up, then cast and move."""
        if not hparams.tied_embeddings:
            raise ValueError("only tied embeddings (no output.weight) are supported")

        def load(*names: str) -> torch.Tensor:
            arrays = [read_llama_tensor(file, name, hparams) for name in names]
            array = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)
            return torch.from_numpy(array).to(device=device, dtype=dtype).contiguous()

        layers = tuple(
            LayerWeights(
                attn_norm=load(f"blk.{i}.attn_norm.weight"),
                qkv=load(f"blk.{i}.attn_q.weight", f"blk.{i}.attn_k.weight", f"blk.{i}.attn_v.weight"),
                attn_output=load(f"blk.{i}.attn_output.weight"),
                ffn_norm=load(f"blk.{i}.ffn_norm.weight"),
                gate_up=load(f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"),
                down=load(f"blk.{i}.ffn_down.weight"),
            )
            for i in range(hparams.block_count)
        )
        return cls(
            embedding=load("token_embd.weight"),
            layers=layers,
            output_norm=load("output_norm.weight"),
        )


class KVCache:
    """Keys and values of every slot, preallocated once.

    ``keys`` and ``values`` are ``[num_layers, max_num_seqs, n_kv_heads, max_model_len,
    head_dim]`` tensors of the model dtype on the model device, so one slot's one head is a
    contiguous ``[max_model_len, head_dim]`` block (what attention reads). Bytes per slot:
    ``2 * num_layers * n_kv_heads * max_model_len * head_dim * itemsize`` (SmolLM2, 2048
    positions: 90 MiB in float32, 45 MiB in bfloat16).

    The cache stores tensors only: which positions of a slot are valid is the runner's
    bookkeeping, passed in through :class:`ForwardPlan`. It is zeroed once, at allocation, and
    never again: a masked-out position gets attention weight 0, but ``0 * NaN`` would still be
    NaN, so never-written memory must hold finite values; stale values from a previous
    occupant are finite and are masked out.
    """

    def __init__(
        self,
        hparams: LlamaHParams,
        *,
        max_num_seqs: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (
            hparams.block_count,
            max_num_seqs,
            hparams.head_count_kv,
            max_model_len,
            hparams.head_dim,
        )
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def bytes_per_slot(self) -> int:
        return 2 * self.keys[:, 0].numel() * self.keys.element_size()

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_slot * self.keys.shape[1]

    def write_index(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows of a layer's ``[slots * heads * positions, head_dim]`` view for ``[N]`` tokens.

        Returns ``[N * n_kv_heads]`` int64, token-major (the order of ``keys.reshape(-1, D)``
        for keys ``[N, n_kv_heads, D]``).
        """
        _, _, kv_heads, max_len, _ = self.keys.shape
        heads = torch.arange(kv_heads, device=slots.device)
        return ((slots[:, None] * kv_heads + heads[None, :]) * max_len + positions[:, None]).flatten()

    def write(
        self, layer: int, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store ``keys``/``values [N, n_kv_heads, D]`` at the rows :meth:`write_index` gave."""
        head_dim = self.keys.shape[-1]
        self.keys[layer].view(-1, head_dim).index_copy_(0, index, keys.reshape(-1, head_dim))
        self.values[layer].view(-1, head_dim).index_copy_(0, index, values.reshape(-1, head_dim))


@dataclass(frozen=True, slots=True)
class RowSpec:
    """What the forward needs to know about one row (a slot's new tokens this step)."""

    slot: int
    token_ids: Sequence[int]
    position: int
    want_logits: bool


@dataclass(frozen=True, slots=True)
class PrefillGroup:
    """Attention work of one multi-token row: packed tokens ``[start, stop)`` of ``slot``.

    ``mask`` is ``[1, 1, group_size * T, position + T]`` (True = may attend).
    """

    slot: int
    start: int
    stop: int
    key_length: int
    mask: torch.Tensor


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Attention work of all single-token rows: packed tokens ``[0, count)``.

    Attributes:
        slot_start, slot_stop: the span of slots read as one view of the cache.
        row_offsets: ``[count]`` int64, ``slot - slot_start`` of each packed token.
        key_length: longest ``position + 1`` among the rows (keys read per slot).
        mask: ``[slot_stop - slot_start, 1, 1, key_length]`` (True = may attend); a slot of the
            span with no row may attend only to position 0, so its (discarded) output is finite.
        dense: True when every slot of the span has a row (no scatter/gather needed).
    """

    count: int
    slot_start: int
    slot_stop: int
    row_offsets: torch.Tensor
    key_length: int
    mask: torch.Tensor
    dense: bool


@dataclass(frozen=True, slots=True)
class ForwardPlan:
    """Everything one forward needs, built once per step and shared by all layers.

    Packed order: the single-token rows sorted by slot, then each multi-token row.

    Attributes:
        token_ids, positions: ``[N]`` int64, one entry per packed token.
        cache_index: ``[N * n_kv_heads]`` int64, where each token's K/V go
            (:meth:`KVCache.write_index`).
        decode: the single-token rows' attention group, or None when there are none.
        prefills: one group per multi-token row.
        logits_index: ``[R]`` int64, packed index of the last token of each row that wants
            logits, in the order of the rows given to :meth:`build`.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    cache_index: torch.Tensor
    decode: DecodeGroup | None
    prefills: tuple[PrefillGroup, ...]
    logits_index: torch.Tensor

    @classmethod
    def build(cls, rows: Sequence[RowSpec], *, group_size: int, cache: KVCache) -> ForwardPlan:
        """Plan a forward over ``rows`` (distinct slots, each with >= 1 token)."""
        device = cache.keys.device
        single = sorted((r for r in rows if len(r.token_ids) == 1), key=lambda r: r.slot)
        multi = [r for r in rows if len(r.token_ids) > 1]
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_index: dict[int, int] = {}
        for row in (*single, *multi):
            token_ids.extend(row.token_ids)
            positions.extend(range(row.position, row.position + len(row.token_ids)))
            slots.extend([row.slot] * len(row.token_ids))
            last_index[row.slot] = len(token_ids) - 1

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        prefills = []
        start = len(single)
        for row in multi:
            stop = start + len(row.token_ids)
            prefills.append(_plan_prefill(row, start, stop, group_size, device))
            start = stop
        position_tensor = as_tensor(positions)
        return cls(
            token_ids=as_tensor(token_ids),
            positions=position_tensor,
            cache_index=cache.write_index(as_tensor(slots), position_tensor),
            decode=_plan_decode(single, device) if single else None,
            prefills=tuple(prefills),
            logits_index=as_tensor([last_index[r.slot] for r in rows if r.want_logits]),
        )


def _plan_decode(rows: Sequence[RowSpec], device: torch.device) -> DecodeGroup:
    slot_start, slot_stop = rows[0].slot, rows[-1].slot + 1
    key_length = max(row.position + 1 for row in rows)
    lengths = torch.ones(slot_stop - slot_start, dtype=torch.int64)  # rowless slots: position 0
    offsets = [row.slot - slot_start for row in rows]
    lengths[offsets] = torch.tensor([row.position + 1 for row in rows])
    mask = torch.arange(key_length)[None, :] < lengths[:, None]
    return DecodeGroup(
        count=len(rows),
        slot_start=slot_start,
        slot_stop=slot_stop,
        row_offsets=torch.tensor(offsets, dtype=torch.int64, device=device),
        key_length=key_length,
        mask=mask[:, None, None, :].to(device),
        dense=len(rows) == slot_stop - slot_start,
    )


def _plan_prefill(
    row: RowSpec, start: int, stop: int, group_size: int, device: torch.device
) -> PrefillGroup:
    length = stop - start
    key_length = row.position + length
    query_positions = torch.arange(row.position, key_length).repeat(group_size)
    mask = torch.arange(key_length)[None, :] <= query_positions[:, None]
    return PrefillGroup(
        slot=row.slot,
        start=start,
        stop=stop,
        key_length=key_length,
        mask=mask[None, None].to(device),
    )


class LlamaModel:
    """The forward pass. Holds weights and rope tables; reads and writes a :class:`KVCache`."""

    def __init__(self, hparams: LlamaHParams, weights: LlamaWeights, *, max_model_len: int):
        self.hparams = hparams
        self.weights = weights
        dtype, device = weights.embedding.dtype, weights.embedding.device
        self.dtype, self.device = dtype, device
        half = hparams.head_dim // 2
        inv_freq = 1.0 / (
            hparams.rope_freq_base ** (torch.arange(0, half, dtype=torch.float64) / half)
        )
        angles = torch.arange(max_model_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
        # [max_model_len, head_dim/2] each; computed in float64, stored in the model dtype.
        self._rope_cos = angles.cos().to(device=device, dtype=dtype)
        self._rope_sin = angles.sin().to(device=device, dtype=dtype)

    def forward(self, plan: ForwardPlan, cache: KVCache) -> torch.Tensor:
        """Run all layers over the packed tokens, writing their K/V into ``cache``.

        Returns float32 logits ``[len(plan.logits_index), vocab]``. Call under
        ``torch.inference_mode()``.
        """
        w, hp = self.weights, self.hparams
        hidden = F.embedding(plan.token_ids, w.embedding)
        cos = self._rope_cos[plan.positions][:, None, :]
        sin = self._rope_sin[plan.positions][:, None, :]
        q_width = hp.head_count * hp.head_dim
        qk_width = q_width + hp.head_count_kv * hp.head_dim
        num_tokens = hidden.shape[0]
        for index, layer in enumerate(w.layers):
            qkv = F.linear(self._rms_norm(hidden, layer.attn_norm), layer.qkv)
            qk = _apply_rope(qkv[:, :qk_width].view(num_tokens, -1, hp.head_dim), cos, sin)
            queries = qk[:, : hp.head_count]
            keys = qk[:, hp.head_count :]
            values = qkv[:, qk_width:].view(num_tokens, hp.head_count_kv, hp.head_dim)
            cache.write(index, plan.cache_index, keys, values)
            attended = self._attention(index, queries, plan, cache)
            hidden = hidden + F.linear(attended, layer.attn_output)
            gate, up = F.linear(self._rms_norm(hidden, layer.ffn_norm), layer.gate_up).chunk(2, -1)
            hidden = hidden + F.linear(F.silu(gate) * up, layer.down)
        last = self._rms_norm(hidden[plan.logits_index], w.output_norm)
        return F.linear(last, w.embedding).float()

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.hparams.rms_norm_eps)
        # Hugging Face order for reduced precision: normalise in float32, cast, then scale.
        normed = F.rms_norm(x.float(), weight.shape, None, self.hparams.rms_norm_eps)
        return normed.to(x.dtype) * weight

    def _attention(
        self, layer: int, queries: torch.Tensor, plan: ForwardPlan, cache: KVCache
    ) -> torch.Tensor:
        """Attention output ``[N, n_heads * head_dim]`` for packed ``queries [N, n_heads, D]``."""
        outputs = []
        if plan.decode is not None:
            outputs.append(self._decode_attention(layer, queries, plan.decode, cache))
        for group in plan.prefills:
            outputs.append(self._prefill_attention(layer, queries, group, cache))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _decode_attention(
        self, layer: int, queries: torch.Tensor, group: DecodeGroup, cache: KVCache
    ) -> torch.Tensor:
        hp = self.hparams
        span = slice(group.slot_start, group.slot_stop)
        keys = cache.keys[layer, span, :, : group.key_length]
        values = cache.values[layer, span, :, : group.key_length]
        # [count, n_heads, D] -> [count, n_kv_heads, group_size, D]: query heads of one KV head
        # become that head's query rows.
        q = queries[: group.count].reshape(group.count, hp.head_count_kv, hp.group_size, -1)
        if not group.dense:
            spanned = q.new_zeros((group.slot_stop - group.slot_start, *q.shape[1:]))
            q = spanned.index_copy_(0, group.row_offsets, q)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=group.mask)
        if not group.dense:
            out = out.index_select(0, group.row_offsets)
        return out.reshape(group.count, -1)

    def _prefill_attention(
        self, layer: int, queries: torch.Tensor, group: PrefillGroup, cache: KVCache
    ) -> torch.Tensor:
        hp = self.hparams
        length = group.stop - group.start
        span = slice(group.slot, group.slot + 1)
        keys = cache.keys[layer, span, :, : group.key_length]
        values = cache.values[layer, span, :, : group.key_length]
        # [T, n_heads, D] -> [1, n_kv_heads, group_size * T, D]
        q = queries[group.start : group.stop].reshape(length, hp.head_count_kv, hp.group_size, -1)
        q = q.permute(1, 2, 0, 3).reshape(1, hp.head_count_kv, hp.group_size * length, -1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=group.mask)
        # [1, n_kv_heads, group_size * T, D] -> [T, n_heads * D]
        out = out.view(hp.head_count_kv, hp.group_size, length, -1).permute(2, 0, 1, 3)
        return out.reshape(length, -1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face rotary embedding on ``x [N, heads, D]`` with ``cos/sin [N, 1, D/2]``.

    Pairs are ``(x[i], x[i + D/2])`` (``rotate_half``): see :mod:`app.models.gguf_file`.
    """
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
