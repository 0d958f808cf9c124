"""What every benchmark, soak and test measures with (importable: scripts/ is on the path of a
script run as ``python scripts/x.py`` and of pytest, ``pythonpath`` in pyproject.toml).

- ``server``: a server subprocess on a free port (``ServerSpec``, ``Server``, ``running``,
  ``launched``), ready once ``/health`` answers;
- ``cluster``: N replicas behind a real nginx (``local_cluster``), with ``nginx_conf``, the
  rendering of docker/nginx.conf.template;
- ``router``: N replicas behind vllm-router or sglang-router (``routed_cluster``), the edge
  nginx in front, with ``edge_conf``, the rendering of docker/nginx-edge.conf.template;
- ``threaded_server``: an ASGI app under uvicorn in a thread of this process (tests);
- ``metrics``: ``/metrics`` scraped and read, deltas, the one histogram quantile;
- ``sse``: Server-Sent Events read with httpx-sse (``EventStream``, ``parse_events``);
- ``process_stats``: CPU, memory and CPU starvation of a process, on psutil;
- ``wait``: waiting for a condition, never for a time (``wait_for``, ``wait_until``);
- ``measure``: a loadgen run marked with server-side snapshots (metrics, CPU) at chosen instants.

The load itself is ``loadgen``; what is measured with it is ``scenarios``.
"""
