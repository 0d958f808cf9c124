"""The ceiling of the HTTP layer: a bare Starlette app answering ``POST /generate`` with the
server's SSE events and no engine (``scenarios/sse_ceiling_app.py``), on uvicorn.

    python scripts/bench_sse_ceiling.py --port 8100
"""

from __future__ import annotations

import argparse

import uvicorn
from scenarios.sse_ceiling_app import create_app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    args = parser.parse_args(argv)
    uvicorn.run(create_app(), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
