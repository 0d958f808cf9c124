"""Loading a real model in two phases, so that every refusal comes before the server opens its
port (:mod:`app.models.loading` calls them for the server):

1. :func:`plan_load` (the command line, before uvicorn starts): opens and checks the model
   (:func:`app.models.load.source.open_model`), resolves ``--quantization auto``, caps the context,
   and checks the memory estimate. It reads metadata only and runs no torch kernel, so it
   starts no OpenMP team on the main thread (``app/engine/model_thread.py``).
2. :func:`load_runner` (the app's lifespan, on the model thread): reads the weights and builds
   the :class:`ModelRunner`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from app.config import ServerConfig, parse_memory_size
from app.models.checkpoints.checkpoint import CheckpointFormat
from app.models.forward.decoder import DecoderModel
from app.models.forward.kv_cache import kv_block_bytes, pool_blocks
from app.models.kernels.ggml_quant import KERNEL_TYPES, load_ggml_quant
from app.models.load.allocator import keep_step_buffers_in_the_heap, return_freed_memory_to_the_os
from app.models.load.device import resolve_device
from app.models.load.memory import (
    MemoryEstimate,
    available_memory,
    block_bytes,
    decode_buffer_bytes,
    estimate_memory,
    keeps_wide_copies,
    wide_copy_bytes,
)
from app.models.load.source import ModelSource, open_model
from app.models.refusal import ModelRefused
from app.models.runner import DEFAULT_PREFILL_CHUNK, ModelRunner
from app.models.weights.block_arena import BlockArena, release_unclaimed
from app.models.weights.build import load_weights
from app.models.weights.ggml import blocks_max_rows, decodes_wide_calls_here
from app.models.weights.int4 import int4_kernel_status
from app.models.weights.projections import LinearKernel, select_linear_kernel, widens_to_float32
from app.models.weights.record import DTYPES, ModelWeights, Quantization

logger = logging.getLogger(__name__)

INT4_FILE_TYPES = frozenset({"Q4_0", "Q4_1"})


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """How to load a model (the model-layer flags of :class:`ServerConfig`).

    Attributes:
        max_num_seqs: batch slots (KV cache rows) to preallocate.
        max_model_len: positions per slot; capped at the model's context length.
        dtype: ``"float32"`` or ``"bfloat16"`` (weights, activations and KV cache).
        device: a torch device string (``"cpu"``, ``"cuda"``, ...; not ``"auto"``).
        quantization: ``--quantization`` (:func:`resolve_quantization`).
        fused_decode: use the fused CPU decode kernels where they apply and build.
        wide_copies: ``--wide-copies`` (``auto``, ``on``, ``off``; :func:`keeps_wide_copies`).
        served_model_name: the name to serve under; None: the bundled model's name, the GGUF's
            ``general.name``, or the directory's name.
        prefill_chunk: most prompt tokens one row carries in a step.
        kv_cache_memory: the paged KV pool: bytes (int), a fraction of available memory
            (float), or None (room for ``DEFAULT_POOL_SEQUENCES`` sequences of
            ``max_model_len``); ``--kv-cache-memory``.
    """

    max_num_seqs: int
    max_model_len: int = 2048
    dtype: str = "float32"
    device: str = "cpu"
    quantization: str = "none"
    fused_decode: bool = True
    wide_copies: str = "auto"
    served_model_name: str | None = None
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    kv_cache_memory: int | float | None = None

    @classmethod
    def from_config(cls, config: ServerConfig) -> LoadOptions:
        return cls(
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            dtype=config.dtype,
            device=resolve_device(config.device),
            quantization=config.quantization,
            fused_decode=config.fused_decode,
            wide_copies=config.wide_copies,
            served_model_name=config.served_model_name,
            kv_cache_memory=(
                parse_memory_size(config.kv_cache_memory) if config.kv_cache_memory else None
            ),
        )


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Everything decided before the weights are read.

    Attributes:
        source: the opened, checked model.
        options: what was asked.
        dtype, device: resolved.
        quantization: ``auto`` resolved; ``quantization_reason`` says why.
        max_model_len: positions per slot (the asked value capped at the model's context).
        memory: the estimate that was checked.
        num_kv_blocks: blocks of the paged KV pool, the null block included.
        wide_copies: gguf keeps dense copies of the projections for wide steps
            (``--wide-copies``).
        decodes_wide_calls: gguf without copies on a CPU with AMX's bfloat16 matmuls: wide
            calls decode the blocks for the call (``GGMLLinear.dense_from_rows``).
    """

    source: ModelSource
    options: LoadOptions
    dtype: torch.dtype
    device: torch.device
    quantization: Quantization
    quantization_reason: str
    max_model_len: int
    memory: MemoryEstimate
    num_kv_blocks: int
    wide_copies: bool = False
    decodes_wide_calls: bool = False


def resolve_quantization(
    requested: str, source: ModelSource, dtype: torch.dtype, device: torch.device
) -> tuple[Quantization, str]:
    """The weight format to load, and why.

    ``auto``: a GGUF file on the CPU in bfloat16 computes on its own blocks (``gguf``) when
    any projection is of a type the GGUF-block kernels compute; otherwise (and where those
    kernels do not build, :func:`load_runner`) as before: the int4 kernel when every
    projection is Q4_0/Q4_1 and the model runs on the CPU in bfloat16, else dense in the model
    dtype. Explicit choices are checked and kept. (float32 stays dense under ``auto``: it is
    asked for as the exact reference.)

    Raises:
        ModelRefused: an explicit choice that cannot run here (gguf off the CPU or on a
            checkpoint without blocks; int8/int4 without bfloat16, int4 off the CPU or on a
            file whose projections are not 4-bit).
    """
    types = source.tensors.projection_types()
    blocks = source.checkpoint.format is CheckpointFormat.GGUF
    computed = sorted({t for t in types.values() if t in KERNEL_TYPES})
    others = sorted({t for t in types.values() if t not in KERNEL_TYPES})
    if requested == "auto":
        if blocks and computed and device.type == "cpu" and dtype == torch.bfloat16:
            dense = f"; {', '.join(others)} dense" if others else ""
            return Quantization.GGUF, (
                f"auto: the file's own {', '.join(computed)} blocks in the GGUF-block "
                f"kernels{dense}"
            )
        return auto_without_blocks(source, dtype, device)
    quantization = Quantization(requested)
    if quantization is Quantization.GGUF:
        if not blocks:
            raise ModelRefused(source.path, "--quantization gguf needs a GGUF file")
        if device.type != "cpu":
            raise ModelRefused(source.path, "--quantization gguf runs on the CPU only")
        return quantization, f"--quantization gguf ({', '.join(computed) or 'no'} blocks)"
    if quantization is not Quantization.NONE and dtype != torch.bfloat16:
        raise ModelRefused(source.path, f"--quantization {requested} needs --dtype bfloat16")
    if quantization is Quantization.INT4:
        not_4bit = next(((n, t) for n, t in types.items() if t not in INT4_FILE_TYPES), None)
        if device.type != "cpu" or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            raise ModelRefused(source.path, "--quantization int4 runs on the CPU only")
        if not_4bit is not None:
            name, kind = not_4bit
            raise ModelRefused(
                source.path, f"--quantization int4 needs Q4_0/Q4_1 projections; {name} is {kind}"
            )
    return quantization, f"--quantization {requested}"


def auto_without_blocks(
    source: ModelSource, dtype: torch.dtype, device: torch.device
) -> tuple[Quantization, str]:
    """``auto`` where the GGUF-block kernels do not serve: int4 for an all-Q4_0/Q4_1 file on
    the CPU in bfloat16 (torch's kernel), else dense in the model dtype."""
    types = source.tensors.projection_types()
    not_4bit = next(((n, t) for n, t in types.items() if t not in INT4_FILE_TYPES), None)
    if not_4bit is not None:
        name, kind = not_4bit
        return Quantization.NONE, f"auto: {name} is {kind}: dense {dtype}"
    if device.type != "cpu" or dtype != torch.bfloat16:
        return Quantization.NONE, "auto: the int4 kernel runs on the CPU in bfloat16 only"
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return Quantization.NONE, "auto: torch has no int4 kernel"
    return Quantization.INT4, "auto: the file's own 4-bit codes in the int4 kernel"


def plan_load(model: str, options: LoadOptions) -> LoadPlan:
    """Open and check ``model`` and decide how to load it (phase 1, see the module docstring).

    Raises:
        ModelRefused: the model cannot be served (see :func:`open_model`), an option does not
            fit it, or the model and its KV cache would not fit in memory.
    """
    if options.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {options.dtype!r}")
    if options.max_num_seqs < 1 or options.max_model_len < 1:
        raise ValueError("max_num_seqs and max_model_len must be positive")
    source = open_model(model, served_model_name=options.served_model_name)
    dtype, device = DTYPES[options.dtype], torch.device(options.device)
    quantization, reason = resolve_quantization(options.quantization, source, dtype, device)
    if quantization is Quantization.GGUF:  # built here, so a failure is refused before serving
        ggml, how = load_ggml_quant()
        if ggml is None and options.quantization != "auto":
            raise ModelRefused(source.path, f"--quantization gguf: {how}")
        if ggml is None:
            quantization, reason = auto_without_blocks(source, dtype, device)
            logger.warning("GGUF-block kernels unavailable (%s): %s", how, reason)
    max_model_len = min(options.max_model_len, source.hparams.context_length)
    if max_model_len < options.max_model_len:
        logger.info(
            "max_model_len %d capped at the model's context length %d",
            options.max_model_len,
            max_model_len,
        )
    try:
        num_kv_blocks = pool_blocks(
            options.kv_cache_memory,
            bytes_per_block=kv_block_bytes(source.hparams, dtype=dtype),
            max_model_len=max_model_len,
            max_num_seqs=options.max_num_seqs,
            available=available_memory(device)[0],
        )
    except ValueError as error:
        raise ModelRefused(source.path, str(error)) from None
    stored = block_bytes(source) if quantization is Quantization.GGUF else None
    widens = widens_to_float32(device, dtype)
    itemsize = 4 if widens else dtype.itemsize
    wide_bytes = wide_copy_bytes(source, itemsize) if stored else 0
    wide_copies = keeps_wide_copies(options.wide_copies, wide_bytes, device, dtype)
    if wide_copies:
        over = blocks_max_rows()
        reason += f"; dense copies for steps of over {over} rows ({wide_bytes / 2**20:.0f} MiB)"
    # Wide calls decode the blocks for the call (GGMLLinear.dense_from_rows) where no copy is
    # kept and the CPU multiplies bfloat16 on AMX tiles; the model thread's buffer is counted.
    native_bf16 = device.type == "cpu" and dtype == torch.bfloat16 and not widens
    decodes_wide_calls = (
        bool(stored) and native_bf16 and not wide_copies and decodes_wide_calls_here()
    )
    decode_bytes = decode_buffer_bytes(source) if decodes_wide_calls else 0
    memory = estimate_memory(
        source.hparams,
        dtype=dtype,
        device=device,
        quantization=quantization,
        max_model_len=max_model_len,
        num_kv_blocks=num_kv_blocks,
        block_bytes=stored,
        extra_bytes=(wide_bytes if wide_copies else 0) + decode_bytes,
    )
    if not memory.fits:
        raise ModelRefused(
            source.path,
            memory.describe(max_num_seqs=options.max_num_seqs, max_model_len=max_model_len),
        )
    return LoadPlan(
        source,
        options,
        dtype,
        device,
        quantization,
        reason,
        max_model_len,
        memory,
        num_kv_blocks,
        wide_copies,
        decodes_wide_calls,
    )


def load_runner(plan: LoadPlan) -> ModelRunner:
    """Read the weights and build the runner (phase 2; call it on the model thread)."""
    started = time.perf_counter()
    source, options = plan.source, plan.options
    quantization, reason = plan.quantization, plan.quantization_reason
    ggml, ggml_how = (None, "")
    if quantization is Quantization.GGUF:  # planned with the kernels loaded (cached)
        ggml, ggml_how = load_ggml_quant()
        if ggml is None:
            raise ModelRefused(source.path, f"GGUF-block kernels: {ggml_how}")
    if quantization is Quantization.INT4 and options.quantization == "auto":
        available, why = int4_kernel_status()
        if not available:
            logger.warning("int4 kernel unusable (%s): loading dense weights", why)
            quantization = Quantization.NONE
    kernel, kernel_reason = select_linear_kernel(plan.device, plan.dtype)
    logger.info(
        "%s: %s %s; weights %s (%s); projections %s (%s)",
        source.path,
        source.architecture.name,
        source.checkpoint.format.value,
        quantization.value,
        reason,
        kernel.value,
        kernel_reason,
    )
    gguf = quantization is Quantization.GGUF
    arena = BlockArena.for_file(source.path) if gguf and source.path.is_file() else None
    if arena is None:
        release_unclaimed()  # memory the command line faulted in for blocks not kept here
    weights = load_weights(
        source.tensors,
        dtype=plan.dtype,
        device=plan.device,
        quantization=quantization,
        kernel=kernel,
        ggml=ggml,
        wide_copies=plan.wide_copies and quantization is Quantization.GGUF,
        decode_wide_calls=(
            plan.decodes_wide_calls
            and quantization is Quantization.GGUF
            and kernel is LinearKernel.ONEDNN  # (the probe may have refused oneDNN bfloat16)
        ),
        arena=arena,
    )
    if not gguf or arena is not None:
        # The weights are copied out: the file's pages go. On the file's mapped blocks (no
        # transparent huge pages to copy them into) they are the weights, so they stay.
        source.checkpoint.release_pages()
    if arena is not None:
        arena.close()
        logger.info("blocks: %s", arena.describe())
    weight_kernels = describe_weight_kernels(weights, ggml_how)
    if weight_kernels:
        logger.info("weights: %s", weight_kernels)
    model = DecoderModel(
        source.hparams,
        weights,
        max_model_len=plan.max_model_len,
        fused_decode=options.fused_decode,
    )
    runner = ModelRunner(
        name=source.name,
        model=model,
        tokenizer=source.tokenizer,
        max_num_seqs=options.max_num_seqs,
        max_model_len=plan.max_model_len,
        prefill_chunk=options.prefill_chunk,
        num_kv_blocks=plan.num_kv_blocks,
        weight_kernels=weight_kernels,
    )
    return_freed_memory_to_the_os()
    keep_step_buffers_in_the_heap()
    logger.info("decode steps: %s", model.fused_decode_status)
    logger.info(
        "loaded %s (%s) in %.1f s; KV cache %.1f MiB: %d blocks of %d positions, %.2f MiB each%s",
        source.name,
        runner.capabilities.backend,
        time.perf_counter() - started,
        runner.cache.total_bytes / 2**20,
        runner.cache.num_blocks - 1,
        runner.cache.block_size,
        runner.cache.bytes_per_block / 2**20,
        "" if options.kv_cache_memory is not None else " (default; --kv-cache-memory sets it)",
    )
    return runner


def describe_weight_kernels(weights: ModelWeights, ggml_how: str) -> str:
    """What computes the projections, per stored type (the start-up log and ``/info``), for a
    gguf load; "" for the other formats (their log line says it)."""
    if weights.quantization is not Quantization.GGUF:
        return ""
    counts: dict[str, int] = {}
    linears = [p for layer in weights.layers for p in (layer.qkv, layer.attn_output)]
    linears += [p for layer in weights.layers for p in (layer.gate_up, layer.down)]
    for projection in (*linears, weights.lm_head):
        for kind in getattr(projection, "tensor_types", ()):
            counts[kind] = counts.get(kind, 0) + 1
    blocks = ", ".join(f"{kind} x{count}" for kind, count in sorted(counts.items()))
    dense = weights.dense_projections
    kept = f"; dense: {', '.join(dense[:4])}{' ...' if len(dense) > 4 else ''}" if dense else ""
    wide = [p for p in (*linears, weights.lm_head) if getattr(p, "wide", None) is not None]
    over = min((p.blocks_max_rows for p in wide), default=0)  # type: ignore[union-attr]
    copies = f"; dense copies for steps of more than {over} rows" if wide else ""
    sketch = getattr(weights.lm_head, "sketch", None)
    if sketch is not None:
        copies += f"; greedy one-row head on a six-bit sketch ({sketch.nbytes / 2**20:.0f} MiB)"
    return f"{ggml_how}; on the file's blocks: {blocks}{kept}{copies}"


def load_checkpoint(model: str | Path, **options: object) -> ModelRunner:
    """Plan and load in one call (tests, scripts): ``model`` is a bundled name or a path;
    ``options`` are :class:`LoadOptions`' fields (``max_num_seqs`` is required).

    Raises:
        ModelRefused: as :func:`plan_load`.
    """
    return load_runner(plan_load(str(model), LoadOptions(**options)))  # type: ignore[arg-type]
