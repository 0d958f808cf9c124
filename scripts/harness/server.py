"""Server subprocesses for scripts and tests: a program (``python -m app serve ...``, the SSE
ceiling app, llama.cpp's server, nginx) on a free port of 127.0.0.1, its output in a log file
(shown when it fails to start), ready once ``/health`` answers 200, stopped with SIGTERM.

    with running(ServerSpec.mock("mock", step_ms=10, max_num_seqs=8), log_dir) as server:
        httpx.get(server.url + "/health")

``launched`` is the asyncio form that starts several at once (they load in parallel).

How a process is started is the module's launcher: a real subprocess (:func:`popen`) unless
:func:`set_launcher` installed another (the test suite's starts ``python -m app serve`` as a
child forked from a process that has imported the app already, ``tests/forked_cli.py``).
"""

from __future__ import annotations

import asyncio
import os
import signal as signals
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from harness.process_stats import ProcessStats
from harness.wait import wait_for, wait_until

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
STOP_TIMEOUT_S = 20.0
HEALTH_POLL_S = 0.05


def server_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """A started server's environment: ``environ`` less its ``SLOTSERVE_*`` variables (the
    server's settings come from its command line alone), but for ``SLOTSERVE_GGML_*`` (which
    kernels compute, e.g. ``SLOTSERVE_GGML_ISA=avx2`` for docs/MODEL_PERF.md's AVX2-code runs:
    without it a benchmark's server took the CPU's best set while llama.cpp ran its AVX2 build)."""
    return {
        k: v
        for k, v in environ.items()
        if not k.startswith("SLOTSERVE_") or k.startswith("SLOTSERVE_GGML_")
    }


class ServerFailed(RuntimeError):
    """A server exited at start-up or did not become healthy; the message ends with its log."""


class ServerProcess(Protocol):
    """A started server process, as :class:`Server` drives it (:class:`subprocess.Popen`'s
    names): ``wait`` raises :class:`subprocess.TimeoutExpired` when it is still running."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class Launcher(Protocol):
    """Starts ``argv`` in ``cwd`` with exactly ``env``, standard input from /dev/null, standard
    output and error into ``log_path`` (created or truncated before it returns)."""

    def __call__(
        self, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], log_path: Path
    ) -> ServerProcess: ...


def popen(
    argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], log_path: Path
) -> subprocess.Popen:
    """The default launcher: ``argv`` as a fresh subprocess."""
    with log_path.open("wb") as log:
        return subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


_launcher: Launcher = popen


def set_launcher(launcher: Launcher | None) -> Launcher:
    """Makes ``launcher`` start every server from now on (None: :func:`popen` again); returns
    the one it replaces, to be set back."""
    global _launcher
    previous, _launcher = _launcher, launcher or popen
    return previous


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """What to start.

    Attributes:
        name: names its log file.
        argv: the command; ``port_flag`` and the port are appended.
        has_metrics: it serves ``/metrics`` (ours does; the ceiling app and llama.cpp do not).
        ready_timeout_s: how long it may take to answer ``/health``.
        port_flag: the flag that sets its port; None when its own config names it (nginx).
    """

    name: str
    argv: tuple[str, ...]
    has_metrics: bool = True
    ready_timeout_s: float = 60.0
    port_flag: str | None = "--port"

    @classmethod
    def app(cls, name: str, *flags: str, ready_timeout_s: float = 60.0) -> ServerSpec:
        """``python -m app serve`` on 127.0.0.1, quiet (no access log), a 5 s drain; ``flags``
        come last, so they win over these."""
        argv = (sys.executable, "-m", "app", "serve", "--host", "127.0.0.1")
        argv += ("--log-level", "warning", "--shutdown-timeout", "5", *flags)
        return cls(name, argv, ready_timeout_s=ready_timeout_s)

    @classmethod
    def mock(
        cls, name: str, *, step_ms: float, max_num_seqs: int, flags: Sequence[str] = ()
    ) -> ServerSpec:
        """Our server with the mock model (``step_ms`` per step, ``max_num_seqs`` slots)."""
        mock = ("--model", "mock", "--mock-step-ms", f"{step_ms:g}")
        return cls.app(name, *mock, "--max-num-seqs", str(max_num_seqs), *flags)

    @classmethod
    def ceiling(cls, name: str) -> ServerSpec:
        """The bare SSE app of ``scripts/bench_sse_ceiling.py`` (no engine, no /metrics)."""
        argv = (sys.executable, str(SCRIPTS / "bench_sse_ceiling.py"), "--host", "127.0.0.1")
        return cls(name, argv, has_metrics=False)


class Server:
    """One server subprocess.

    Args:
        spec: what to run.
        log_dir: where its log goes (``<name>-<port>.log``).
        port: the port (default: a free one).
    """

    def __init__(self, spec: ServerSpec, log_dir: Path, *, port: int | None = None) -> None:
        self.spec = spec
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{spec.name}-{self.port}.log"
        self._process: ServerProcess | None = None

    def start(self) -> None:
        """Starts the process through the module's launcher (:func:`set_launcher`), in the
        repository, with :func:`server_environment`."""
        env = server_environment(os.environ)
        argv = [*self.spec.argv]
        if self.spec.port_flag is not None:
            argv += [self.spec.port_flag, str(self.port)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._process = _launcher(argv, cwd=ROOT, env=env, log_path=self.log_path)

    async def wait_ready(self) -> None:
        """Returns once ``/health`` answers 200.

        Raises:
            ServerFailed: the process exited, or it was not healthy in time.
        """
        async with httpx.AsyncClient(trust_env=False, timeout=2.0) as http:

            async def healthy() -> bool:
                self._check_alive()
                try:
                    return (await http.get(self.url + "/health")).status_code == 200
                except httpx.TransportError:
                    return False

            try:
                await wait_for(healthy, self.spec.ready_timeout_s, poll_s=HEALTH_POLL_S)
            except AssertionError:
                raise ServerFailed(self._failure("not healthy in time")) from None

    def wait_ready_blocking(self) -> None:
        """``wait_ready`` for code without an event loop."""

        def healthy() -> bool:
            self._check_alive()
            try:
                return httpx.get(self.url + "/health", timeout=2.0).status_code == 200
            except httpx.TransportError:
                return False

        try:
            wait_until(healthy, self.spec.ready_timeout_s, poll_s=HEALTH_POLL_S)
        except AssertionError:
            raise ServerFailed(self._failure("not healthy in time")) from None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def stats(self) -> ProcessStats:
        """CPU, memory and starvation readings of the server process."""
        if self._process is None:
            raise RuntimeError(f"{self.spec.name} is not started")
        return ProcessStats(self._process.pid)

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.poll()

    def signal(self, signum: int) -> None:
        if self._process is not None:
            self._process.send_signal(signum)

    def wait(self, timeout_s: float) -> int:
        """Waits for the process to exit; returns its status."""
        if self._process is None:
            raise RuntimeError(f"{self.spec.name} is not started")
        return self._process.wait(timeout=timeout_s)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``STOP_TIMEOUT_S``."""
        if self._process is None or self._process.poll() is not None:
            return
        self._process.send_signal(signals.SIGTERM)
        try:
            self._process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _check_alive(self) -> None:
        if self._process is None or self._process.poll() is not None:
            raise ServerFailed(self._failure(f"exited at start-up ({self.returncode})"))

    def _failure(self, what: str) -> str:
        return f"{self.spec.name} ({self.url}) {what}:\n{self.log_tail()}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@asynccontextmanager
async def launched(specs: Sequence[ServerSpec], log_dir: Path) -> AsyncIterator[list[Server]]:
    """Starts every server at once (they load in parallel), waits until all are healthy, and
    stops them all when the block ends, whatever happened."""
    servers = [Server(spec, log_dir) for spec in specs]
    try:
        for server in servers:
            server.start()
        await asyncio.gather(*(server.wait_ready() for server in servers))
        yield servers
    finally:
        for server in servers:
            server.stop()


@contextmanager
def running(spec: ServerSpec, log_dir: Path, *, port: int | None = None) -> Iterator[Server]:
    """One server, healthy inside the block and stopped when it ends."""
    server = Server(spec, log_dir, port=port)
    try:
        server.start()
        server.wait_ready_blocking()
        yield server
    finally:
        server.stop()
