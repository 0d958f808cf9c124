"""What a load run sends, how fast, and to where; validated once, when it is built.

`LoadConfig` is frozen: the CLI builds one from its flags, a benchmark script builds one in code,
and nothing changes it afterwards. Invalid combinations raise `ValueError` with a message that
names the flags, so the CLI can show it as a usage error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path


class Api(StrEnum):
    """Which HTTP surface of the server the requests go to."""

    NATIVE = "native"  # POST /generate; SSE `event: token` ... `event: done`
    OPENAI = "openai"  # POST /v1/completions; SSE `data: {...}` ... `data: [DONE]`


class Transport(StrEnum):
    """The HTTP client a run sends with."""

    HTTPX = "httpx"  # streams read event by event (httpx-sse): TTFT, ITL, cancels
    AIOHTTP = "aiohttp"  # less client CPU a request (~3x) and a token: bursts, many streams


class LengthDist(StrEnum):
    """How a prompt or output length is drawn around its mean."""

    FIXED = "fixed"  # always the mean
    UNIFORM = "uniform"  # integers in [mean/2, 3*mean/2]
    EXPONENTIAL = "exponential"  # exponential with that mean, at least 1


class CancelMode(StrEnum):
    """How the client cancels a request it chose to cancel."""

    DELETE = "delete"  # DELETE /generate/{X-Request-Id}, then read the stream to its end
    DISCONNECT = "disconnect"  # close the stream; the server sees the client leave


@dataclass(frozen=True, slots=True)
class CancelPolicy:
    """Which requests the client cancels, when, and how.

    A request is chosen with probability `fraction` (seeded) and cancelled once it has received
    `after_tokens` output tokens. Cancelling needs a stream to count tokens on.
    """

    fraction: float = 0.0
    after_tokens: int = 1
    mode: CancelMode = CancelMode.DELETE

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError("--cancel-fraction must be in [0, 1]")
        if self.after_tokens < 1:
            raise ValueError("--cancel-after-tokens must be >= 1")


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """The requests themselves: lengths, sampling, cancellation; `seed` makes them repeatable.

    Lengths are in tokens. A synthetic prompt is made of common words, about one token each for a
    BPE tokenizer (a byte-level tokenizer sees several tokens per word); the server's reported
    `usage.prompt_tokens` is what the report counts. With `prompts_file`, prompts come from that
    JSONL file in order (cycled), and `prompt_len` is unused.
    """

    prompt_len: int = 128
    output_len: int = 128
    prompt_len_dist: LengthDist = LengthDist.FIXED
    output_len_dist: LengthDist = LengthDist.FIXED
    prompts_file: Path | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    stream: bool = True
    cancel: CancelPolicy = field(default_factory=CancelPolicy)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError("--prompt-len must be >= 1")
        if self.output_len < 1:
            raise ValueError("--output-len must be >= 1")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError("--temperature must be in [0, 2]")
        if self.cancel.fraction > 0 and not self.stream:
            raise ValueError("--cancel-fraction needs --stream (tokens are counted on the stream)")


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """One load run.

    Exactly one of `concurrency` (closed loop: N requests always in flight) and `rate` (open
    loop: arrivals at `rate` req/s, gamma inter-arrival times with shape `burstiness`; `inf`
    sends everything at once). At least one of `num_requests` and `duration_s` bounds the run;
    whichever comes first stops new requests, and requests in flight then finish (each bounded by
    `timeout_s`). SLOs are in milliseconds and only define goodput. With `send_request_ids`
    False no `X-Request-Id` is sent (the server makes one; a load balancer then routes as for
    any client without an id), and a DELETE uses the id the server answered with.
    """

    url: str
    concurrency: int | None = None
    rate: float | None = None
    burstiness: float = 1.0
    num_requests: int | None = None
    duration_s: float | None = None
    api: Api = Api.NATIVE
    api_key: str | None = None
    model: str | None = None
    transport: Transport = Transport.HTTPX
    send_request_ids: bool = True
    timeout_s: float = 300.0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)

    def __post_init__(self) -> None:
        self._check_target()
        self._check_arrivals()
        self._check_bounds()
        self._check_workload_fits_api()

    @property
    def closed_loop(self) -> bool:
        return self.concurrency is not None

    def _check_target(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError("--url must start with http:// or https://")
        if self.timeout_s <= 0:
            raise ValueError("--timeout must be > 0")

    def _check_arrivals(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of --concurrency and --rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("--concurrency must be >= 1")
        if self.rate is not None and not (self.rate > 0 and not math.isnan(self.rate)):
            raise ValueError("--rate must be > 0 (inf sends all requests at once)")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError("--burstiness must be a finite number > 0")

    def _check_bounds(self) -> None:
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give --num-requests, --duration or both: every run is bounded")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("--num-requests must be >= 1")
        if self.duration_s is not None and not (self.duration_s > 0):
            raise ValueError("--duration must be > 0")
        if self.rate is not None and math.isinf(self.rate) and self.num_requests is None:
            raise ValueError("--rate inf sends everything at once: it needs --num-requests")

    def _check_workload_fits_api(self) -> None:
        cancel = self.workload.cancel
        if cancel.fraction > 0 and cancel.mode is CancelMode.DELETE and self.api is Api.OPENAI:
            raise ValueError("--cancel-mode delete needs --api native (DELETE /generate/{id})")
        slo_given = self.slo_ttft_ms is not None or self.slo_tpot_ms is not None
        if slo_given and not self.workload.stream:
            raise ValueError("--slo-ttft-ms/--slo-tpot-ms need --stream (TTFT is a stream time)")
