"""How many CPUs a container's quota lets this process use (cgroup ``cpu.max`` / CFS quota).

torch sizes its OpenMP team by the machine's cores, not by the container's quota. In a
container limited to 2 CPUs on a 64-core host it would run 32 threads, and libgomp's threads
spin between parallel regions (a decode step is hundreds of them): a thread that the quota
has descheduled holds every other one at the next barrier. The same collapse shows when
several servers share a machine each with all its cores: two SmolLM2 servers on the 2-core
AMX Xeon, each with 2 threads, gave 3.9 and 6.7 tok/s at one stream each (168.6 alone), and
with one thread each 90.1 and 97.7 (docs/MODEL_PERF.md). So an unset ``--torch-threads``
takes the quota's CPUs (rounded up) where a quota is set, as Go's automaxprocs and the JVM do.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def quota_cpus(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup quota allows (quota / period), or None when none is set or readable.

    Reads cgroup v2's ``cpu.max`` (``"<quota> <period>"`` or ``"max <period>"``) at ``root``,
    else cgroup v1's ``cpu/cpu.cfs_quota_us`` and ``cpu/cpu.cfs_period_us`` (quota -1: none).
    """
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        if quota == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def quota_threads(default: int, root: Path = CGROUP_ROOT) -> int:
    """``default`` threads (torch's choice) capped by the CPUs this process may run on: its
    affinity mask and the cgroup quota rounded up (at least 1)."""
    threads = default
    if hasattr(os, "sched_getaffinity"):
        threads = min(threads, len(os.sched_getaffinity(0)))
    cpus = quota_cpus(root)
    if cpus is not None:
        threads = min(threads, max(1, math.ceil(cpus)))
    return max(1, threads)
