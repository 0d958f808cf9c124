"""The session's tiny model checkpoints (``tests/checkpoints.py``), its forked command line and
servers (``tests/forked_cli.py``) and its idle nginx cluster (``tests/deploy/conftest.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from harness.server import set_launcher

from tests.checkpoints import TinyCheckpoints
from tests.forked_cli import ForkedCli

_artifacts: list[str] = []  # ("artifact", path) properties of the run's reports (tests/ui)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _artifacts.extend(value for name, value in report.user_properties if name == "artifact")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for path in _artifacts:
        terminalreporter.write_line(f"tests/ui artifact: {path}")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    """Tiny random-weight HF directories and GGUF files (``tests/checkpoints.py``), each variant
    built once per session: ``tiny_checkpoints.hf("qwen2")``,
    ``tiny_checkpoints.gguf("llama", "Q4_K", tied=False)``."""
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny-checkpoints"))


@pytest.fixture(scope="session", autouse=True)
def forked_processes() -> Iterator[ForkedCli]:
    """The session's driver of forked processes (``tests/forked_cli.py``), one per xdist worker,
    started by the first process asked of it. Every server the harness starts in this session
    (``scripts/harness/server.py``: the tests' own, and those of the scripts they run) is its
    forked child when it can be, a real subprocess when not (``ForkedCli.forks``)."""
    driver = ForkedCli()
    previous = set_launcher(driver.launch)
    try:
        yield driver
    finally:
        set_launcher(previous)
        driver.close()


@pytest.fixture(scope="session")
def forked_cli(forked_processes: ForkedCli) -> ForkedCli:
    """``forked_cli.run("-m", "app", "serve", ...)``: the command line as a fresh process whose
    imports were paid once per session (``tests/forked_cli.py``)."""
    forked_processes.start()  # its imports run while the session goes on to the first run
    return forked_processes


@pytest.fixture(scope="session")
def idle_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """Two mock replicas behind nginx (``tests.deploy.conftest.start_cluster``), started once for
    the tests of tests/deploy and tests/ui that leave it as they found it: no request running,
    both replicas up (counters are read as differences). A test that stops a replica or needs
    fresh counters starts its own (``own_cluster``)."""
    from tests.deploy.conftest import start_cluster

    with start_cluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running
