"""Server subprocesses for scripts and tests: ``python -m app serve ...`` on a free port of
127.0.0.1, its output in a log file (shown when it fails to start), stopped with SIGTERM.

    with running(ServerSpec.app("mock", "--model", "mock"), log_dir) as server:
        httpx.get(server.url + "/health")

``launched`` is the asyncio form that starts several at once (they load in parallel).
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """What to start: ``argv`` gets ``--port N`` appended; `ceiling` servers have no /metrics."""

    name: str
    argv: tuple[str, ...]
    has_metrics: bool = True
    ready_timeout_s: float = 60.0

    @classmethod
    def app(cls, name: str, *flags: str, ready_timeout_s: float = 60.0) -> ServerSpec:
        argv = (
            sys.executable,
            "-m",
            "app",
            "serve",
            "--host",
            "127.0.0.1",
            "--log-level",
            "warning",
            "--shutdown-timeout",
            "5",
            *flags,
        )
        return cls(name, argv, has_metrics=True, ready_timeout_s=ready_timeout_s)

    @classmethod
    def mock(
        cls, name: str, *, step_ms: float, max_num_seqs: int, flags: tuple[str, ...] = ()
    ) -> ServerSpec:
        """Our server with the mock model (``step_ms`` per step, ``max_num_seqs`` slots)."""
        return cls.app(
            name,
            "--model",
            "mock",
            "--mock-step-ms",
            str(step_ms),
            "--max-num-seqs",
            str(max_num_seqs),
            *flags,
        )

    @classmethod
    def ceiling(cls, name: str) -> ServerSpec:
        argv = (sys.executable, str(SCRIPTS / "bench_sse_ceiling.py"), "--host", "127.0.0.1")
        return cls(name, argv, has_metrics=False)


class Server:
    """One server subprocess; its output goes to a log file, shown when it fails to start."""

    def __init__(self, spec: ServerSpec, log_dir: Path) -> None:
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{spec.name}-{self.port}.log"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTSERVE_")}
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                [*self.spec.argv, "--port", str(self.port)],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    async def wait_ready(self) -> None:
        """Polls /health until 200; raises RuntimeError (with the log's tail) on exit or timeout."""
        deadline = time.monotonic() + self.spec.ready_timeout_s
        async with httpx.AsyncClient(trust_env=False, timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self._process is None or self._process.poll() is not None:
                    raise RuntimeError(f"{self.spec.name} exited at start-up:\n{self.log_tail()}")
                try:
                    if (await http.get(self.url + "/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
        raise RuntimeError(f"{self.spec.name} not healthy in time:\n{self.log_tail()}")

    def wait_ready_blocking(self) -> None:
        """``wait_ready`` for code without an event loop."""
        deadline = time.monotonic() + self.spec.ready_timeout_s
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited at start-up:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.spec.name} not healthy in time:\n{self.log_tail()}")

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.poll()

    def signal(self, signum: int) -> None:
        if self._process is not None:
            self._process.send_signal(signum)

    def wait(self, timeout_s: float) -> int:
        """Waits for the process to exit; returns its status."""
        if self._process is None:
            raise RuntimeError("not started")
        return self._process.wait(timeout=timeout_s)

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the server process so far (all its threads)."""
        if self._process is None:
            return math.nan
        try:
            stat = Path(f"/proc/{self._process.pid}/stat").read_text()
        except OSError:
            return math.nan
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": fields 3.. of proc(5)
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS

    def wait_seconds(self) -> float:
        """Seconds the server's threads spent runnable but waiting for a CPU."""
        return math.nan if self._process is None else runqueue_wait_s(str(self._process.pid))

    def stop(self) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def runqueue_wait_s(pid: str) -> float:
    """Sum over the live threads of ``pid`` of their time waiting on a run queue
    (``/proc/PID/task/TID/schedstat``, second field, ns): CPU starvation on a shared machine."""
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return math.nan
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@asynccontextmanager
async def launched(specs: Sequence[ServerSpec], log_dir: Path) -> AsyncIterator[list[Server]]:
    """Starts every server at once (they load in parallel), waits until all are healthy, and
    terminates them all when the block ends, whatever happened."""
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
def running(spec: ServerSpec, log_dir: Path) -> Iterator[Server]:
    """One server, healthy inside the block and stopped when it ends."""
    log_dir.mkdir(parents=True, exist_ok=True)
    server = Server(spec, log_dir)
    try:
        server.start()
        server.wait_ready_blocking()
        yield server
    finally:
        server.stop()
