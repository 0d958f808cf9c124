"""Drive a runner through whole sequences (prefill, then decode rows batched together); build a
forward from a checkpoint without a runner; load a small GGUF file on its own blocks."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from app.models.base import SamplingParams, StepBatch, StepRow
from app.models.checkpoints.gguf_file import GGUFFile
from app.models.checkpoints.hf_directory import HFDirectory
from app.models.checkpoints.model_tensors import ModelTensors
from app.models.forward.decoder import DecoderModel
from app.models.forward.forward_plan import ForwardPlan, RowSpec
from app.models.forward.kv_cache import KVCache
from app.models.kernels.ggml_quant import load_ggml_quant
from app.models.load.plan import load_checkpoint
from app.models.runner import ModelRunner
from app.models.weights.build import load_weights
from app.models.weights.projections import LinearKernel, select_linear_kernel
from app.models.weights.record import Quantization

GREEDY = SamplingParams(temperature=0.0)
CPU = torch.device("cpu")


def generate_together(
    runner: ModelRunner,
    prompts: dict[int, Sequence[int]],
    num_tokens: int,
    sampling: dict[int, SamplingParams] | None = None,
) -> dict[int, list[int]]:
    """Prefill every ``slot -> prompt`` in one step, then decode all slots together.

    Returns ``num_tokens`` generated tokens per slot. Leaves the slots occupied.
    """
    sampling = sampling or {}
    rows = tuple(
        StepRow(slot, tuple(prompt), 0, True, sampling.get(slot, GREEDY))
        for slot, prompt in prompts.items()
    )
    generated = {slot: [] for slot in prompts}
    lengths = {slot: len(prompt) for slot, prompt in prompts.items()}
    for _ in range(num_tokens):
        output = runner.step(StepBatch(rows))
        for row, token in zip(rows, output.next_token_ids, strict=True):
            generated[row.slot].append(token)
        rows = tuple(
            StepRow(row.slot, (generated[row.slot][-1],), lengths[row.slot], True, row.sampling)
            for row in rows
        )
        for slot in lengths:
            lengths[slot] += 1
    return generated


def generate_alone(
    runner: ModelRunner,
    slot: int,
    prompt: Sequence[int],
    num_tokens: int,
    sampling: SamplingParams = GREEDY,
) -> list[int]:
    """Generate for one sequence in ``slot``, then release the slot."""
    tokens = generate_together(runner, {slot: prompt}, num_tokens, {slot: sampling})[slot]
    runner.release(slot)
    return tokens


def open_tensors(path: Path | str) -> ModelTensors:
    """The checked tensors of a GGUF file or HF directory (no tokenizer built), opened once
    per test session (parsing a GGUF's 49k-token vocabulary takes ~1 s)."""
    return _open_tensors(str(Path(path).resolve()))


@functools.cache
def _open_tensors(path: str) -> ModelTensors:
    checkpoint = HFDirectory(Path(path)) if Path(path).is_dir() else GGUFFile(Path(path))
    architecture = checkpoint.architecture()
    tensors = ModelTensors(checkpoint, architecture, checkpoint.hparams(architecture))
    tensors.check()
    return tensors


def decoder_of(
    path: Path | str,
    *,
    dtype: torch.dtype = torch.float32,
    quantization: Quantization = Quantization.NONE,
    kernel: LinearKernel | None = None,
    max_model_len: int = 256,
    fused_decode: bool = True,
) -> DecoderModel:
    """The forward of a GGUF file or HF directory on the CPU, without a runner.
    ``kernel`` None: the one ``select_linear_kernel`` picks."""
    tensors = open_tensors(path)
    if kernel is None:
        kernel, _ = select_linear_kernel(CPU, dtype)
    ggml = load_ggml_quant()[0] if quantization is Quantization.GGUF else None
    weights = load_weights(
        tensors, dtype=dtype, device=CPU, quantization=quantization, kernel=kernel, ggml=ggml
    )
    return DecoderModel(
        tensors.hparams, weights, max_model_len=max_model_len, fused_decode=fused_decode
    )


def sequence_logits(model: DecoderModel, token_ids: Sequence[int], *, chunk: int) -> torch.Tensor:
    """float32 logits ``[len(token_ids) - chunk + 1, vocab]`` of one sequence: the first
    ``chunk`` tokens as one prompt chunk (its last position's logits), then one decode step
    per token. Row ``i`` predicts the token after position ``chunk - 1 + i``."""
    cache = KVCache(
        model.hparams,
        max_num_seqs=1,
        max_model_len=len(token_ids),
        dtype=model.dtype,
        device=model.device,
    )
    rows = [RowSpec(0, list(token_ids[:chunk]), 0, True)]
    rows += [RowSpec(0, [token_ids[i]], i, True) for i in range(chunk, len(token_ids))]
    with torch.inference_mode():
        return torch.cat(
            [model.forward(ForwardPlan.build([row], cache=cache), cache).float() for row in rows]
        )


def load_on_blocks(path: Path, *, wide_copies: str) -> ModelRunner:
    """A 2-slot, 64-position runner of the GGUF file at ``path`` as the server loads it by
    default (bfloat16, its own blocks), with ``wide_copies`` ("auto", "on" or "off")."""
    return load_checkpoint(
        path,
        max_num_seqs=2,
        max_model_len=64,
        dtype="bfloat16",
        quantization="auto",
        wide_copies=wide_copies,
    )
