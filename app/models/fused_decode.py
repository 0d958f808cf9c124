"""Fused CPU kernels for bfloat16 decode steps, built with the machine's C compiler at first
use into one library and called through :mod:`ctypes`.

The C source is split by job: ``fused_decode.h`` (the bfloat16 type and arithmetic the kernels
share, and the exported functions' prototypes), ``fused_decode_norms.c`` (``sl_rms_norm``,
``sl_silu_mul``), ``fused_decode_attention.c`` (``sl_decode_attention``) and
``fused_attention_tiles.c`` (its inner loops with AVX-512 BF16, a cache block at a time).

Why: a one-row int4 decode step of SmolLM2 spent ~6 ms of ~15 in the ~20 small torch ops per
layer between the projections (two RMSNorms, rope, the K/V cache write, SDPA, silu, residual
adds; each a dispatch of a few microseconds of work, see docs/MODEL_PERF.md). These kernels do
the same work in four calls per layer: ``rms_norm`` twice (each with the residual add before
it), ``decode_attention`` (rope, K/V write and grouped-query attention of single-token rows,
reading and writing the paged cache through each row's block table in place, its rows shared
among torch's OpenMP threads) and ``silu_mul``. Model level, bfloat16, 2
threads: a decode step takes 0.69-0.84x the eager step's time from 1 to 64 rows and from 40 to
2000 positions (docs/MODEL_PERF.md).

Building: ``cc -O3 -march=native -shared -fPIC [-fopenmp]`` of the ``.c`` files into one
library in ``$SLOTSERVE_CACHE_DIR`` (default ``~/.cache/slotserve``), named by a hash of every
source file (the header included: a change to any of them rebuilds), the flags, the compiler's
version and the CPU's model and flags, so a cache copied from another machine is never loaded.
A missing compiler or a failed build is not an error: :func:`load_fused_decode` says why and
the model keeps its eager torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from app.models.kv_cache import KV_BLOCK_SIZE

SOURCE_DIR = Path(__file__).parent
# Every file of the library's source, in build order; the cache key hashes them all.
SOURCES = (
    "fused_decode.h",
    "fused_decode_norms.c",
    "fused_decode_attention.c",
    "fused_attention_tiles.c",
)
CFLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c11")
# The attention kernel keeps a query group in fixed-size arrays (fused_decode_attention.c).
MAX_HEAD_DIM = 256
MAX_GROUP = 16
_LANES = 16

_c_void_p = ctypes.c_void_p
_c_int64 = ctypes.c_int64
_c_float = ctypes.c_float


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
        ``decoder._fused_decode_for``.)

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
    ) -> torch.Tensor:
        """RMSNorm of ``x [rows, dim]``: ``x * rsqrt(mean(x^2) + eps)``, times ``weight [dim]``
        unless it is None (folded into the next projection). With ``residual [rows, dim]``,
        ``x += residual`` first, in place (``x`` becomes the new hidden state). Returns a new
        ``[rows, dim]`` tensor."""
        rows, dim = x.shape
        self._check(x)
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
        self._check(gate_up)
        out = torch.empty((rows, width // 2), dtype=torch.bfloat16)
        self.library.sl_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
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
    ) -> torch.Tensor:
        """Rope, K/V cache write and attention for single-token rows.

        Args:
            qkv: ``[rows, (n_heads + 2 * n_kv_heads) * head_dim]``, the QKV projection.
            rope_cos, rope_sin: ``[max_positions, head_dim]`` (``DecoderModel``'s tables,
                :mod:`app.models.rope`).
            positions: ``[rows]`` int64; each row's position.
            block_tables: ``[rows, blocks]`` int64, contiguous: each row's block table
                (:class:`app.models.base.KVBlocks`), covering its position.
            keys, values: one layer of the paged cache, ``[n_kv_heads, num_blocks *
                block_size, head_dim]`` (:class:`app.models.kv_cache.KVCache`).
            scores: float32 workspace, ``[threads, n]`` with ``n >= n_heads / n_kv_heads *
                (max(positions) + 1)``.
            threads: OpenMP threads sharing the rows, split by their lengths. They come from
                the process's OpenMP runtime, which is torch's (its ``libgomp.so.1`` is
                loaded first), so they are torch's own idle intra-op threads.
            qk_norm: None, or ``[n_heads + n_kv_heads, head_dim]``, the per-head RMSNorm weights
                of the query heads then the key heads (Qwen3; ``LayerWeights.qk_norm``: one
                ``q_norm`` row repeated, then one ``k_norm`` row repeated), applied before rope
                with epsilon ``eps``.

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


def _torch_libgomp() -> str | None:
    """The GNU OpenMP runtime already mapped into this process (torch's, on Linux), or None.

    The kernels are built with ``-fopenmp`` only when there is one: the dynamic loader then
    binds their ``libgomp.so.1`` to that same library, so their parallel region runs on
    torch's own worker threads. A second OpenMP runtime (or threads of our own) would fight
    torch's spinning workers for the cores: splitting the attention over a POSIX thread made a
    64-row step 1.2-1.4x slower, over torch's OpenMP team 0.8x.

    Only a library named ``libgomp.so.1`` counts: that is the soname ``-fopenmp`` code links
    to. Wheels that bundle their own copy under another name (sentencepiece's
    ``libgomp-<hash>.so.1.0.0``, which ``gguf`` imports when it is installed) are not what the
    kernels bind to.
    """
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1]
        if Path(path).name.startswith("libgomp.so.1"):
            return path
    return None


def _cache_dir() -> Path:
    configured = os.environ.get("SLOTSERVE_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "slotserve"


def _source_paths() -> list[Path]:
    return [SOURCE_DIR / name for name in SOURCES]


def _cache_key(flags: tuple[str, ...], compiler_version: str) -> str:
    """The library's name in the cache: a hash of every source file (name and bytes), the
    flags, the compiler's version and the CPU, so any change to one of them rebuilds."""
    digest = hashlib.sha256()
    for path in _source_paths():
        digest.update(path.name.encode() + b"\0")
        digest.update(path.read_bytes())
    for part in (" ".join(flags), compiler_version, _cpu_identity()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _build(compiler: str, flags: tuple[str, ...], target: Path) -> None:
    """Compile the ``.c`` files of ``SOURCES`` (their header found beside them) into a
    temporary file beside ``target``, then rename it (atomic, so servers starting together
    never load a half-written library).

    Raises:
        subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError: the build failed.
    """
    units = [str(path) for path in _source_paths() if path.suffix == ".c"]
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *flags, "-o", partial, *units, "-lm"],
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
    (no C compiler, a build error); ``how`` is said in the
    server's start-up log. Never raises.
    """
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"only built on x86-64 Linux, not {platform.system()} {platform.machine()}"
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler (cc, gcc or clang) on PATH"
    libgomp = _torch_libgomp()
    flags = (*CFLAGS, "-fopenmp") if libgomp else CFLAGS
    threads = f"attention on torch's OpenMP threads ({libgomp})" if libgomp else "one thread"
    try:
        version = subprocess.run(
            [compiler, "--version"], check=True, capture_output=True, text=True, timeout=30
        ).stdout
        target = _cache_dir() / f"fused_decode-{_cache_key(flags, version)}.so"
        if not target.exists():
            _build(compiler, flags, target)
        library = ctypes.CDLL(str(target))
        _declare(library)
    except subprocess.CalledProcessError as error:
        return None, f"build failed: {error.stderr.strip()[-500:]}"
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"build or load failed: {error}"
    return FusedDecodeKernels(library, target), f"fused decode kernels ({target}; {threads})"
