"""What the client saw of one request: a frozen record, with its latencies derived on demand.

Times are seconds on the run's clock (0 = the run's start, monotonic). Only the raw observations
are stored (when it was sent, when each piece of text arrived, when it ended); TTFT, ITL, TPOT and
end-to-end latency are properties computed from them, so they can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from itertools import pairwise

from loadgen.workload import RequestSpec


class Outcome(StrEnum):
    """How a request ended, from the client's side."""

    OK = "ok"  # a final answer (stop or length)
    CANCELLED = "cancelled"  # the client cancelled it (DELETE or disconnect)
    REJECTED = "rejected"  # 429 overloaded or 503 unavailable
    ERROR = "error"  # any other non-2xx, an `event: error`, or a malformed answer
    TRANSPORT_ERROR = "transport_error"  # connection failed, reset, or --timeout hit


@dataclass(frozen=True, slots=True)
class Chunk:
    """Output text that arrived: when (run clock, s) and how many tokens it carries.

    A stream event's tokens are its `token_ids` (1 when the API sends none); tokens of events
    whose text was held back count with the next event that has text. A non-streamed answer is
    one chunk with all its tokens.
    """

    at: float
    tokens: int


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request from send to end. `error` names the failure, e.g. "429 overloaded"."""

    spec: RequestSpec
    streamed: bool
    started_at: float
    finished_at: float
    outcome: Outcome
    error: str | None = None
    status: int | None = None  # HTTP status; None when no response arrived
    finish_reason: str | None = None
    prompt_tokens: int | None = None  # from the server's usage
    output_tokens: int = 0  # the server's usage.completion_tokens, else the tokens counted
    chunks: tuple[Chunk, ...] = ()
    token_ids: tuple[int, ...] = ()  # the answer's token ids where the API sends them (native)
    final_events: int = 0  # final events the server sent (a whole answer counts one)
    cancel_confirmed: bool | None = None  # the DELETE was answered 200; None: none was sent
    server_request_id: str | None = None  # X-Request-Id of the answer

    @property
    def e2e_s(self) -> float:
        """End-to-end latency: send to the end of the answer (or to the client leaving)."""
        return self.finished_at - self.started_at

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: send to the first non-empty text; None without a stream."""
        if not self.streamed or not self.chunks:
            return None
        return self.chunks[0].at - self.started_at

    @property
    def itl_s(self) -> tuple[float, ...]:
        """Inter-token latencies: gaps between consecutive stream events that carry text."""
        return tuple(b.at - a.at for a, b in pairwise(self.chunks))

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
        ttft = self.ttft_s
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - ttft) / (self.output_tokens - 1)
