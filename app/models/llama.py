"""A compact Llama forward in torch, with a per-slot KV cache, for batched serving.

One call to :meth:`LlamaModel.forward` computes one scheduler step for every row at once. The
tokens of all rows are *packed* into one sequence of ``N`` tokens (no padding), so every matmul
(fused QKV, output projection, fused gate/up, down, LM head) runs once over all of them.
Only attention depends on which slot a token belongs to; it runs in groups planned by
:class:`ForwardPlan`:

* **single-token rows** (decode steps, and one-token prompts) in *one* SDPA call, however
  different their lengths: the slots ``[slot_start, slot_stop)`` spanned by those rows are read
  as a view of the cache (no copy), padded to the longest length, with a mask that
  hides each slot's positions ``>= its length`` (and every position of a slot in the span that
  has no row this step), so stale cache content is never attended to;
* **each multi-token row** (a prompt chunk) in its own SDPA call with a causal mask offset by
  the row's start position. Padding would make every row as long as the longest chunk, in
  the matmuls as well as in attention. Measured (bfloat16, 2-core CPU): 15 decode rows plus
  one 128-token chunk take 228 ms packed as here; a forward over 16 rows of 128 tokens, the
  least that padding would cost, takes 622 ms.

Grouped-query attention is computed without repeating K/V: the ``group_size`` query heads that
share a KV head are folded into the query-length axis, so SDPA sees ``[B, n_kv_heads,
group_size * T, head_dim]`` queries against ``[B, n_kv_heads, L, head_dim]`` keys.

Weights come from :mod:`app.models.gguf_file` in Hugging Face layout (Q/K un-permuted), so the
rope here is Hugging Face's ``rotate_half`` form. The LM head is tied to the embedding.
Projections are :class:`DenseLinear` (float32 or bfloat16) or, with ``Quantization.INT8``,
:class:`Int8Linear` (weight-only int8, bfloat16 activations).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch
import torch.nn.functional as F

from app.models.gguf_file import GGUFFile, LlamaHParams, read_llama_tensor

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Quantization(Enum):
    """How the projection matrices (and the LM head) are stored."""

    NONE = "none"
    INT8 = "int8"


# Row counts up to which the int8 kernel beats a dense bfloat16 matmul (measured on the 2-core
# Sapphire Rapids CPU: at 1-2 rows int8 moves a quarter of the bytes of float32; from ~6 rows on
# AMX bfloat16 GEMM wins, the int8 kernel being a GEMV at heart).
INT8_MAX_ROWS = 4


@dataclass(frozen=True, slots=True)
class DenseLinear:
    """``y = x @ weight.T`` with ``weight [out, in]`` in the model dtype."""

    weight: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


@dataclass(frozen=True, slots=True)
class Int8Linear:
    """Weight-only int8: ``weight ~= qweight * scales[:, None]`` (symmetric, per output row).

    ``x [M, in]`` with ``M <= INT8_MAX_ROWS`` goes through ``aten._weight_int8pack_mm``
    (bfloat16 activations); larger ``M`` through a dense matmul with ``dequantized`` (the same
    int8 values times the same scales, kept in bfloat16), so both paths compute with identical
    weights and only the kernel changes with the batch size.
    """

    qweight: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # [out], model dtype
    dequantized: torch.Tensor  # [out, in], model dtype

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype) -> Int8Linear:
        """Quantise a float32 ``weight [out, in]``; scales are rounded to ``dtype`` first."""
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(dtype)
        qweight = torch.round(weight / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        dequantized = (qweight.float() * scales.float()[:, None]).to(dtype)
        return cls(qweight.contiguous(), scales.contiguous(), dequantized.contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= INT8_MAX_ROWS:
            return torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.qweight, self.scales)
        return F.linear(x, self.dequantized)


Linear = DenseLinear | Int8Linear


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One transformer block. Matrices are ``[out_features, in_features]``.

    Attributes:
        attn_norm: ``[hidden]``.
        qkv: Q, K and V projections stacked: ``[(n_heads + 2 * n_kv_heads) * head_dim, hidden]``.
        attn_output: ``[hidden, n_heads * head_dim]``.
        ffn_norm: ``[hidden]``.
        gate_up: gate and up projections stacked: ``[2 * ffn, hidden]``.
        down: ``[hidden, ffn]``.
    """

    attn_norm: torch.Tensor
    qkv: Linear
    attn_output: Linear
    ffn_norm: torch.Tensor
    gate_up: Linear
    down: Linear


@dataclass(frozen=True, slots=True)
class LlamaWeights:
    """All weights of the model.

    Attributes:
        embedding: ``[vocab, hidden]`` in the model dtype, for the token lookup.
        lm_head: the same matrix as a projection (tied: the very tensor when unquantised, an
            int8 copy when the layers are int8).
    """

    embedding: torch.Tensor
    lm_head: Linear
    layers: tuple[LayerWeights, ...]
    output_norm: torch.Tensor

    @classmethod
    def from_gguf(
        cls,
        file: GGUFFile,
        hparams: LlamaHParams,
        *,
        dtype: torch.dtype,
        device: torch.device,
        quantization: Quantization = Quantization.NONE,
    ) -> LlamaWeights:
        """Dequantise every tensor to float32, fuse QKV and gate/up, then cast (or quantise to
        int8) and move.

        Raises:
            ValueError: the file has an untied ``output.weight``, or int8 without bfloat16.
        """
        if not hparams.tied_embeddings:
            raise ValueError("only tied embeddings (no output.weight) are supported")
        if quantization is Quantization.INT8 and dtype != torch.bfloat16:
            raise ValueError("int8 weights need dtype bfloat16 (the int8 kernel's activations)")

        def read(*names: str) -> torch.Tensor:
            arrays = [read_llama_tensor(file, name, hparams) for name in names]
            return torch.from_numpy(arrays[0] if len(arrays) == 1 else np.concatenate(arrays))

        def vector(name: str) -> torch.Tensor:
            return read(name).to(device=device, dtype=dtype).contiguous()

        def quantized(weight: torch.Tensor) -> Linear:
            if quantization is Quantization.INT8:
                return Int8Linear.quantize(weight.to(device), dtype)
            return DenseLinear(weight.to(device=device, dtype=dtype).contiguous())

        def linear(*names: str) -> Linear:
            return quantized(read(*names))

        layers = tuple(
            LayerWeights(
                attn_norm=vector(f"blk.{i}.attn_norm.weight"),
                qkv=linear(
                    f"blk.{i}.attn_q.weight", f"blk.{i}.attn_k.weight", f"blk.{i}.attn_v.weight"
                ),
                attn_output=linear(f"blk.{i}.attn_output.weight"),
                ffn_norm=vector(f"blk.{i}.ffn_norm.weight"),
                gate_up=linear(f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"),
                down=linear(f"blk.{i}.ffn_down.weight"),
            )
            for i in range(hparams.block_count)
        )
        embedding = vector("token_embd.weight")
        lm_head = (
            DenseLinear(embedding)  # tied: the same tensor
            if quantization is Quantization.NONE
            else quantized(read("token_embd.weight"))
        )
        return cls(
            embedding=embedding,
            lm_head=lm_head,
            layers=layers,
            output_norm=vector("output_norm.weight"),
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
        return (
            (slots[:, None] * kv_heads + heads[None, :]) * max_len + positions[:, None]
        ).flatten()

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

    ``mask`` is ``[1, 1, group_size * T, position + T]``, additive (see :func:`_additive_mask`).
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
        mask: ``[slot_stop - slot_start, 1, 1, key_length]``, additive; a slot of the
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
        dtype, device = cache.keys.dtype, cache.keys.device
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
            prefills.append(_plan_prefill(row, start, stop, group_size, dtype, device))
            start = stop
        position_tensor = as_tensor(positions)
        return cls(
            token_ids=as_tensor(token_ids),
            positions=position_tensor,
            cache_index=cache.write_index(as_tensor(slots), position_tensor),
            decode=_plan_decode(single, dtype, device) if single else None,
            prefills=tuple(prefills),
            logits_index=as_tensor([last_index[r.slot] for r in rows if r.want_logits]),
        )


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """0 where ``allowed``, -inf elsewhere, in the model dtype: built once per step so that SDPA
    does not convert a boolean mask in every layer. Every query row allows >= 1 key."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill_(~allowed, float("-inf")).to(device)


def _plan_decode(rows: Sequence[RowSpec], dtype: torch.dtype, device: torch.device) -> DecodeGroup:
    slot_start, slot_stop = rows[0].slot, rows[-1].slot + 1
    key_length = max(row.position + 1 for row in rows)
    lengths = torch.ones(slot_stop - slot_start, dtype=torch.int64)  # rowless slots: position 0
    offsets = [row.slot - slot_start for row in rows]
    lengths[offsets] = torch.tensor([row.position + 1 for row in rows])
    allowed = torch.arange(key_length)[None, :] < lengths[:, None]
    return DecodeGroup(
        count=len(rows),
        slot_start=slot_start,
        slot_stop=slot_stop,
        row_offsets=torch.tensor(offsets, dtype=torch.int64, device=device),
        key_length=key_length,
        mask=_additive_mask(allowed[:, None, None, :], dtype, device),
        dense=len(rows) == slot_stop - slot_start,
    )


def _plan_prefill(
    row: RowSpec,
    start: int,
    stop: int,
    group_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> PrefillGroup:
    length = stop - start
    key_length = row.position + length
    query_positions = torch.arange(row.position, key_length).repeat(group_size)
    allowed = torch.arange(key_length)[None, :] <= query_positions[:, None]
    return PrefillGroup(
        slot=row.slot,
        start=start,
        stop=stop,
        key_length=key_length,
        mask=_additive_mask(allowed[None, None], dtype, device),
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
        # [max_model_len, head_dim] each (see _apply_rope); computed in float64, stored in the
        # model dtype.
        self._rope_cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(device, dtype)
        self._rope_sin = torch.cat((-angles.sin(), angles.sin()), dim=-1).to(device, dtype)

    @property
    def quantization(self) -> Quantization:
        lm_head = self.weights.lm_head
        return Quantization.INT8 if isinstance(lm_head, Int8Linear) else Quantization.NONE

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
            qkv = layer.qkv(self._rms_norm(hidden, layer.attn_norm))
            qk = _apply_rope(qkv[:, :qk_width].view(num_tokens, -1, hp.head_dim), cos, sin)
            queries = qk[:, : hp.head_count]
            keys = qk[:, hp.head_count :]
            values = qkv[:, qk_width:].view(num_tokens, hp.head_count_kv, hp.head_dim)
            cache.write(index, plan.cache_index, keys, values)
            attended = self._attention(index, queries, plan, cache)
            hidden = hidden + layer.attn_output(attended)
            gate, up = layer.gate_up(self._rms_norm(hidden, layer.ffn_norm)).chunk(2, -1)
            hidden = hidden + layer.down(F.silu(gate) * up)
        if plan.logits_index.numel() == 0:  # only prompt chunks that sample nothing
            return hidden.new_empty((0, hp.vocab_size), dtype=torch.float32)
        last = self._rms_norm(hidden[plan.logits_index], w.output_norm)
        return w.lm_head(last).float()

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm accumulates bfloat16 input in float32 (as accurate as Hugging Face's
        # upcast-normalise-downcast order, and one op instead of four).
        return F.rms_norm(x, weight.shape, weight, self.hparams.rms_norm_eps)

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
    """Hugging Face rotary embedding on ``x [N, heads, D]``.

    ``cos`` is ``[N, 1, D]`` (the angle cosines repeated for both halves) and ``sin`` is
    ``[N, 1, D]`` with the first half negated, so that with ``swapped = (x2, x1)`` the result
    ``x * cos + swapped * sin`` is ``(x1 cos - x2 sin, x2 cos + x1 sin)``: pairs are
    ``(x[i], x[i + D/2])`` (``rotate_half``; see :mod:`app.models.gguf_file`).
    """
    rows, heads, head_dim = x.shape
    swapped = x.view(rows, heads, 2, head_dim // 2).flip(-2).view(rows, heads, head_dim)
    return torch.addcmul(x * cos, swapped, sin)
