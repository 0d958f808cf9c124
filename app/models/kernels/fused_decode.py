"""Fused CPU kernels for bfloat16 decode steps, built with the machine's C compiler at first
use into one library and called through :mod:`ctypes`.

The C source is split by job (``fused_decode.h`` lists the files): the bfloat16 arithmetic
the kernels share; the row-wise norms and activations and the greedy argmax; the decode
attention and its AVX-512 BF16 / AVX2 tiles; ``sl_decode_layers`` (every layer of a step in one
call, for models whose projections compute on GGUF blocks, see
:mod:`app.models.kernels.decoder_layout`); the sampler's draw from the whole vocabulary
(:mod:`app.models.sampling.fused_draw`).

Why: a one-row int4 decode step of SmolLM2 spent ~6 ms of ~15 in the ~20 small torch ops per
layer between the projections (two RMSNorms, rope, the K/V cache write, SDPA, silu, residual
adds; each a dispatch of a few microseconds of work, see docs/MODEL_PERF.md). These kernels do
the same work in four calls per layer: ``rms_norm`` twice (each with the residual add before
it), ``decode_attention`` (rope, K/V write and grouped-query attention of single-token rows,
reading and writing the paged cache through each row's block table in place, its (row, KV
head) pairs shared among torch's OpenMP threads) and ``silu_mul``: 0.69-0.84x the eager
step's time from 1 to 64 rows and from 40 to 2000 positions (docs/MODEL_PERF.md).

Building: :func:`app.models.kernels.build.build_library` (the one way every C library here is
built and cached), ``-march=native`` (narrowed by ``SLOTSERVE_GGML_ISA``). A missing compiler
or a failed build is not an error: :func:`load_fused_decode` says why; torch's path remains.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from app.models.forward.kv_cache import KV_BLOCK_SIZE
from app.models.kernels.build import KernelBuildError, build_library, torch_libgomp
from app.models.kernels.decoder_layout import DecoderLayout

SOURCE_DIR = Path(__file__).parent
# Every file of the library's source, in build order; the cache key hashes them all.
SOURCES = ("fused_decode.h", "fused_decode_norms.c", "fused_decode_attention.c")
SOURCES += ("fused_attention_tiles.c", "fused_attention_tiles_avx2.c", "fused_decode_layers.c")
SOURCES += ("fused_decode_sampling.c",)
# Built for this machine (the cache key holds the CPU): -march=native. -fno-trapping-math lets
# GCC vectorise the element-wise loops whose float selects (exp_approx's clamp, the NaN test of
# float_to_bf16) it otherwise keeps scalar for fear of a floating-point trap: silu_mul over
# 64 x 1536 values went from 1306 to ~100 us. No value changes (no reassociation, no
# contraction: -std=c11 keeps -ffp-contract=off), and no code here uses trap handlers.
CFLAGS = ("-march=native", "-fno-trapping-math")
# SLOTSERVE_GGML_ISA holds this library to the quantized kernels' forced instruction set.
ISA_CFLAGS = {"avx2": ("-mno-avx512f",), "scalar": ("-mno-avx",)}


def build_flags() -> tuple[str, ...]:
    """:data:`CFLAGS`, narrowed by ``SLOTSERVE_GGML_ISA``: ``-mno-avx512f`` drops every
    AVX-512 extension, ``-mno-avx`` AVX, AVX2 and FMA (other values: the flags as they are)."""
    forced = os.environ.get("SLOTSERVE_GGML_ISA", "").strip().lower()
    return CFLAGS + ISA_CFLAGS.get(forced, ())


# The attention kernel keeps a query group in fixed-size arrays (fused_decode_attention.c).
MAX_HEAD_DIM = 256
MAX_GROUP = 16
_LANES = 16

_c_void_p = ctypes.c_void_p
_c_int64 = ctypes.c_int64
_c_float = ctypes.c_float
_c_int = ctypes.c_int


@dataclass(frozen=True, slots=True)
class FusedDecodeKernels:
    """The loaded library. Every tensor passed in must be a CPU tensor of the dtype named
    (bfloat16 unless said otherwise), contiguous unless a row stride is taken. Each call checks
    its main input (``_check``); the head shapes are checked once, at load
    (:func:`check_attention_shapes`)."""

    library: ctypes.CDLL
    path: Path

    @staticmethod
    def _check(tensor: torch.Tensor) -> None:
        """The cheap half of memory safety, on each call's main input: bfloat16, rows
        contiguous. (Checking every argument's device and layout cost ~1.5 us a tensor, ~0.4 ms
        a step; the model's own tensors are CPU bfloat16 by construction, see
        ``fused_step.fused_decode_for``.)

        Raises:
            ValueError: it is not.
        """
        if tensor.dtype != torch.bfloat16 or tensor.stride(-1) != 1:
            raise ValueError(
                f"fused decode kernels take bfloat16 rows, contiguous; got {tensor.dtype} "
                f"with strides {tensor.stride()}"
            )

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        *,
        residual: torch.Tensor | None = None,
        threads: int = 1,
    ) -> torch.Tensor:
        """RMSNorm of ``x [rows, dim]``: ``x * rsqrt(mean(x^2) + eps)``, times ``weight [dim]``
        unless it is None (folded into the next projection). With ``residual [rows, dim]``,
        ``x += residual`` first, in place (``x`` becomes the new hidden state). Returns a new
        ``[rows, dim]`` tensor. ``threads``: the OpenMP threads that share the rows (from 4
        rows; each row is computed alone, so the values do not depend on it)."""
        rows, dim = x.shape
        self._check(x)
        out = torch.empty((rows, dim), dtype=torch.bfloat16)
        self.library.sl_rms_norm_rows(
            x.data_ptr(),
            x.stride(0),
            None if residual is None else residual.data_ptr(),
            None if weight is None else weight.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            eps,
            threads,
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor, *, threads: int = 1) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up [rows, 2 * ffn]`` -> ``[rows, ffn]``, the rows
        shared by ``threads`` as in :meth:`rms_norm`."""
        return self._activated(gate_up, gelu_tanh=False, threads=threads)

    def gelu_tanh_mul(self, gate_up: torch.Tensor, *, threads: int = 1) -> torch.Tensor:
        """``gelu_tanh(gate) * up`` (GELU's tanh approximation, Gemma's MLP) for
        ``gate_up [rows, 2 * ffn]`` -> ``[rows, ffn]``, the rows shared by ``threads``."""
        return self._activated(gate_up, gelu_tanh=True, threads=threads)

    def _activated(self, gate_up: torch.Tensor, *, gelu_tanh: bool, threads: int) -> torch.Tensor:
        rows, width = gate_up.shape
        self._check(gate_up)
        out = torch.empty((rows, width // 2), dtype=torch.bfloat16)
        self.library.sl_activate_rows(
            gate_up.data_ptr(), out.data_ptr(), rows, width // 2, int(gelu_tanh), threads
        )
        return out

    def argmax_rows(self, logits: torch.Tensor, *, threads: int = 1) -> torch.Tensor:
        """``logits.argmax(dim=-1)`` for ``logits [rows, vocab]`` bfloat16 or float32 with a
        unit column stride: int64 ``[rows]``, the first index of each row's maximum (NaN the
        largest, as torch), the rows shared by ``threads``.

        Raises:
            ValueError: another dtype or layout.
        """
        arguments = logits_arguments(logits, "argmax")
        out = torch.empty(len(logits), dtype=torch.int64)
        self.library.sl_argmax_rows(*arguments, out.data_ptr(), threads)
        return out

    def decode_attention(
        self,
        qkv: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scores: torch.Tensor,
        *,
        n_heads: int,
        n_kv_heads: int,
        threads: int = 1,
        qk_norm: torch.Tensor | None = None,
        eps: float = 0.0,
        window: int = 0,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Rope, K/V cache write and attention for single-token rows.

        Args:
            qkv: ``[rows, (n_heads + 2 * n_kv_heads) * head_dim]``, the QKV projection.
            rope_cos, rope_sin: ``[max_positions, head_dim]`` (``DecoderModel``'s tables,
                :mod:`app.models.forward.rope`).
            positions: ``[rows]`` int64; each row's position.
            block_tables: ``[rows, blocks]`` int64, contiguous: each row's block table
                (:class:`app.models.base.KVBlocks`), covering its position.
            keys, values: one layer of the paged cache, ``[n_kv_heads, num_blocks *
                block_size, head_dim]`` (:class:`app.models.forward.kv_cache.KVCache`).
            scores: float32 workspace, ``[threads, n]`` with ``n >= n_heads / n_kv_heads *
                (max(positions) + 1)``.
            threads: OpenMP threads sharing the (row, KV head) pairs, split by the positions
                they attend (one long row's heads too; calls of fewer than 512 positions stay
                on one thread); the outputs are the same whatever the split. They come from
                the process's OpenMP runtime, which is torch's (its ``libgomp.so.1`` is
                loaded first), so they are torch's own idle intra-op threads.
            qk_norm: None, or ``[n_heads + n_kv_heads, head_dim]``, the per-head RMSNorm weights
                of the query heads then the key heads (Qwen3; ``LayerWeights.qk_norm``: one
                ``q_norm`` row repeated, then one ``k_norm`` row repeated), applied before rope
                with epsilon ``eps``.
            window: 0, or a sliding window: a row attends to the ``window`` positions up to its
                own (Gemma 3's local layers).
            scale: the scores' factor (None: ``1 / sqrt(head_dim)``).

        Returns:
            ``[rows, n_heads * head_dim]`` attention output (before the output projection).
        """
        rows = qkv.shape[0]
        head_dim = keys.shape[-1]
        self._check(qkv)
        q_norm = k_norm = None
        if qk_norm is not None:
            if qk_norm.shape != (n_heads + n_kv_heads, head_dim):
                raise ValueError(f"qk_norm {tuple(qk_norm.shape)} for {n_heads}+{n_kv_heads} heads")
            self._check(qk_norm)
            q_norm, k_norm = qk_norm[0].data_ptr(), qk_norm[n_heads].data_ptr()
        out = torch.empty((rows, n_heads * head_dim), dtype=torch.bfloat16)
        self.library.sl_decode_attention(
            qkv.data_ptr(),
            qkv.stride(0),
            rope_cos.data_ptr(),
            rope_sin.data_ptr(),
            positions.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            keys.data_ptr(),
            values.data_ptr(),
            keys.shape[1],
            KV_BLOCK_SIZE,
            scores.data_ptr(),
            scores.shape[-1],
            out.data_ptr(),
            rows,
            n_heads,
            n_kv_heads,
            head_dim,
            min(threads, scores.shape[0]) if scores.dim() == 2 else 1,
            q_norm,
            k_norm,
            eps,
            window,
            scale or 0.0,
        )
        return out

    def decode_layers(
        self,
        layout: DecoderLayout,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        scores: torch.Tensor,
        *,
        threads: int,
    ) -> None:
        """Every decoder layer of a step of single-token rows in one call (``sl_decode_layers``):
        what :meth:`rms_norm`, the GGUF-block projections, :meth:`decode_attention` and
        :meth:`silu_mul` compute layer by layer, in the same order, bit for bit.

        Args:
            layout: the model's layers (:func:`decoder_layout`).
            hidden: ``[rows, hidden]`` bfloat16, contiguous: the embedded tokens; overwritten
                with the last layer's residual sum (before the output norm).
            positions, block_tables, scores: as :meth:`decode_attention` takes them.
            threads: OpenMP threads of the projections (the attention's: ``scores.shape[0]``).

        Raises:
            ValueError: ``hidden`` is not bfloat16 rows of the model's width, or a projection
                refused its arguments.
        """
        rows = hidden.shape[0]
        self._check(hidden)
        if (
            hidden.dim() != 2
            or hidden.shape[1] != layout.decoder.hidden
            or not hidden.is_contiguous()
        ):
            raise ValueError(f"hidden {tuple(hidden.shape)} for width {layout.decoder.hidden}")
        layout.decoder.threads = threads
        workspace = torch.empty(
            self.library.sl_decode_layers_workspace(layout.pointer, rows), dtype=torch.bfloat16
        )
        status = self.library.sl_decode_layers(
            layout.pointer,
            hidden.data_ptr(),
            rows,
            positions.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            scores.data_ptr(),
            scores.shape[-1],
            scores.shape[0],
            workspace.data_ptr(),
        )
        if status != 0:
            raise ValueError(f"a GGUF-block projection refused its arguments ({status})")


def check_attention_shapes(n_heads: int, n_kv_heads: int, head_dim: int) -> str | None:
    """Why ``decode_attention`` cannot serve these head shapes, or None when it can."""
    if n_heads % n_kv_heads:
        return f"{n_heads} query heads are not a multiple of {n_kv_heads} KV heads"
    if n_heads // n_kv_heads > MAX_GROUP:
        return f"query group {n_heads // n_kv_heads} > {MAX_GROUP}"
    if head_dim > MAX_HEAD_DIM or head_dim % _LANES:
        return f"head_dim {head_dim} is not a multiple of {_LANES} up to {MAX_HEAD_DIM}"
    return None


def logits_arguments(logits: torch.Tensor, what: str) -> tuple[int, int, int, int, int]:
    """The C arguments of ``logits [rows, vocab]`` (bfloat16 or float32, a unit column
    stride): its address, whether it is bfloat16, rows, vocab and the row stride in elements.
    Raises ValueError for another dtype or layout (``what`` names the caller)."""
    if logits.dtype not in (torch.bfloat16, torch.float32) or logits.stride(-1) != 1:
        raise ValueError(
            f"{what} takes bfloat16 or float32 rows with a unit column stride; got "
            f"{logits.dtype} with strides {logits.stride()}"
        )
    rows, vocab = logits.shape
    return logits.data_ptr(), int(logits.dtype == torch.bfloat16), rows, vocab, logits.stride(0)


def _declare(library: ctypes.CDLL) -> None:
    # x, its row stride, residual, weight, out, rows, dim; then eps, threads
    norm_args = [_c_void_p, _c_int64, _c_void_p, _c_void_p, _c_void_p, _c_int64, _c_int64]
    library.sl_rms_norm_rows.argtypes = [*norm_args, _c_float, _c_int64]
    library.sl_activate_rows.argtypes = [_c_void_p, _c_void_p, _c_int64, _c_int64, _c_int, _c_int64]
    library.sl_rms_norm_rows.restype = library.sl_activate_rows.restype = None
    # logits, is_bf16, rows, n, stride, out, threads
    argmax_args = [_c_void_p, _c_int, _c_int64, _c_int64, _c_int64, _c_void_p, _c_int64]
    library.sl_argmax_rows.argtypes = argmax_args
    library.sl_argmax_rows.restype = None
    # the logits' 5, then temperature, top_k, top_p, min_p, uniform, out, threads
    library.sl_sample_rows.argtypes = [*argmax_args[:5], *[_c_void_p] * 6, _c_int64]
    library.sl_sample_rows.restype = _c_int
    library.sl_decode_attention.argtypes = [
        _c_void_p,  # qkv
        _c_int64,  # qkv_stride
        _c_void_p,  # rope_cos
        _c_void_p,  # rope_sin
        _c_void_p,  # positions
        _c_void_p,  # block_tables
        _c_int64,  # table_stride
        _c_void_p,  # keys
        _c_void_p,  # values
        _c_int64,  # pool_len
        _c_int64,  # block_size
        _c_void_p,  # scores
        _c_int64,  # scores_per_thread
        _c_void_p,  # out
        _c_int64,  # rows
        _c_int64,  # n_heads
        _c_int64,  # n_kv_heads
        _c_int64,  # head_dim
        _c_int64,  # threads
        _c_void_p,  # q_norm
        _c_void_p,  # k_norm
        _c_float,  # eps
        _c_int64,  # window
        _c_float,  # scale
    ]
    library.sl_decode_attention.restype = None
    library.sl_decode_layers.argtypes = [
        _c_void_p,  # model (sl_decoder *)
        _c_void_p,  # hidden
        _c_int64,  # rows
        _c_void_p,  # positions
        _c_void_p,  # block_tables
        _c_int64,  # table_stride
        _c_void_p,  # scores
        _c_int64,  # scores_per_thread
        _c_int64,  # attention_threads
        _c_void_p,  # workspace
    ]
    library.sl_decode_layers.restype = ctypes.c_int
    library.sl_decode_layers_workspace.argtypes = [_c_void_p, _c_int64]
    library.sl_decode_layers_workspace.restype = _c_int64


@functools.cache
def load_fused_decode() -> tuple[FusedDecodeKernels | None, str]:
    """Build (once per machine, cached on disk) and load the kernels.

    Returns ``(kernels, how)``: the kernels, or None with the reason they are not available
    (no C compiler, a build error); ``how`` is said in the
    server's start-up log. Never raises.
    """
    try:
        flags = build_flags()
        library, target, threaded = build_library("fused_decode", SOURCE_DIR, SOURCES, flags)
        _declare(library)
    except KernelBuildError as error:
        return None, str(error)
    except AttributeError as error:  # a library without the functions declared
        return None, f"build or load failed: {error}"
    threads = "one thread"
    if threaded:
        threads = f"attention on torch's OpenMP threads ({torch_libgomp()})"
    return FusedDecodeKernels(library, target), f"fused decode kernels ({target}; {threads})"
