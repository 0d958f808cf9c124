"""The additive attention masks of a step's eager path (SDPA): 0 where a key is visible,
-inf where it is not, in the model dtype, built once per step and shared by the layers; and
the masks of the layers that attend within a sliding window (Gemma 3's local layers).

The fused C decode kernels take positions and block tables instead and never read a mask: a
step they take builds none (``DecodeGroup.mask`` is made on first use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from app.models.forward.forward_plan import ForwardPlan


@dataclass(frozen=True, slots=True)
class WindowMasks:
    """The additive masks of a step's attention groups for the layers that attend within a
    sliding window (:class:`app.models.hparams.LocalAttention`): each group's own mask with
    the keys at a distance of ``window`` or more hidden too.

    Attributes:
        decode: ``[count, 1, 1, key_length]`` for the decode group, as ``DecodeGroup.mask``;
            None when there is no decode group or no key to hide.
        prefills: ``[1, 1, T, key_length]``, one per prefill group, in ``prefills`` order.
    """

    decode: torch.Tensor | None
    prefills: tuple[torch.Tensor, ...]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """0 where ``allowed``, -inf elsewhere, in the model dtype: built once per step so that SDPA
    does not convert a boolean mask in every layer. Every query row allows >= 1 key."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill_(~allowed, float("-inf")).to(device)


def window_masks(plan: ForwardPlan, window: int, *, dtype: torch.dtype) -> WindowMasks:
    """The masks of ``plan``'s groups for layers whose keys are visible while
    ``query position - key position < window`` (built once per step, shared by the local
    layers)."""
    positions = plan.positions.cpu()
    device = plan.positions.device
    decode = None
    if plan.decode is not None:
        allowed = windowed(positions[: plan.decode.count], plan.decode.key_length, window)
        if not bool(allowed.all()):
            decode = additive_mask(allowed[:, None, None, :], dtype, device)
    prefills = []
    for group in plan.prefills:
        allowed = windowed(positions[group.start : group.stop], group.key_length, window)
        prefills.append(additive_mask(allowed[None, None], dtype, device))
    return WindowMasks(decode, tuple(prefills))


def windowed(query_positions: torch.Tensor, key_length: int, window: int) -> torch.Tensor:
    """bool ``[queries, key_length]``: key ``k`` visible to a query at ``q`` when
    ``0 <= q - k < window``."""
    distance = query_positions[:, None] - torch.arange(key_length)[None, :]
    return (distance >= 0) & (distance < window)
