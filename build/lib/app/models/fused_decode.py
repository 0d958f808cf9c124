"""Fused CPU kernels for small bfloat16 decode steps (``fused_decode.c``), built with the
machine's C compiler at first use and called through :mod:`ctypes`.

Why: a one-row int4 decode step of SmolLM2 spends ~6 ms of ~15 in the ~20 small torch ops per
layer between the projections (two RMSNorms, rope, the K/V cache write, SDPA, silu, residual
adds; each a dispatch of a few microseconds of work, see docs/MODEL_PERF.md). These kernels do
the same work in three calls per layer: ``rms_norm`` (with the residual add before it),
``decode_attention`` (rope, K/V write and grouped-query attention of single-token rows) and
``silu_mul``. They are single-threaded and meant for steps of a few rows, where that glue, not
the weights, is what the step waits on.

Building: ``cc -O3 -march=native -shared -fPIC`` into ``$SLOTSERVE_CACHE_DIR`` (default
``~/.cache/slotserve``), named by a hash of the source, the flags, the compiler's version and
the CPU's model and flags, so a copied cache from another machine is never loaded. A missing
compiler or a failed build is not an error: :func:`load_fused_decode` says why and the model
keeps its eager torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fused_decode.c")
CFLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c11")
# The attention kernel keeps a query group in fixed-size arrays (fused_decode.c).
MAX_HEAD_DIM = 256
MAX_GROUP = 16
_LANES = 16

_c_void_p = ctypes.c_void_p
_c_int64 = ctypes.c_int64
_c_float = ctypes.c_float


@dataclass(frozen=True, slots=True)
class FusedDecodeKernels:
    """The loaded library. Every tensor passed in must be a contiguous CPU tensor of the dtype
    named (bfloat16 unless said otherwise); the functions check shapes only as far as memory
    safety needs (see :func:`check_attention_shapes`)."""

    library: ctypes.CDLL
    path: Path

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        *,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """RMSNorm of ``x [rows, dim]``: ``x * rsqrt(mean(x^2) + eps)``, times ``weight [dim]``
        unless it is None (folded into the next projection). With ``residual [rows, dim]``,
        ``x += residual`` first, in place (``x`` becomes the new hidden state). Returns a new
        ``[rows, dim]`` tensor."""
        rows, dim = x.shape
        out = torch.empty((rows, dim), dtype=torch.bfloat16)
        self.library.sl_rms_norm(
            x.data_ptr(),
            x.stride(0),
            None if residual is None else residual.data_ptr(),
            None if weight is None else weight.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            eps,
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up [rows, 2 * ffn]`` -> ``[rows, ffn]``."""
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=torch.bfloat16)
        self.library.sl_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
        return out

    def decode_attention(
        self,
        qkv: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scores: torch.Tensor,
        *,
        n_heads: int,
        n_kv_heads: int,
    ) -> torch.Tensor:
        """Rope, K/V cache write and attention for single-token rows.

        Args:
            qkv: ``[rows, (n_heads + 2 * n_kv_heads) * head_dim]``, the QKV projection.
            rope_cos, rope_sin: ``[max_positions, head_dim]`` (``LlamaModel``'s tables).
            positions, slots: ``[rows]`` int64; each row's position and cache slot.
            keys, values: one layer of the cache, ``[slots, n_kv_heads, cache_len, head_dim]``.
            scores: float32 workspace of at least ``n_heads / n_kv_heads * (max(positions) +
                1)`` elements.

        Returns:
            ``[rows, n_heads * head_dim]`` attention output (before the output projection).
        """
        rows = qkv.shape[0]
        head_dim = keys.shape[-1]
        out = torch.empty((rows, n_heads * head_dim), dtype=torch.bfloat16)
        self.library.sl_decode_attention(
            qkv.data_ptr(),
            qkv.stride(0),
            rope_cos.data_ptr(),
            rope_sin.data_ptr(),
            positions.data_ptr(),
            slots.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            keys.shape[2],
            scores.data_ptr(),
            out.data_ptr(),
            rows,
            n_heads,
            n_kv_heads,
            head_dim,
        )
        return out


def check_attention_shapes(n_heads: int, n_kv_heads: int, head_dim: int) -> str | None:
    """Why ``decode_attention`` cannot serve these head shapes, or None when it can."""
    if n_heads % n_kv_heads:
        return f"{n_heads} query heads are not a multiple of {n_kv_heads} KV heads"
    if n_heads // n_kv_heads > MAX_GROUP:
        return f"query group {n_heads // n_kv_heads} > {MAX_GROUP}"
    if head_dim > MAX_HEAD_DIM or head_dim % _LANES:
        return f"head_dim {head_dim} is not a multiple of {_LANES} up to {MAX_HEAD_DIM}"
    return None


def _declare(library: ctypes.CDLL) -> None:
    library.sl_rms_norm.argtypes = [
        _c_void_p,
        _c_int64,
        _c_void_p,
        _c_void_p,
        _c_void_p,
        _c_int64,
        _c_int64,
        _c_float,
    ]
    library.sl_rms_norm.restype = None
    library.sl_silu_mul.argtypes = [_c_void_p, _c_void_p, _c_int64, _c_int64]
    library.sl_silu_mul.restype = None
    library.sl_decode_attention.argtypes = [
        _c_void_p,  # qkv
        _c_int64,  # qkv_stride
        _c_void_p,  # rope_cos
        _c_void_p,  # rope_sin
        _c_void_p,  # positions
        _c_void_p,  # slots
        _c_void_p,  # keys
        _c_void_p,  # values
        _c_int64,  # cache_len
        _c_void_p,  # scores
        _c_void_p,  # out
        _c_int64,  # rows
        _c_int64,  # n_heads
        _c_int64,  # n_kv_heads
        _c_int64,  # head_dim
    ]
    library.sl_decode_attention.restype = None


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_identity() -> str:
    """The CPU's model name and flags (Linux), or the platform's processor string."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    wanted = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(wanted[:2])


def _cache_dir() -> Path:
    configured = os.environ.get("SLOTSERVE_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "slotserve"


def _build(compiler: str, target: Path) -> None:
    """Compile into a temporary file beside ``target``, then rename it (atomic, so servers
    starting together never load a half-written library).

    Raises:
        subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError: the build failed.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *CFLAGS, "-o", partial, str(SOURCE), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


@functools.cache
def load_fused_decode() -> tuple[FusedDecodeKernels | None, str]:
    """Build (once per machine, cached on disk) and load the kernels.

    Returns ``(kernels, how)``: the kernels, or None with the reason they are not available
    (no C compiler, a build error, ``SLOTSERVE_FUSED_DECODE=0``); ``how`` is said in the
    server's start-up log. Never raises.
    """
    if os.environ.get("SLOTSERVE_FUSED_DECODE", "1") == "0":
        return None, "disabled by SLOTSERVE_FUSED_DECODE=0"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"only built on x86-64 Linux, not {platform.system()} {platform.machine()}"
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler (cc, gcc or clang) on PATH"
    try:
        version = subprocess.run(
            [compiler, "--version"], check=True, capture_output=True, text=True, timeout=30
        ).stdout
        digest = hashlib.sha256()
        for part in (SOURCE.read_bytes(), " ".join(CFLAGS).encode(), version.encode()):
            digest.update(part)
        digest.update(_cpu_identity().encode())
        target = _cache_dir() / f"fused_decode-{digest.hexdigest()[:16]}.so"
        if not target.exists():
            _build(compiler, target)
        library = ctypes.CDLL(str(target))
        _declare(library)
    except subprocess.CalledProcessError as error:
        return None, f"build failed: {error.stderr.strip()[-500:]}"
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"build or load failed: {error}"
    return FusedDecodeKernels(library, target), f"fused decode kernels ({compiler}, {target})"
