"""The session's forked processes (``tests/forked_cli.py``): a server the harness starts is a
child of the driver, a process of its own that gets its environment, takes its signals and
exits with its own status; an environment read at import that differs, or a command that is not
this interpreter's module or script, gets a real subprocess; a forked child ends as the
interpreter does."""

from __future__ import annotations

import os
import signal
import sys
import textwrap

import httpx
import psutil
import pytest
from harness.server import ROOT, ServerSpec, free_port, running
from harness.wait import wait_until

from tests.forked_cli import IMPORT_TIME_ENV, ForkedCli, FreshProcessWarning

pytestmark = pytest.mark.slow


def test_the_driver_holds_one_thread(forked_cli: ForkedCli) -> None:
    """It forks from one thread: no pool of OpenMP, OpenBLAS or tokenizers runs in it."""
    forked_cli.run("-m", "app", "--help")  # answered: the driver's imports are done
    assert len(os.listdir(f"/proc/{forked_cli.pid}/task")) == 1


def test_the_driver_loads_nothing_that_reads_a_variable_left_out_of_import_time_env(
    forked_cli: ForkedCli, tmp_path
) -> None:
    """``IMPORT_TIME_ENV`` leaves out ``KMP_*``, ``TORCHINDUCTOR_*`` and ``HF_*``, which the
    session's own imports set: a child holds what the driver loaded, and none of their
    readers is among it."""
    script = tmp_path / "loaded.py"
    script.write_text(
        "import sys\n"
        "modules = ('huggingface_hub', 'transformers', 'torch._inductor')\n"
        "print(*(m for m in modules if m in sys.modules))\n"
        "print(*(line.split()[-1] for line in open('/proc/self/maps') if 'libiomp' in line))\n"
    )
    assert forked_cli.run(str(script), cwd=tmp_path).stdout.split() == []
    assert not {"KMP_", "TORCHINDUCTOR_", "HF_"} & set(IMPORT_TIME_ENV)


def test_a_server_is_a_forked_child_of_its_own(forked_processes: ForkedCli, tmp_path) -> None:
    spec = ServerSpec.mock("forked", step_ms=1, max_num_seqs=2, flags=("--log-level", "info"))
    with running(spec, tmp_path) as server:
        process = psutil.Process(server.pid)
        assert process.ppid() == forked_processes.pid
        assert server.pid not in (os.getpid(), forked_processes.pid)
        assert process.cwd() == str(ROOT)
        assert httpx.get(server.url + "/health").status_code == 200
        server.signal(signal.SIGTERM)
        assert server.wait(15) == 0
    assert server.returncode == 0
    assert "Uvicorn running on" in server.log_path.read_text()  # its stdout and stderr


def test_a_forked_server_reads_the_environment_it_is_given(
    forked_processes: ForkedCli, tmp_path
) -> None:
    """The launcher's environment is the child's (the harness's own drops ``SLOTSERVE_*``):
    the server listens on the port only its environment names."""
    port = free_port()
    env = {**os.environ, "SLOTSERVE_PORT": str(port)}
    argv = [sys.executable, "-m", "app", "serve", "--model", "mock", "--log-level", "warning"]
    log = tmp_path / "env.log"
    process = forked_processes.launch(argv, cwd=ROOT, env=env, log_path=log)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert process.poll() is None, log.read_text()
        try:
            return httpx.get(url + "/health").status_code == 200
        except httpx.TransportError:
            return False

    try:
        assert psutil.Process(process.pid).ppid() == forked_processes.pid
        wait_until(healthy, 60, what="the server's health")
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0


def test_an_environment_read_at_import_that_differs_gets_a_real_subprocess(
    forked_processes: ForkedCli, tmp_path, monkeypatch
) -> None:
    omp = os.environ.get("OMP_NUM_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "3" if omp != "3" else "2")
    argv = (sys.executable, "-m", "app", "serve")
    assert not forked_processes.forks(argv, os.environ)
    spec = ServerSpec.mock("omp", step_ms=1, max_num_seqs=1)
    with pytest.warns(FreshProcessWarning, match="OMP_NUM_THREADS"), running(spec, tmp_path) as s:
        assert psutil.Process(s.pid).ppid() == os.getpid()
    monkeypatch.undo()
    assert forked_processes.forks(argv, os.environ)
    assert not forked_processes.forks((sys.executable, "-c", "pass"), os.environ)
    assert not forked_processes.forks(("/usr/sbin/nginx", "-c", "x"), os.environ)


def test_a_child_ends_as_the_interpreter_does(forked_cli: ForkedCli, tmp_path) -> None:
    """Its non-daemon threads are joined and its atexit functions run before it exits with
    its own status; an uncaught KeyboardInterrupt ends it by SIGINT."""
    script = tmp_path / "ending.py"
    script.write_text(
        textwrap.dedent(
            """
            import atexit, sys, threading
            atexit.register(print, "atexit ran")
            threading.Thread(target=print, args=("thread joined",)).start()
            if sys.argv[1:] == ["interrupt"]:
                raise KeyboardInterrupt
            sys.exit(3)
            """
        )
    )
    done = forked_cli.run(str(script), cwd=tmp_path)
    assert done.returncode == 3
    assert done.stdout.splitlines() == ["thread joined", "atexit ran"]
    interrupted = forked_cli.run(str(script), "interrupt", cwd=tmp_path)
    assert interrupted.returncode == -signal.SIGINT
    assert "KeyboardInterrupt" in interrupted.stderr
