"""The sampler's draw in the fused kernels' C loop (``fused_decode_sampling.c``): temperature,
top-k, top-p and min-p as :meth:`Sampler._sample_random <app.models.sampling.sampler.Sampler>`
defines them, without torch's float32 copies of every row (the scaled logits, the softmax,
their cumulative sum) and without its sorts. Gemma 3's 262,144-token rows are 1 MiB each:
at 64 rows a step the unfiltered draw wrote and read ~200 MB, and a nucleus (top-p) row whose
best 256 tokens held under top_p of the mass sorted the whole vocabulary. Same distribution
(the same kept tokens, each drawn with its weight's share of the kept mass); the sums run in
another order and a filtered row's kept tokens are walked in another order, so a seeded
request's tokens differ from torch's path, and are reproducible on this path as on that one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from app.models.kernels.fused_decode import (
    FusedDecodeKernels,
    load_fused_decode,
    logits_arguments,
)

# (logits [R, vocab], temperature [R], top_k [R], top_p [R], min_p [R], uniforms [R]) ->
# token ids [R], or None where the C loop does not take the call (torch's path then does)
Draw = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    torch.Tensor | None,
]


def vocabulary_draw(kernels: FusedDecodeKernels | None) -> Draw | None:
    """The sampler's draw on ``kernels`` (rows shared by torch's threads), or None without
    them. CPU logits of bfloat16 or float32 with a unit column stride only; other logits, and
    rows whose largest logit is not finite, answer None."""
    if kernels is None:
        return None

    def draw(logits: torch.Tensor, *params: torch.Tensor) -> torch.Tensor | None:
        fits = logits.dtype in (torch.bfloat16, torch.float32) and logits.stride(-1) == 1
        if not fits or logits.device.type != "cpu":
            return None
        return sample_rows(kernels, logits, *params, threads=torch.get_num_threads())

    return draw


def vocabulary_draw_on(device: torch.device) -> Draw | None:
    """:func:`vocabulary_draw` on the fused kernels (built at first use) for a model on the
    CPU; None on another device, or where the kernels do not build (torch's path then)."""
    return vocabulary_draw(load_fused_decode()[0]) if device.type == "cpu" else None


def sample_rows(
    kernels: FusedDecodeKernels,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
    *,
    threads: int = 1,
) -> torch.Tensor | None:
    """Each row's draw (``sl_sample_rows``): the tokens by weight ``exp(logit / t - max)``
    descending, the first ``top_k`` (0: all) whose mass before each is under ``top_p`` of the
    total (the best always kept), less those under ``min_p`` times the best's weight; then the
    first whose cumulative weight exceeds ``u`` times the kept mass (an unfiltered row, top-k
    0 and top-p 1, walks its columns in token-id order). ``logits [rows, vocab]`` bfloat16 or
    float32 with a unit column stride; ``temperature`` (> 0), ``top_p``, ``min_p`` and
    ``uniforms`` (in [0, 1)) float32 ``[rows]``, ``top_k`` integers ``[rows]``. Returns int64
    ``[rows]``, or None when a row's largest logit is not finite (NaN, +inf, or every logit
    -inf): the caller's torch path decides those rows.

    Raises:
        ValueError: another dtype or layout, or ``[rows]`` arguments of another shape.
        MemoryError: no memory for the rows' scratch.
    """
    arguments = logits_arguments(logits, "sample_rows")
    rows = logits.shape[0]
    floats = [t.to(torch.float32).contiguous() for t in (temperature, top_p, min_p, uniforms)]
    counts = top_k.to(torch.int64).contiguous()
    if any(t.shape != (rows,) for t in (*floats, counts)):
        raise ValueError(f"temperature, top_k, top_p, min_p and uniforms must be [{rows}]")
    t, p, m, u = floats
    out = torch.empty(rows, dtype=torch.int64)
    status = kernels.library.sl_sample_rows(
        *arguments, *(c.data_ptr() for c in (t, counts, p, m, u)), out.data_ptr(), threads
    )
    if status == -2:
        raise MemoryError("no memory for the sampler's scratch")
    return None if status else out
