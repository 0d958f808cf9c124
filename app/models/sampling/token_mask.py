"""Per-row allowed-token masks (a structured-output constraint) applied to a step's logits.

A mask is llguidance's bitmask layout: an int32 tensor of ``ceil(vocab / 32)`` words where bit
``j`` of word ``w`` allows token ``32 * w + j`` (the layout ``llguidance.torch`` allocates and
fills; see https://github.com/guidance-ai/llguidance). The sampler applies the masks in its
"min_tokens and the constraint's mask" step, after the penalties and before the temperature;
logprobs are taken from the raw logits, before any mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

TokenMask = torch.Tensor
"""An int32 tensor ``[ceil(vocab / 32)]``: bit ``j`` of word ``w`` allows token ``32*w + j``."""

BITS_PER_WORD = 32


def mask_words(vocab_size: int) -> int:
    """Words in a mask for a vocabulary of ``vocab_size`` tokens: ``ceil(vocab_size / 32)``."""
    return -(-vocab_size // BITS_PER_WORD)


def apply_token_masks(logits: torch.Tensor, masks: Sequence[TokenMask | None]) -> None:
    """Set every disallowed token of each masked row of ``logits`` to ``-inf``, in place.

    Args:
        logits: ``[rows, vocab]`` float32 (any floating dtype works), modified in place.
        masks: one entry per row: None leaves the row untouched (and costs nothing; a step
            with no mask returns at once), else an int32 tensor of ``ceil(vocab / 32)`` words
            (on any device; moved to ``logits``' device).

    Raises:
        ValueError: ``masks`` does not have one entry per row, or a mask is not a 1-D integer
            tensor of ``ceil(vocab / 32)`` words.
    """
    rows, vocab = logits.shape
    if len(masks) != rows:
        raise ValueError(f"{len(masks)} masks for {rows} rows")
    masked = [index for index, mask in enumerate(masks) if mask is not None]
    if not masked:
        return
    words = mask_words(vocab)
    for index in masked:
        mask = masks[index]
        if mask.dim() != 1 or mask.shape[0] != words or mask.dtype.is_floating_point:
            raise ValueError(
                f"row {index}: mask of shape {tuple(mask.shape)} and dtype {mask.dtype}, "
                f"expected int32 [{words}]"
            )
    stacked = torch.stack([masks[index] for index in masked]).to(logits.device, torch.int32)
    allowed = unpack_token_masks(stacked, vocab)
    selected = torch.tensor(masked, device=logits.device)
    logits[selected] = logits[selected].masked_fill(~allowed, float("-inf"))


def unpack_token_masks(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool ``[rows, vocab_size]`` (True: allowed) from int32 mask words ``[rows, words]``."""
    shifts = torch.arange(BITS_PER_WORD, device=words.device, dtype=torch.int32)
    bits = (words[:, :, None] >> shifts) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()
