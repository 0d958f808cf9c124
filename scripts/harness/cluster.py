"""N slotserve replicas behind a real nginx on 127.0.0.1, as processes (tests, benchmarks).

    with local_cluster(["rA", "rB"], workdir, server_args=["--model", "mock"]) as cluster:
        httpx.post(cluster.url + "/generate", json={"prompt": "hi"})

Each replica is ``python -m app serve --replica-id ID`` on a free port (``harness.server``);
nginx runs the routing of docker/nginx.conf.template rendered for these ports
(``harness.nginx_conf.render_local``). Every process is ended when the block exits, and its
log stays in ``workdir``.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from harness.nginx_conf import render_local
from harness.server import Server, ServerFailed, ServerSpec, free_port, running

NGINX_PATHS = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx")


class ClusterError(RuntimeError):
    """nginx is missing, or a process did not start (the message ends with its log)."""


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
    servers: dict[str, Server] = field(default_factory=dict)  # replica id -> its process
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
        servers = start_replicas(stack, replica_ids, server_args, workdir, startup_timeout_s)
        try:
            for server in servers.values():
                server.wait_ready_blocking()
            listen_port = free_port()
            conf = workdir / "nginx.conf"
            addresses = {rid: f"127.0.0.1:{server.port}" for rid, server in servers.items()}
            conf.write_text(render_local(f"127.0.0.1:{listen_port}", addresses, workdir))
            argv = (nginx, "-p", str(workdir), "-c", str(conf), "-e", str(workdir / "error.log"))
            spec = ServerSpec("nginx", argv, has_metrics=False, port_flag=None)
            proxy = stack.enter_context(running(spec, workdir, port=listen_port))
        except ServerFailed as exc:
            raise ClusterError(str(exc)) from None
        yield Cluster(
            url=proxy.url,
            replicas={rid: server.url for rid, server in servers.items()},
            servers=servers,
            workdir=workdir,
        )


def start_replicas(
    stack: ExitStack,
    replica_ids: Sequence[str],
    server_args: Sequence[str],
    workdir: Path,
    startup_timeout_s: float,
) -> dict[str, Server]:
    """Starts one ``python -m app serve *server_args --replica-id ID`` per id (not yet waited
    for), each stopped when ``stack`` closes; by id."""
    servers = {
        replica_id: Server(
            ServerSpec.app(
                f"replica-{replica_id}",
                *server_args,
                "--replica-id",
                replica_id,
                ready_timeout_s=startup_timeout_s,
            ),
            workdir,
        )
        for replica_id in replica_ids
    }
    for server in servers.values():
        stack.callback(server.stop)
        server.start()
    return servers
