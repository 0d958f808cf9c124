"""The torch device a real model loads on (``--device``), checked against what this torch
can use before anything loads: a device it cannot use is a one-line refusal (``ModelRefused``
in ``app.models.loading.inspect_model``), not a traceback from the first CUDA call."""

from __future__ import annotations

import torch


def resolve_device(device: str) -> str:
    """``auto`` becomes ``cuda`` when torch sees a GPU, else ``cpu``.

    Raises:
        ValueError: ``cuda`` (or ``cuda:N``) where torch sees no such GPU.
    """
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        if not torch.cuda.is_available():
            build = "is built without CUDA" if torch.version.cuda is None else "sees no GPU"
            raise ValueError(f"--device {device}: this torch {build}")
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: torch sees {torch.cuda.device_count()} GPUs")
    return device
