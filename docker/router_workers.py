"""Registers every replica of a compose service with vllm-router (compose.yaml's `router` profile).

    python router_workers.py --router http://router:30000 --service slotserve --port 8000

vllm-router takes a fixed list of worker URLs, or discovers pods on Kubernetes; under compose the
replicas are the addresses Docker's DNS gives for the service name (one per container after
`--scale slotserve=N`). This asks the DNS once, and adds each address with the router's
`POST /add_worker?url=...`; run it again after a rescale. Standard library only: it runs in the
router's image. Exits 1 when the router or the replicas cannot be reached in ``--wait-s``.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence

POLL_S = 1.0


def replica_addresses(service: str) -> list[str]:
    """Every IPv4 address Docker's DNS has for ``service`` (sorted; empty if none yet)."""
    try:
        infos = socket.getaddrinfo(service, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return sorted({info[4][0] for info in infos})


def add_worker(router: str, worker_url: str) -> bool:
    """True once the router has ``worker_url`` (it answers 200, or says it has it already)."""
    query = urllib.parse.urlencode({"url": worker_url})
    request = urllib.request.Request(f"{router}/add_worker?{query}", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status == 200
    except urllib.error.HTTPError as error:
        return "already exists" in error.read().decode(errors="replace")
    except OSError:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", default="http://router:30000")
    parser.add_argument("--service", default="slotserve")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--wait-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.wait_s
    pending = []
    while time.monotonic() < deadline:
        addresses = replica_addresses(args.service)
        pending = [f"http://{address}:{args.port}" for address in addresses]
        pending = [url for url in pending if not add_worker(args.router, url)]
        if addresses and not pending:
            print(f"router-workers: {len(addresses)} replicas added to {args.router}")
            return 0
        time.sleep(POLL_S)
    print(f"router-workers: not added in {args.wait_s:g} s: {pending or args.service}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
