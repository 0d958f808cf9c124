"""The container's CPU quota caps torch's threads when ``--torch-threads`` is unset
(``app.models.load.cpu_quota``): cgroup v2 and v1 files, no quota, unreadable files."""

from __future__ import annotations

import os

import pytest

from app.models.load.cpu_quota import quota_cpus, quota_threads


def write(root, name: str, text: str) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def proc(tmp_path):
    """A /proc/self/cgroup of a container: its own cgroups are the mount's root."""
    path = tmp_path / "proc-self-cgroup"
    path.write_text("1:cpu,cpuacct:/\n0::/\n")
    return path


def test_cgroup_v2_cpu_max(tmp_path, proc):
    write(tmp_path, "cpu.max", "150000 100000\n")
    assert quota_cpus(tmp_path, proc) == 1.5
    write(tmp_path, "cpu.max", "max 100000\n")
    assert quota_cpus(tmp_path, proc) is None


def test_cgroup_v1_cfs_quota(tmp_path, proc):
    write(tmp_path, "cpu/cpu.cfs_quota_us", "50000\n")
    write(tmp_path, "cpu/cpu.cfs_period_us", "100000\n")
    assert quota_cpus(tmp_path, proc) == 0.5
    write(tmp_path, "cpu/cpu.cfs_quota_us", "-1\n")
    assert quota_cpus(tmp_path, proc) is None


def test_the_process_own_cgroup_first(tmp_path):
    # a systemd unit's quota (CPUQuota=) sits in the unit's own cgroup, not at the root
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("0::/system.slice/slotserve.service\n")
    write(tmp_path, "system.slice/slotserve.service/cpu.max", "300000 100000\n")
    assert quota_cpus(tmp_path, proc) == 3.0
    proc.write_text("4:cpu,cpuacct:/slotserve\n")
    write(tmp_path, "cpu/slotserve/cpu.cfs_quota_us", "100000\n")
    write(tmp_path, "cpu/slotserve/cpu.cfs_period_us", "100000\n")
    assert quota_cpus(tmp_path, proc) == 1.0
    proc.write_text("0::/elsewhere\n")  # a path this mount does not show: the root's
    write(tmp_path, "cpu.max", "200000 100000\n")
    assert quota_cpus(tmp_path, proc) == 2.0


def test_no_cgroup_files_or_garbage(tmp_path, proc):
    assert quota_cpus(tmp_path, proc) is None
    assert quota_cpus(tmp_path, tmp_path / "no-such-file") is None
    write(tmp_path, "cpu.max", "garbage\n")
    assert quota_cpus(tmp_path, proc) is None


@pytest.mark.parametrize(
    ("cpu_max", "default", "expected"),
    [
        ("100000 100000", 32, 1),  # one CPU's quota on a big host: one thread
        ("150000 100000", 32, 2),  # a fraction rounds up
        ("20000 100000", 32, 1),  # never below one
        ("max 100000", 2, 2),  # no quota: torch's choice
    ],
)
def test_threads_capped_by_the_quota(tmp_path, proc, cpu_max, default, expected):
    write(tmp_path, "cpu.max", cpu_max)
    affinity = len(os.sched_getaffinity(0))
    assert quota_threads(default, tmp_path, proc) == min(expected, affinity, default)


def test_threads_without_a_quota_keep_torchs_choice_within_the_affinity(tmp_path, proc):
    affinity = len(os.sched_getaffinity(0))
    assert quota_threads(affinity, tmp_path, proc) == affinity
    assert quota_threads(affinity + 8, tmp_path, proc) == affinity
