"""A replica's Kubernetes memory request and limit, from the model's own memory estimate.

    python scripts/k8s_resources.py                      # SmolLM2, the server's defaults
    python scripts/k8s_resources.py --model my.gguf --max-num-seqs 32 --max-model-len 4096

The estimate is the one the server refuses to start without (``app.models.load.memory``):
weights in their loaded format plus the whole KV pool, every block written. A pod also holds the
Python runtime (torch, the HTTP stack: an idle ``--model mock`` server's resident set), so the
request is that plus the estimate, rounded up to 64 MiB; the limit leaves a quarter more for
the step's working set and allocator slack. deploy/k8s/slotserve.yaml carries the numbers for
its own flags; tests/deploy/test_k8s_manifests.py recomputes them.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app.config import ServerConfig
from app.models.load.memory import WIDE_COPY_LIMIT
from app.models.load.plan import (
    LoadOptions,
    LoadPlan,
    decode_buffer_bytes,
    plan_load,
    wide_copy_bytes,
)
from app.models.weights.record import Quantization

MIB = 2**20
# Resident set of an idle `python -m app serve --model mock` (measured: ~265 MiB), rounded up.
RUNTIME_MIB = 320
ROUND_MIB = 64
LIMIT_HEADROOM = 1.25


@dataclass(frozen=True, slots=True)
class PodMemory:
    """A replica's memory in MiB: ``estimate_mib`` the model's (weights + full KV pool),
    ``request_mib`` and ``limit_mib`` what its container asks for and may not exceed."""

    estimate_mib: int
    request_mib: int
    limit_mib: int

    def as_resources(self) -> dict[str, dict[str, str]]:
        """The container's ``resources`` (memory only), as a manifest writes it."""
        return {
            "requests": {"memory": f"{self.request_mib}Mi"},
            "limits": {"memory": f"{self.limit_mib}Mi"},
        }


def round_up(mib: float) -> int:
    """``mib`` rounded up to a multiple of ``ROUND_MIB``."""
    return ROUND_MIB * math.ceil(mib / ROUND_MIB)


def bytes_on_another_cpu(plan: LoadPlan) -> int:
    """Bytes that another node's CPU holds and that ``plan``, made here, left out: the dense
    bfloat16 copies ``--wide-copies auto`` keeps where bfloat16 is native (AMX, AVX-512 BF16),
    or, where it keeps none, the buffer that wide calls decode the blocks into on a CPU with
    AMX (0 where the plan already counts it, or where no CPU adds anything). A pod may be
    scheduled on any kind of node: its request counts the largest."""
    if (
        plan.wide_copies
        or plan.decodes_wide_calls
        or plan.quantization is not Quantization.GGUF
        or plan.device.type != "cpu"
        or plan.dtype != torch.bfloat16
    ):
        return 0
    copies = wide_copy_bytes(plan.source, torch.bfloat16.itemsize)
    if plan.options.wide_copies == "auto" and copies <= WIDE_COPY_LIMIT:
        return copies
    return decode_buffer_bytes(plan.source)


def pod_memory(config: ServerConfig) -> PodMemory:
    """The memory of a replica started with ``config``, on whichever kind of CPU needs more
    (:func:`bytes_on_another_cpu`): the same numbers whatever machine runs this.

    Raises:
        ModelRefused: the model cannot be opened, or does not fit in this machine's memory
            (the estimate is checked against what is available here).
    """
    plan = plan_load(config.model, LoadOptions.from_config(config))
    estimate_mib = math.ceil((plan.memory.total + bytes_on_another_cpu(plan)) / MIB)
    request_mib = round_up(RUNTIME_MIB + estimate_mib)
    return PodMemory(estimate_mib, request_mib, round_up(request_mib * LIMIT_HEADROOM))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-memory", default=None)
    args = parser.parse_args(argv)
    flags = {
        "model": args.model,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "kv_cache_memory": args.kv_cache_memory,
    }
    memory = pod_memory(ServerConfig(**{k: v for k, v in flags.items() if v is not None}))
    print(f"# model estimate: {memory.estimate_mib} MiB (weights + full KV pool)")
    print("resources:")
    for kind, values in memory.as_resources().items():
        print(f"  {kind}:")
        for name, value in values.items():
            print(f"    {name}: {value}")


if __name__ == "__main__":
    main()
