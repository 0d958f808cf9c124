"""Load generator for slotserve: the library behind `scripts/load.py`.

    from loadgen import LoadConfig, WorkloadConfig, run_load
    result = await run_load(LoadConfig(url="http://127.0.0.1:8000", concurrency=8,
                                       num_requests=100, workload=WorkloadConfig(output_len=64)))
    result.summary.ttft_ms.p99

Modules: config (what to run), workload (requests and arrival times), protocol (native and
OpenAI wire formats), client (one request -> one record), record (what the client saw), runner
(closed/open loop, `run_load`), stats (percentiles, summary), report (tables, JSON), plot (PNG).
A script with its own mix of requests passes them as `run_load(config, specs=...)`.
"""

from loadgen.config import (
    Api,
    CancelMode,
    CancelPolicy,
    LengthDist,
    LoadConfig,
    Transport,
    WorkloadConfig,
)
from loadgen.record import Chunk, Outcome, RequestRecord
from loadgen.runner import LoadResult, run_load
from loadgen.stats import Distribution, Slo, Summary
from loadgen.workload import RequestSpec

__all__ = [
    "Api",
    "CancelMode",
    "CancelPolicy",
    "Chunk",
    "Distribution",
    "LengthDist",
    "LoadConfig",
    "LoadResult",
    "Outcome",
    "RequestRecord",
    "RequestSpec",
    "Slo",
    "Summary",
    "Transport",
    "WorkloadConfig",
    "run_load",
]
