"""CPU, memory and CPU starvation of a process (a server under test, or this client), on psutil.

Two figures psutil does not give are read from Linux's ``/proc`` here, and only here: the peak
resident set (``VmHWM`` of ``/proc/PID/status``) and the time threads spent runnable but waiting
for a CPU (``/proc/PID/task/TID/schedstat``, second field, ns: how much the other load on a
shared machine held the process back). Every reading of a process that is gone is NaN.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import psutil

MIB = 2**20


@dataclass(frozen=True, slots=True)
class ProcessStats:
    """Readings of one process (by default, this one)."""

    pid: int = os.getpid()

    def cpu_seconds(self) -> float:
        """User + system CPU seconds so far, all threads."""
        try:
            times = psutil.Process(self.pid).cpu_times()
        except psutil.Error:
            return math.nan
        return times.user + times.system

    def rss_bytes(self) -> float:
        """The resident set now."""
        try:
            return float(psutil.Process(self.pid).memory_info().rss)
        except psutil.Error:
            return math.nan

    def peak_rss_bytes(self) -> float:
        """The largest resident set so far (``VmHWM``)."""
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return float(int(line.split()[1]) * 1024)
        except OSError:
            pass
        return math.nan

    def rss_mib(self) -> dict[str, float]:
        """``{"VmRSS": now, "VmHWM": peak}`` in MiB, one decimal (the benchmarks' reports)."""
        return {
            "VmRSS": round(self.rss_bytes() / MIB, 1),
            "VmHWM": round(self.peak_rss_bytes() / MIB, 1),
        }

    def runqueue_wait_s(self) -> float:
        """Seconds the live threads have spent waiting on a run queue."""
        try:
            threads = psutil.Process(self.pid).threads()
        except psutil.Error:
            return math.nan
        total_ns = 0
        for thread in threads:
            try:
                schedstat = Path(f"/proc/{self.pid}/task/{thread.id}/schedstat").read_text()
                total_ns += int(schedstat.split()[1])
            except (OSError, IndexError, ValueError):
                continue  # the thread ended meanwhile
        return total_ns / 1e9
