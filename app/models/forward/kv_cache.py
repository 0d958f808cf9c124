"""The paged KV cache: keys and values of every sequence in one pool of fixed-size blocks.

Ownership (rules R12, R05): the cache stores tensors only. Which block holds which positions of
which sequence is the scheduler's block manager's (:mod:`app.engine.kv_blocks`); each row of a
step brings its block table (:class:`app.models.base.KVBlocks`) and the forward writes and reads
through it (:class:`app.models.forward.forward_plan.ForwardPlan` turns tables into tensor indices).

Layout: per layer ``[n_kv_heads, num_blocks * KV_BLOCK_SIZE, head_dim]``, so the positions of one
block of one head are contiguous rows, and gathering a sequence's keys for one head is one
``index_select`` over the position axis. Block 0 is the null block: never handed out, it pads
block tables, so a padded table entry names finite memory that the mask hides.
"""

from __future__ import annotations

import math
import mmap

import torch

from app.models.hparams import HParams

# Batch invariance (API.md: a seeded request gets the same tokens whatever else is in the batch).
# Measured on the 2-core CPU (torch 2.13, docs/MODEL_PERF.md, "Batch invariance"):
# * matmuls: see app.models.weights.projections (``exact_rows``).
# * SDPA's CPU kernel gives a query row the same result whatever the batch and however long the
#   padded key axis, *provided* the key axis is a multiple of 16: a row whose real keys end in a
#   partial vector of 16 is reduced differently. Key lengths are padded to ``KEY_ALIGN`` (16:
#   AVX-512's float32 lanes, a multiple of AVX2's 8), which makes prefill chunk boundaries
#   invisible too and gives a one-token row the same result as the same position inside a
#   prompt chunk.
KEY_ALIGN = 16

# Positions per KV block. Equal to KEY_ALIGN, so the keys of a row's whole blocks are exactly its
# KEY_ALIGN-padded key axis (attention gathers whole blocks), and a prefix-cache hit, always a
# whole number of blocks, starts the rest of the prompt at a multiple of KEY_ALIGN: where a
# prefill chunk boundary may fall without changing a seeded request's tokens. 16 is also vLLM's
# default; smaller blocks would share more of a prompt but cost more table entries per step.
KV_BLOCK_SIZE = KEY_ALIGN

# Without --kv-cache-memory the pool holds this many sequences of max_model_len positions, or
# one per slot if there are more slots (what the per-slot cache held before it was paged).
DEFAULT_POOL_SEQUENCES = 16


def align_keys(length: int) -> int:
    """``length`` (positions) rounded up to a multiple of ``KEY_ALIGN``."""
    return -(-length // KEY_ALIGN) * KEY_ALIGN


def blocks_for(num_positions: int) -> int:
    """Blocks of ``KV_BLOCK_SIZE`` that hold ``num_positions`` positions."""
    return -(-num_positions // KV_BLOCK_SIZE)


def _lazily_zeroed(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A zero tensor whose memory, on the CPU, is a private anonymous mapping: the OS hands out
    zeroed pages on first touch, so the resident memory of a KV cache grows with the blocks
    actually written rather than with the pool at start-up. Huge pages are declined
    (``MADV_NOHUGEPAGE``): one 2 MiB page would make a whole stretch of other blocks resident
    as soon as one of them is written."""
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
    """Keys and values of every block of the pool, preallocated once.

    ``keys`` and ``values`` are ``[num_layers, n_kv_heads, num_blocks * KV_BLOCK_SIZE,
    head_dim]`` tensors of the model dtype on the model device. Bytes per block:
    ``2 * num_layers * n_kv_heads * KV_BLOCK_SIZE * head_dim * itemsize`` (SmolLM2: 0.70 MiB in
    float32, 0.35 MiB in bfloat16; :func:`kv_block_bytes`).

    Args:
        num_blocks: blocks in the pool, the null block 0 included; None: ``max_num_seqs``
            sequences of ``max_model_len`` positions plus the null block.
        max_num_seqs, max_model_len: slot ``s < max_num_seqs`` has the fixed blocks
            :meth:`slot_blocks` gives, where the pool holds them: the table of a row that
            brings none (tests and scripts that step the forward without a block manager).

    The cache stores tensors only. It is zero at allocation (lazily, on the CPU: see
    :func:`_lazily_zeroed`) and never cleared again: a masked-out position gets attention weight
    0, but ``0 * NaN`` would still be NaN, so never-written memory must hold finite values;
    stale values of a freed block are finite and are never unmasked (a block's positions are
    read only up to the row's own length).

    Raises:
        ValueError: fewer than 2 blocks.
    """

    block_size = KV_BLOCK_SIZE

    def __init__(
        self,
        hparams: HParams,
        *,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int | None = None,
        max_num_seqs: int = 0,
        max_model_len: int = 0,
    ) -> None:
        self._blocks_per_slot = blocks_for(max_model_len)
        if num_blocks is None:
            num_blocks = 1 + max_num_seqs * self._blocks_per_slot
        if num_blocks < 2:
            raise ValueError(f"a KV cache needs >= 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        shape = (
            hparams.block_count,
            hparams.head_count_kv,
            num_blocks * KV_BLOCK_SIZE,
            hparams.head_dim,
        )
        self.keys = _lazily_zeroed(shape, dtype, device)
        self.values = _lazily_zeroed(shape, dtype, device)

    @property
    def bytes_per_block(self) -> int:
        layers, heads, _, head_dim = self.keys.shape
        return 2 * layers * heads * KV_BLOCK_SIZE * head_dim * self.keys.element_size()

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    def slot_blocks(self, slot: int) -> range:
        """The fixed blocks of ``slot`` in a cache made from ``max_num_seqs`` (see Args)."""
        first = 1 + slot * self._blocks_per_slot
        if self._blocks_per_slot == 0 or first + self._blocks_per_slot > self.num_blocks:
            raise ValueError(f"slot {slot} has no fixed blocks in this cache")
        return range(first, first + self._blocks_per_slot)

    def write_index(self, flat_positions: torch.Tensor) -> torch.Tensor:
        """Rows of a layer's ``[n_kv_heads * num_blocks * KV_BLOCK_SIZE, head_dim]`` view for
        ``[N]`` tokens at pool positions ``block * KV_BLOCK_SIZE + offset`` (``flat_positions``,
        int64).

        Returns ``[N * n_kv_heads]`` int64, token-major (the order of ``keys.reshape(-1, D)``
        for keys ``[N, n_kv_heads, D]``).
        """
        _, kv_heads, pool_len, _ = self.keys.shape
        heads = torch.arange(kv_heads, device=flat_positions.device)
        return (heads[None, :] * pool_len + flat_positions[:, None]).flatten()

    def write(
        self, layer: int, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store ``keys``/``values [N, n_kv_heads, D]`` at the rows :meth:`write_index` gave."""
        head_dim = self.keys.shape[-1]
        self.keys[layer].view(-1, head_dim).index_copy_(0, index, keys.reshape(-1, head_dim))
        self.values[layer].view(-1, head_dim).index_copy_(0, index, values.reshape(-1, head_dim))

    def gather(
        self, layer: int, flat_positions: torch.Tensor, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[rows, n_kv_heads, L, head_dim]`` at ``flat_positions [rows * L]``
        (pool positions, row-major), for SDPA. One copy per tensor; the result is a
        transposed view of it (each ``[L, head_dim]`` slab contiguous)."""
        keys = self.keys[layer].index_select(1, flat_positions)
        values = self.values[layer].index_select(1, flat_positions)
        heads, _, head_dim = keys.shape
        shape = (heads, rows, -1, head_dim)
        return keys.view(shape).transpose(0, 1), values.view(shape).transpose(0, 1)


def kv_block_bytes(hparams: HParams, *, dtype: torch.dtype) -> int:
    """Bytes of one block (keys and values of ``KV_BLOCK_SIZE`` positions, every layer)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_position = 2 * hparams.block_count * hparams.head_count_kv * hparams.head_dim * itemsize
    return per_position * KV_BLOCK_SIZE


def pool_blocks(
    setting: int | float | None,
    *,
    bytes_per_block: int,
    max_model_len: int,
    max_num_seqs: int,
    available: int,
) -> int:
    """Blocks of the pool (the null block included) for ``--kv-cache-memory``: ``setting``
    bytes, a fraction of ``available`` bytes, or None (``max(max_num_seqs,
    DEFAULT_POOL_SEQUENCES)`` sequences of ``max_model_len`` positions: what the per-slot cache
    held before it was paged).

    Raises:
        ValueError: the pool would not hold one sequence of ``max_model_len`` positions.
    """
    if setting is None:
        usable = max(max_num_seqs, DEFAULT_POOL_SEQUENCES) * blocks_for(max_model_len)
    else:
        size = int(setting * available) if isinstance(setting, float) else setting
        usable = size // bytes_per_block
    if usable < blocks_for(max_model_len):
        need = blocks_for(max_model_len) * bytes_per_block
        raise ValueError(
            f"--kv-cache-memory gives {usable} KV blocks of {KV_BLOCK_SIZE} positions, fewer than "
            f"one sequence of --max-model-len {max_model_len} needs "
            f"({blocks_for(max_model_len)} blocks, {need / 2**20:.1f} MiB)"
        )
    return usable + 1


def kv_cache_bytes(
    hparams: HParams, *, max_num_seqs: int, max_model_len: int, dtype: torch.dtype
) -> int:
    """Bytes of a per-slot cache of ``max_num_seqs`` x ``max_model_len`` positions (for the
    figures that compare the pool with it)."""
    return kv_block_bytes(hparams, dtype=dtype) * blocks_for(max_model_len) * max_num_seqs
