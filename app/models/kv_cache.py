"""The KV cache: keys and values of every slot, preallocated once, lazily zeroed.

Ownership (rule R12): the cache stores tensors only. Which positions of a slot are valid is the
runner's bookkeeping (:class:`app.models.runner.ModelRunner`), passed to the forward through
:class:`app.models.forward_plan.ForwardPlan`; the forward writes each step's keys and values
where the plan says.
"""

from __future__ import annotations

import math
import mmap

import torch

from app.models.hparams import HParams

# Batch invariance (API.md: a seeded request gets the same tokens whatever else is in the batch).
# Measured on the 2-core CPU (torch 2.13, docs/MODEL_PERF.md, "Batch invariance"):
# * matmuls: see app.models.projections (``exact_rows``).
# * SDPA's CPU kernel gives a query row the same result whatever the batch and however long the
#   padded key axis, *provided* the key axis is a multiple of 16: a row whose real keys end in a
#   partial vector of 16 is reduced differently. Key lengths are padded to ``KEY_ALIGN`` (16:
#   AVX-512's float32 lanes, a multiple of AVX2's 8), which makes prefill chunk boundaries
#   invisible too and gives a one-token row the same result as the same position inside a
#   prompt chunk.
KEY_ALIGN = 16


def align_keys(length: int) -> int:
    """``length`` (positions) rounded up to a multiple of ``KEY_ALIGN``."""
    return -(-length // KEY_ALIGN) * KEY_ALIGN


def _lazily_zeroed(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A zero tensor whose memory, on the CPU, is a private anonymous mapping: the OS hands out
    zeroed pages on first touch, so the resident memory of a KV cache grows with the positions
    actually written rather than with ``max_model_len`` at start-up. Huge pages are declined
    (``MADV_NOHUGEPAGE``): one 2 MiB page would make a whole stretch of other slots resident
    as soon as one of them writes its first position."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = max(1, numel * torch.empty((), dtype=dtype).element_size())
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive
    return raw[: nbytes if numel else 0].view(dtype).view(shape)


class KVCache:
    """Keys and values of every slot, preallocated once.

    ``keys`` and ``values`` are ``[num_layers, max_num_seqs, n_kv_heads, align_keys(max_model_len),
    head_dim]`` tensors of the model dtype on the model device, so one slot's one head is a
    contiguous ``[max_model_len, head_dim]`` block (what attention reads). Bytes per slot:
    ``2 * num_layers * n_kv_heads * max_model_len * head_dim * itemsize`` (SmolLM2, 2048
    positions: 90 MiB in float32, 45 MiB in bfloat16; :func:`kv_cache_bytes`).

    The cache stores tensors only: which positions of a slot are valid is the runner's
    bookkeeping, passed in through :class:`app.models.forward_plan.ForwardPlan`. It is zero at
    allocation (lazily, on the CPU: see :func:`_lazily_zeroed`) and never cleared again: a
    masked-out position gets attention weight 0, but ``0 * NaN`` would still be NaN, so
    never-written memory must hold finite values; stale values from a previous occupant are
    finite and are masked out.
    """

    def __init__(
        self,
        hparams: HParams,
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
            align_keys(max_model_len),  # attention reads whole KEY_ALIGN blocks
            hparams.head_dim,
        )
        self.keys = _lazily_zeroed(shape, dtype, device)
        self.values = _lazily_zeroed(shape, dtype, device)

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


def kv_cache_bytes(
    hparams: HParams, *, max_num_seqs: int, max_model_len: int, dtype: torch.dtype
) -> int:
    """Bytes of a :class:`KVCache` with every position written (what it holds at most)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_position = 2 * hparams.block_count * hparams.head_count_kv * hparams.head_dim * itemsize
    return per_position * align_keys(max_model_len) * max_num_seqs
