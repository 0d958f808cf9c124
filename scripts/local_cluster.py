"""N slotserve replicas behind a real nginx on 127.0.0.1, as processes (tests, benchmarks).

    with local_cluster(["rA", "rB"], workdir, server_args=["--model", "mock"]) as cluster:
        httpx.post(cluster.url + "/generate", json={"prompt": "hi"})

Each replica is ``python -m app serve --replica-id ID`` on a free port; nginx runs the routing of
docker/nginx.conf.template rendered for these ports (scripts/render_nginx.py ``local``). Every
process is ended when the block exits, and its log stays in ``workdir``.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from render_nginx import ROOT, render_local
from server_process import free_port

NGINX_PATHS = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx")


class ClusterError(RuntimeError):
    """A process did not start; the message ends with the tail of its log."""


def find_nginx() -> str | None:
    """The nginx binary (PATH, then the usual sbin folders), or None."""
    found = shutil.which("nginx")
    if found:
        return found
    return next((p for p in NGINX_PATHS if Path(p).is_file()), None)


@dataclass
class Cluster:
    url: str  # nginx
    replicas: dict[str, str] = field(default_factory=dict)  # replica id -> its own URL
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)  # id -> process
    workdir: Path = Path(".")


@contextmanager
def local_cluster(
    replica_ids: Sequence[str],
    workdir: Path,
    *,
    server_args: Sequence[str] = ("--model", "mock"),
    startup_timeout_s: float = 60.0,
) -> Iterator[Cluster]:
    """Starts the replicas, waits for their /health, then nginx in front; ends them all on exit.

    Raises:
        ClusterError: nginx is missing, or a process exited or was not healthy in time.
    """
    nginx = find_nginx()
    if nginx is None:
        raise ClusterError("nginx is not installed (apt-get install nginx)")
    workdir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        replicas: dict[str, str] = {}
        processes: dict[str, subprocess.Popen[bytes]] = {}
        for replica_id in replica_ids:
            port = free_port()
            command = [sys.executable, "-m", "app", "serve", *server_args]
            command += ["--host", "127.0.0.1", "--port", str(port), "--replica-id", replica_id]
            log = workdir / f"replica-{replica_id}.log"
            processes[replica_id] = stack.enter_context(_process(command, log))
            replicas[replica_id] = f"127.0.0.1:{port}"
        for replica_id, address in replicas.items():
            _wait_healthy(f"http://{address}", processes[replica_id], startup_timeout_s)
        listen = f"127.0.0.1:{free_port()}"
        conf = workdir / "nginx.conf"
        conf.write_text(render_local(listen, replicas, workdir))
        command = [nginx, "-p", str(workdir), "-c", str(conf), "-e", str(workdir / "error.log")]
        nginx_process = stack.enter_context(_process(command, workdir / "nginx.log"))
        _wait_healthy(f"http://{listen}", nginx_process, startup_timeout_s)
        yield Cluster(
            url=f"http://{listen}",
            replicas={rid: f"http://{address}" for rid, address in replicas.items()},
            processes=processes,
            workdir=workdir,
        )


@contextmanager
def _process(command: Sequence[str], log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A child process logging to ``log_path``; SIGTERM (then SIGKILL after 10 s) on exit."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
        process.log_path = log_path  # type: ignore[attr-defined]
        try:
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def _wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    log_path: Path = process.log_path  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ClusterError(f"{log_path.stem} exited ({process.returncode}):\n{_tail(log_path)}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise ClusterError(
        f"{log_path.stem}: {url}/health not 200 in {timeout_s:.0f} s:\n{_tail(log_path)}"
    )


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
