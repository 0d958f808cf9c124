"""Deployment fixtures: two mock replicas behind a real nginx (harness.cluster)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from harness.cluster import Cluster, find_nginx, local_cluster

MOCK_STEP_MS = 20
REPLICA_IDS = ("rA", "rB")
SERVER_ARGS = ("--model", "mock", "--mock-step-ms", str(MOCK_STEP_MS), "--max-num-seqs", "32")


def start_cluster(workdir: Path) -> AbstractContextManager[Cluster]:
    """Replicas rA and rB (mock, 20 ms a step, 32 slots) behind nginx, all on 127.0.0.1."""
    if find_nginx() is None:
        pytest.skip("nginx is not installed and could not be (.ci/run installs it with apt-get)")
    server_args = [*SERVER_ARGS, "--shutdown-timeout", "10", "--log-level", "warning"]
    return local_cluster(REPLICA_IDS, workdir, server_args=server_args)


@pytest.fixture
def cluster(idle_cluster: Cluster) -> Cluster:
    """The session's cluster (``tests/conftest.py``), shared by tests that leave it idle."""
    return idle_cluster


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A cluster for one test, which may stop its replicas."""
    with start_cluster(tmp_path) as running:
        yield running
