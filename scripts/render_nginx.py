"""Renders docker/nginx.conf.template (the routing rules) for one environment.

    python scripts/render_nginx.py compose -o docker/nginx.conf
    python scripts/render_nginx.py edge-compose -o docker/nginx-edge.conf
    python scripts/render_nginx.py edge-k8s -o deploy/k8s/edge-nginx.conf
    python scripts/render_nginx.py local --listen 127.0.0.1:8080 --workdir /tmp/lb \\
        --replica rA=127.0.0.1:8001 --replica rB=127.0.0.1:8002 -o /tmp/lb/nginx.conf

The rendering itself, and what each environment fills in, is ``harness/nginx_conf.py`` (the
edge in front of the cache-aware router: ``harness/edge_conf.py``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from harness.edge_conf import render_compose_edge, render_k8s_edge
from harness.nginx_conf import render_compose, render_local


def _replica_arg(text: str) -> tuple[str, str]:
    replica_id, sep, address = text.partition("=")
    if not sep or not address:
        raise argparse.ArgumentTypeError(f"expected ID=HOST:PORT, got {text!r}")
    return replica_id, address


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("env", choices=["compose", "local", "edge-compose", "edge-k8s"])
    parser.add_argument("-o", "--output", type=Path, help="write here (default: stdout)")
    parser.add_argument("--listen", default="127.0.0.1:8080", help="local: nginx's address")
    parser.add_argument("--workdir", type=Path, help="local: nginx's prefix (-p) folder")
    parser.add_argument(
        "--replica", type=_replica_arg, action="append", default=[], help="local: ID=HOST:PORT"
    )
    args = parser.parse_args(argv)
    if args.env == "compose":
        text = render_compose()
    elif args.env == "edge-compose":
        text = render_compose_edge()
    elif args.env == "edge-k8s":
        text = render_k8s_edge()
    else:
        if not args.replica or args.workdir is None:
            parser.error("local needs --workdir and at least one --replica")
        text = render_local(args.listen, dict(args.replica), args.workdir)
    if args.output is None:
        print(text, end="")
    else:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
