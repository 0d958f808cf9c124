"""How every C kernel library of the project is built: one way, with the machine's C compiler
at first use, cached on disk.

``cc FLAGS -o lib.so SOURCES.c -lm`` (``-fopenmp`` added when torch's GNU OpenMP runtime is in
the process, see :func:`torch_libgomp`), into ``$SLOTSERVE_CACHE_DIR`` (default
``~/.cache/slotserve``), the file named by a hash of every source file (headers included: a
change to any of them rebuilds), the flags, the compiler's version and the CPU's model and
flags, so a cache copied from another machine is never loaded. A missing compiler or a failed
build raises :class:`KernelBuildError`, which every loader turns into one log line and the torch
path (:func:`app.models.kernels.fused_decode.load_fused_decode`,
:func:`app.models.kernels.ggml_quant.load_ggml_quant`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

# Flags every library is built with; a library adds its own (the fused decode kernels:
# -march=native; the GGUF-block kernels choose instruction sets at run time instead).
BASE_CFLAGS = ("-O3", "-fPIC", "-shared", "-std=c11")


class KernelBuildError(Exception):
    """A library could not be built or loaded here; the message says why in one line."""


def build_library(
    name: str, source_dir: Path, sources: tuple[str, ...], flags: tuple[str, ...]
) -> tuple[ctypes.CDLL, Path, bool]:
    """Build (once per machine, cached) and load the library ``name`` from ``sources`` (file
    names in ``source_dir``; the ``.c`` ones are compiled, all are hashed).

    Returns ``(library, path, threaded)``; ``threaded``: built with ``-fopenmp`` against torch's
    OpenMP runtime (see :func:`torch_libgomp`), else its parallel regions run on one thread.

    Raises:
        KernelBuildError: not x86-64 Linux, no compiler, or the build or load failed.
    """
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise KernelBuildError(
            f"only built on x86-64 Linux, not {platform.system()} {platform.machine()}"
        )
    compiler = _compiler()
    if compiler is None:
        raise KernelBuildError("no C compiler (cc, gcc or clang) on PATH")
    threaded = torch_libgomp() is not None
    all_flags = (*BASE_CFLAGS, *flags, *(("-fopenmp",) if threaded else ()))
    paths = [source_dir / source for source in sources]
    try:
        version = subprocess.run(
            [compiler, "--version"], check=True, capture_output=True, text=True, timeout=30
        ).stdout
        target = cache_dir() / f"{name}-{_cache_key(paths, all_flags, version)}.so"
        if not target.exists():
            _build(compiler, all_flags, paths, target)
        library = ctypes.CDLL(str(target))
    except subprocess.CalledProcessError as error:
        raise KernelBuildError(f"build failed: {error.stderr.strip()[-500:]}") from None
    except (OSError, subprocess.SubprocessError) as error:
        raise KernelBuildError(f"build or load failed: {error}") from None
    return library, target, threaded


def cache_dir() -> Path:
    configured = os.environ.get("SLOTSERVE_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "slotserve"


def torch_libgomp() -> str | None:
    """The GNU OpenMP runtime already mapped into this process (torch's, on Linux), or None.

    Libraries are built with ``-fopenmp`` only when there is one: the dynamic loader then
    binds their ``libgomp.so.1`` to that same library, so their parallel regions run on
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


def _cache_key(paths: list[Path], flags: tuple[str, ...], compiler_version: str) -> str:
    """A hash of every source file (name and bytes), the flags, the compiler's version and
    the CPU: any change to one of them rebuilds."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0")
        digest.update(path.read_bytes())
    for part in (" ".join(flags), compiler_version, _cpu_identity()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _build(compiler: str, flags: tuple[str, ...], paths: list[Path], target: Path) -> None:
    """Compile the ``.c`` files (their headers found beside them) into a temporary file beside
    ``target``, then rename it (atomic, so servers starting together never load a
    half-written library).

    Raises:
        subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError: the build failed.
    """
    units = [str(path) for path in paths if path.suffix == ".c"]
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *flags, "-o", partial, *units, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=180,
        )
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
