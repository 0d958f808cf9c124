"""The sampler's draw from the whole vocabulary (a temperature, no top-k, no top-p: API.md's
defaults) in the fused kernels' C loop (``fused_decode_sampling.c``), where torch's pipeline
(:meth:`Sampler._sample_random <app.models.sampling.sampler.Sampler>`: the scaled logits, the
softmax, their cumulative sum and a search) makes three float32 copies of every row: Gemma 3's
262,144-token rows are 1 MiB each, ~200 MB written and read at 64 rows a step. Same
distribution (the first column whose cumulative weight exceeds ``u`` times the row's total,
in token-id order, ``min_p``'s cut included); the sums run in another order, so a seeded
request's tokens may differ from torch's path where a draw falls within rounding of a
boundary, and are reproducible on this path as on that one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from app.models.kernels.fused_decode import FusedDecodeKernels, load_fused_decode

# (logits [R, vocab], temperature [R], min_p [R], uniforms [R]) -> token ids [R], or None
# where the C loop does not take the call (the sampler's torch path does)
Draw = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]


def vocabulary_draw(kernels: FusedDecodeKernels | None) -> Draw | None:
    """The sampler's unfiltered draw on ``kernels`` (rows shared by torch's threads), or None
    without them. CPU logits of bfloat16 or float32 with a unit column stride only; other
    logits, and rows whose largest logit is not finite, answer None."""
    if kernels is None:
        return None

    def draw(
        logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, uniforms: torch.Tensor
    ) -> torch.Tensor | None:
        fits = logits.dtype in (torch.bfloat16, torch.float32) and logits.stride(-1) == 1
        if not fits or logits.device.type != "cpu":
            return None
        return sample_rows(
            kernels, logits, temperature, min_p, uniforms, threads=torch.get_num_threads()
        )

    return draw


def vocabulary_draw_on(device: torch.device) -> Draw | None:
    """:func:`vocabulary_draw` on the fused kernels (built at first use) for a model on the
    CPU; None on another device, or where the kernels do not build (torch's path then)."""
    return vocabulary_draw(load_fused_decode()[0]) if device.type == "cpu" else None


def sample_rows(
    kernels: FusedDecodeKernels,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
    *,
    threads: int = 1,
) -> torch.Tensor | None:
    """Each row's draw from its whole vocabulary: the first column whose cumulative weight
    ``exp(logit / t - max)`` (0 where under ``min_p`` times the best's) exceeds ``u`` times
    the row's total, in token-id order. ``logits [rows, vocab]`` bfloat16 or float32 with a
    unit column stride; ``temperature`` (> 0), ``min_p`` and ``uniforms`` (in [0, 1)) float32
    ``[rows]``. Returns int64 ``[rows]``, or None when a row's largest logit is not finite
    (NaN, +inf, or every logit -inf): the caller's torch path decides those rows.

    Raises:
        ValueError: another dtype or layout, or ``[rows]`` arguments of another shape.
        MemoryError: no memory for the block sums.
    """
    if logits.dtype not in (torch.bfloat16, torch.float32) or logits.stride(-1) != 1:
        raise ValueError(
            f"sample_rows takes bfloat16 or float32 rows with a unit column stride; got "
            f"{logits.dtype} with strides {logits.stride()}"
        )
    rows, vocab = logits.shape
    columns = [t.to(torch.float32).contiguous() for t in (temperature, min_p, uniforms)]
    if any(c.shape != (rows,) for c in columns):
        raise ValueError(f"temperature, min_p and uniforms must be [{rows}]")
    out = torch.empty(rows, dtype=torch.int64)
    status = kernels.library.sl_sample_rows(
        logits.data_ptr(),
        int(logits.dtype == torch.bfloat16),
        rows,
        vocab,
        logits.stride(0),
        *(c.data_ptr() for c in columns),
        out.data_ptr(),
        threads,
    )
    if status == -2:
        raise MemoryError("no memory for the sampler's block sums")
    return None if status else out
