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
PROC_CGROUP = Path("/proc/self/cgroup")


def quota_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """CPUs the cgroup quota allows (quota / period), or None when none is set or readable.

    Reads cgroup v2's ``cpu.max`` (``"<quota> <period>"`` or ``"max <period>"``), else cgroup
    v1's ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` (quota -1: none) under ``root/cpu``,
    each in this process's own cgroup (``proc_cgroup``: a systemd unit's) and then at the
    mount's root (a container's namespace, where its own cgroup is the root).
    """
    v2, v1 = _own_cgroups(proc_cgroup)
    for directory in (root / v2, root):
        try:
            quota, period = (directory / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        except (OSError, ValueError):
            continue
    for directory in (root / "cpu" / v1, root / "cpu"):
        try:
            quota_us = int((directory / "cpu.cfs_quota_us").read_text())
            period_us = int((directory / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    return None


def _own_cgroups(proc_cgroup: Path) -> tuple[str, str]:
    """This process's cgroup v2 path and v1 ``cpu`` controller path, relative ("" if unknown):
    lines ``0::/path`` and ``N:cpu,cpuacct:/path`` of ``/proc/self/cgroup``."""
    v2 = v1 = ""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return v2, v1
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if not controllers:
            v2 = path.lstrip("/")
        elif "cpu" in controllers.split(","):
            v1 = path.lstrip("/")
    return v2, v1


def quota_threads(default: int, root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """``default`` threads (torch's choice) capped by the CPUs this process may run on: its
    affinity mask and the cgroup quota rounded up (at least 1)."""
    threads = default
    if hasattr(os, "sched_getaffinity"):
        threads = min(threads, len(os.sched_getaffinity(0)))
    cpus = quota_cpus(root, proc_cgroup)
    if cpus is not None:
        threads = min(threads, max(1, math.ceil(cpus)))
    return max(1, threads)
