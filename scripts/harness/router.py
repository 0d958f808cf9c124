"""N slotserve replicas behind vllm-router (the cache-aware router), optionally with the edge
nginx in front, all as processes on 127.0.0.1 (tests, scripts/bench_routing.py).

    with routed_cluster(["rA", "rB"], workdir, server_args=["--model", "mock"]) as cluster:
        httpx.post(cluster.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})

What the router asks of a replica (vllm-router 0.1.17, read from its requests): ``GET /health``
(readiness, then every ``--health-check-interval-secs``), ``GET /v1/models``, and before each
request ``POST /v1/completions/render`` or ``/v1/chat/completions/render`` (vLLM's; a 404 makes
it fall back) then ``POST /tokenize`` with the prompt or messages: the token ids its prefix tree
routes on. The OpenAI routes are proxied with extra SGLang fields in the body; the native
``POST /generate`` is not usable through it (it adds ``return_logprob``), and any path it does not
route (``DELETE /generate/{id}``) goes to its first worker only: the edge
(docker/nginx-edge.conf.template) sends those to each replica in turn instead.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from harness.cluster import ClusterError, find_nginx, start_replicas
from harness.edge_conf import render_local_edge
from harness.server import Server, ServerFailed, ServerSpec, free_port, running

# Request-level policies both routers have.
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


@dataclass(frozen=True, slots=True)
class RouterProgram:
    """A router's launcher and the spelling of its quiet log level (the rest of the flags used
    here are common to both: SGLang's router is vllm-router's origin)."""

    launcher: str
    quiet: str
    subcommand: tuple[str, ...] = ()


ROUTERS = {
    "vllm-router": RouterProgram("vllm-router", "warning"),
    # SGLang's router (sglang-router 0.3.2): routes on the request text, never asks /tokenize.
    "sglang-router": RouterProgram("sglang-router", "warn", ("launch",)),
}


def find_router(name: str = "vllm-router") -> str | None:
    """The launcher of router ``name`` (PATH, then beside this Python), or None."""
    launcher = ROUTERS[name].launcher
    return shutil.which(launcher) or shutil.which(launcher, path=str(Path(sys.executable).parent))


@dataclass
class RoutedCluster:
    """Where things answer: ``url`` is the entry (the edge when there is one, else the router)."""

    url: str
    router_url: str
    router_metrics_url: str
    edge_url: str | None = None
    replicas: dict[str, str] = field(default_factory=dict)  # replica id -> its own URL
    servers: dict[str, Server] = field(default_factory=dict)  # replica id -> its process
    workdir: Path = Path(".")


def router_spec(
    router: str,
    worker_urls: Sequence[str],
    *,
    policy: str,
    metrics_port: int,
    flags: Sequence[str] = (),
    program: RouterProgram = ROUTERS["vllm-router"],
) -> ServerSpec:
    """The router at ``router`` (a launcher of ``ROUTERS``) on 127.0.0.1 in front of
    ``worker_urls``, quiet (``program``'s spelling), checking its workers every second at start-up
    (its default waits 30 s between checks); ``flags`` come last."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    argv = (router, *program.subcommand, "--host", "127.0.0.1", "--worker-urls", *worker_urls)
    argv += ("--policy", policy, "--worker-startup-check-interval", "1")
    argv += ("--log-level", program.quiet)
    argv += ("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port), *flags)
    return ServerSpec(f"router-{policy}", argv, has_metrics=False)


@contextmanager
def routed_cluster(
    replica_ids: Sequence[str],
    workdir: Path,
    *,
    server_args: Sequence[str] = ("--model", "mock"),
    policy: str = "cache_aware",
    router: str = "vllm-router",
    router_flags: Sequence[str] = (),
    edge: bool = True,
    startup_timeout_s: float = 60.0,
) -> Iterator[RoutedCluster]:
    """Starts the replicas, waits for their /health, then the router (``router``: a name of
    ``ROUTERS``, with ``policy``, then ``router_flags``), then (``edge``) the edge nginx; ends
    them all on exit, in reverse order.

    Raises:
        ClusterError: vllm-router (or, with ``edge``, nginx) is missing, or a process exited or
            was not healthy in time (the message ends with its log).
    """
    launcher = find_router(router)
    if launcher is None:
        raise ClusterError(f"{router} is not installed (pip install {router})")
    nginx = find_nginx() if edge else None
    if edge and nginx is None:
        raise ClusterError("nginx is not installed (apt-get install nginx)")
    workdir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        servers = start_replicas(stack, replica_ids, server_args, workdir, startup_timeout_s)
        try:
            for server in servers.values():
                server.wait_ready_blocking()
            metrics_port = free_port()
            spec = router_spec(
                launcher,
                [server.url for server in servers.values()],
                policy=policy,
                metrics_port=metrics_port,
                flags=router_flags,
                program=ROUTERS[router],
            )
            routing = stack.enter_context(running(spec, workdir))
            edge_url = None
            if nginx is not None:
                edge_url = stack.enter_context(_edge(nginx, routing, servers.values(), workdir)).url
        except ServerFailed as exc:
            raise ClusterError(str(exc)) from None
        yield RoutedCluster(
            url=edge_url or routing.url,
            router_url=routing.url,
            router_metrics_url=f"http://127.0.0.1:{metrics_port}",
            edge_url=edge_url,
            replicas={rid: server.url for rid, server in servers.items()},
            servers=servers,
            workdir=workdir,
        )


@contextmanager
def _edge(
    nginx: str, routing: Server, replicas: Iterable[Server], workdir: Path
) -> Iterator[Server]:
    """The edge nginx in front of ``routing``, searching ``replicas`` for cancels."""
    listen_port = free_port()
    conf = workdir / "edge.conf"
    addresses = [f"127.0.0.1:{server.port}" for server in replicas]
    listen, router = f"127.0.0.1:{listen_port}", f"127.0.0.1:{routing.port}"
    conf.write_text(render_local_edge(listen, router, addresses, workdir))
    argv = (nginx, "-p", str(workdir), "-c", str(conf), "-e", str(workdir / "edge-error.log"))
    spec = ServerSpec("edge", argv, has_metrics=False, port_flag=None)
    with running(spec, workdir, port=listen_port) as server:
        yield server
