"""Q4_K, Q5_K and Q6_K quantisers for the test GGUF writer (``gguf.quants`` only dequantises them).

Block layouts are ggml's (``ggml-common.h``), checked here against ``gguf.quants.dequantize``,
which is the decoder every GGUF reader in this project (and transformers') goes through:

* **Q4_K**, 256 weights in 144 bytes: fp16 ``d``, fp16 ``dmin``, 12 bytes of packed 6-bit
  sub-block scales ``sc[8]`` and minima ``m[8]``, then 128 bytes of 4-bit codes. Sub-block ``j``
  (32 weights) decodes as ``d * sc[j] * q - dmin * m[j]``. Scale bytes 0-3 hold ``sc[0..3]`` in
  their low 6 bits and bits 4-5 of ``sc[4..7]`` on top; bytes 4-7 the same for ``m``; bytes 8-11
  hold the low 4 bits of ``sc[4..7]`` (low nibble) and of ``m[4..7]`` (high nibble). Code byte
  ``32 * i + k`` holds sub-block ``2i``'s weight ``k`` in its low nibble and sub-block
  ``2i + 1``'s in its high nibble.
* **Q5_K**, 256 weights in 176 bytes: fp16 ``d``, fp16 ``dmin``, the 12 scale bytes of Q4_K,
  32 bytes ``qh``, then 128 bytes of low nibbles laid out as Q4_K's codes. Codes are 5-bit
  (``0..31``) and decode as Q4_K's; bit ``j`` of ``qh[k]`` is bit 4 of sub-block ``j``'s
  weight ``k``.
* **Q6_K**, 256 weights in 210 bytes: 128 bytes ``ql`` (low 4 bits of the codes), 64 bytes ``qh``
  (high 2 bits), 16 int8 sub-block scales, fp16 ``d``. Sub-block ``j`` (16 weights) decodes as
  ``d * scale[j] * (q - 32)`` with ``q`` in ``0..63``. In each half ``h`` of the block,
  ``ql[64h + k]`` holds weight ``128h + k`` (low nibble) and ``128h + 64 + k`` (high nibble);
  ``qh[32h + k]`` holds bits 4-5 of weights ``128h + 32s + k`` at bits ``2s``, ``s = 0..3``.

The scales are chosen the simple way (per sub-block min/max, then the sub-block scales rounded
onto the super-block's fp16 scale), not with llama.cpp's iterative search: the files decode to
slightly different values than ``llama-quantize`` would write, which is fine for tests that
compare a reader against ``gguf.quants.dequantize`` of the same bytes.
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # weights per K-quant super-block


def _blocks(weights: np.ndarray) -> np.ndarray:
    """``weights`` (any shape whose last dimension is a multiple of 256) as ``[n, 256]`` f32."""
    if weights.shape[-1] % QK_K:
        raise ValueError(f"a K-quant row needs a multiple of {QK_K} values, got {weights.shape}")
    return np.asarray(weights, dtype=np.float32).reshape(-1, QK_K)


def _fp16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def _scales_mins_codes(blocks: np.ndarray, top: int):
    """Q4_K / Q5_K: fp16 ``d``, ``dmin`` ``[n]``, 6-bit ``sc``, ``m`` ``[n, 8]`` and codes
    ``0..top`` ``[n, 8, 32]`` of ``[n, 256]`` blocks (per sub-block min/max)."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)  # [n, 8], <= 0
    high = np.maximum(sub.max(axis=-1), 0.0)
    sub_scale = (high - low) / float(top)
    sub_min = -low  # >= 0
    d = _fp16(sub_scale.max(axis=-1) / 63.0)  # [n]
    dmin = _fp16(sub_min.max(axis=-1) / 63.0)
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32[:, None] > 0, np.rint(sub_scale / d32[:, None]), 0)
        m = np.where(dmin32[:, None] > 0, np.rint(sub_min / dmin32[:, None]), 0)
    sc = np.clip(sc, 0, 63).astype(np.uint8)
    m = np.clip(m, 0, 63).astype(np.uint8)
    scale = (d32[:, None] * sc)[:, :, None]  # what the decoder will use
    offset = (dmin32[:, None] * m)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(scale > 0, np.rint((sub + offset) / scale), 0)
    codes = np.clip(codes, 0, top).astype(np.uint8)  # [n, 8, 32]
    return d, dmin, sc, m, codes


def _pack_scales_mins(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 scale bytes of Q4_K / Q5_K from 6-bit ``sc``, ``m`` ``[n, 8]``."""
    packed = np.empty((sc.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    return packed


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """128 bytes of Q4_K's code layout from the low 4 bits of codes ``[n, 8, 32]``."""
    pairs = (codes & 0x0F).reshape(codes.shape[0], 4, 2, 32)
    return (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(codes.shape[0], 128)


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """Q4_K blocks of ``weights``: uint8 ``[*weights.shape[:-1], weights.shape[-1] // 256 * 144]``.

    Raises:
        ValueError: the last dimension is not a multiple of 256.
    """
    blocks = _blocks(weights)
    n = blocks.shape[0]
    d, dmin, sc, m, codes = _scales_mins_codes(blocks, 15)
    out = np.concatenate(
        [
            d.reshape(n, 1).view(np.uint8),
            dmin.reshape(n, 1).view(np.uint8),
            _pack_scales_mins(sc, m),
            _pack_nibbles(codes),
        ],
        axis=-1,
    )
    return out.reshape(*weights.shape[:-1], weights.shape[-1] // QK_K * 144)


def quantize_q5_k(weights: np.ndarray) -> np.ndarray:
    """Q5_K blocks of ``weights``: uint8 ``[*weights.shape[:-1], weights.shape[-1] // 256 * 176]``.

    Raises:
        ValueError: the last dimension is not a multiple of 256.
    """
    blocks = _blocks(weights)
    n = blocks.shape[0]
    d, dmin, sc, m, codes = _scales_mins_codes(blocks, 31)
    # qh[k]: bit j = bit 4 of sub-block j's weight k.
    bit4 = (codes >> 4).astype(np.uint8)  # [n, 8, 32]
    qh = np.zeros((n, 32), dtype=np.uint8)
    for j in range(8):
        qh |= bit4[:, j, :] << j
    out = np.concatenate(
        [
            d.reshape(n, 1).view(np.uint8),
            dmin.reshape(n, 1).view(np.uint8),
            _pack_scales_mins(sc, m),
            qh,
            _pack_nibbles(codes),
        ],
        axis=-1,
    )
    return out.reshape(*weights.shape[:-1], weights.shape[-1] // QK_K * 176)


def quantize_q6_k(weights: np.ndarray) -> np.ndarray:
    """Q6_K blocks of ``weights``: uint8 ``[*weights.shape[:-1], weights.shape[-1] // 256 * 210]``.

    Raises:
        ValueError: the last dimension is not a multiple of 256.
    """
    blocks = _blocks(weights)
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    sub_scale = np.abs(sub).max(axis=-1) / 31.0  # codes - 32 span -32..31
    d = _fp16(sub_scale.max(axis=-1) / 127.0)
    d32 = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32[:, None] > 0, np.rint(sub_scale / d32[:, None]), 0)
    sc = np.clip(sc, -128, 127).astype(np.int8)
    scale = (d32[:, None] * sc.astype(np.float32))[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        signed = np.where(scale != 0, np.rint(sub / scale), 0)
    codes = (np.clip(signed, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)

    ql = (codes[:, :, 0:64] & 0x0F) | ((codes[:, :, 64:128] & 0x0F) << 4)  # [n, 2, 64]
    high = (codes >> 4).reshape(n, 2, 4, 32)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)

    out = np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.reshape(n, 1).view(np.uint8)],
        axis=-1,
    )
    return out.reshape(*weights.shape[:-1], weights.shape[-1] // QK_K * 210)
