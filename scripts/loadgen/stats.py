"""Summary statistics of a run, computed from its request records.

Percentiles interpolate linearly between closest ranks (Hyndman & Fan type 7, the default
`method="linear"` of `numpy.percentile`): for n sorted values x[0..n-1], the q-th percentile sits
at rank h = (n - 1) * q / 100 and is x[floor h] + (h - floor h) * (x[floor h + 1] - x[floor h]).
So p0 is the minimum, p100 the maximum, and p50 of an even count is the mean of the middle two.

Which requests count where:
- Latencies (TTFT, TPOT, ITL, E2E) use requests whose outcome is ok. ITL pools every gap of every
  such request, so long outputs weigh more (as `vllm bench serve` does); TPOT is one value per
  request with at least 2 output tokens. TTFT, TPOT and ITL exist only for streamed requests.
- Throughputs divide by `duration_s`, the run's first send to its last end. Request throughput
  counts ok requests. Output token throughput counts the output tokens of ok and cancelled
  requests (tokens the server generated and delivered); total token throughput adds those
  requests' prompt tokens as the server reported them.
- Goodput is ok requests per second whose TTFT <= the TTFT SLO and TPOT <= the TPOT SLO, each
  checked only when given (a request with one output token has no TPOT and meets that SLO).
  Without any SLO there is no goodput.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from loadgen.record import Outcome, RequestRecord

PERCENTILES = (50, 90, 99)
DELIVERED = (Outcome.OK, Outcome.CANCELLED)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of a non-empty sample, linear interpolation."""
    if not values:
        raise ValueError("percentile of an empty sample")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside [0, 100]")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lower = math.floor(rank)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (rank - lower) * (ordered[upper] - ordered[lower])


@dataclass(frozen=True, slots=True)
class Distribution:
    """Count, mean, p50/p90/p99 and max of a latency sample, in milliseconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of_seconds(cls, seconds: Iterable[float]) -> Distribution | None:
        """Summarise a sample given in seconds; None for an empty one."""
        ms = [value * 1000.0 for value in seconds]
        if not ms:
            return None
        p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
        return cls(count=len(ms), mean=sum(ms) / len(ms), p50=p50, p90=p90, p99=p99, max=max(ms))


@dataclass(frozen=True, slots=True)
class Slo:
    """Service-level objectives in milliseconds; None means not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met_by(self, record: RequestRecord) -> bool:
        if record.outcome is not Outcome.OK:
            return False
        ttft, tpot = record.ttft_s, record.tpot_s
        if self.ttft_ms is not None and (ttft is None or ttft * 1000.0 > self.ttft_ms):
            return False
        return self.tpot_ms is None or tpot is None or tpot * 1000.0 <= self.tpot_ms


@dataclass(frozen=True, slots=True)
class Summary:
    """The run in numbers; throughputs per second of `duration_s`, latencies in ms."""

    duration_s: float
    requests: int
    outcomes: dict[str, int]  # every Outcome's value, zeros included
    errors: dict[str, int]  # error kind ("429 overloaded", "transport ConnectError") -> count
    prompt_tokens: int
    output_tokens: int
    request_throughput: float  # ok req/s
    output_token_throughput: float  # tok/s
    total_token_throughput: float  # tok/s, prompt + output
    goodput: float | None  # req/s meeting the SLOs; None without SLOs
    ttft_ms: Distribution | None
    tpot_ms: Distribution | None
    itl_ms: Distribution | None
    e2e_ms: Distribution | None


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo) -> Summary:
    ok = [record for record in records if record.outcome is Outcome.OK]
    delivered = [record for record in records if record.outcome in DELIVERED]
    prompt_tokens = sum(record.prompt_tokens or 0 for record in delivered)
    output_tokens = sum(record.output_tokens for record in delivered)
    counts = Counter(record.outcome for record in records)
    errors = Counter(record.error for record in records if record.error is not None)
    goodput = per_second(sum(slo.met_by(r) for r in ok), duration_s) if slo.given else None
    return Summary(
        duration_s=duration_s,
        requests=len(records),
        outcomes={outcome.value: counts[outcome] for outcome in Outcome},
        errors=dict(errors.most_common()),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        request_throughput=per_second(len(ok), duration_s),
        output_token_throughput=per_second(output_tokens, duration_s),
        total_token_throughput=per_second(prompt_tokens + output_tokens, duration_s),
        goodput=goodput,
        ttft_ms=Distribution.of_seconds(r.ttft_s for r in ok if r.ttft_s is not None),
        tpot_ms=Distribution.of_seconds(r.tpot_s for r in ok if r.tpot_s is not None),
        itl_ms=Distribution.of_seconds(gap for r in ok for gap in r.itl_s),
        e2e_ms=Distribution.of_seconds(r.e2e_s for r in ok),
    )


def per_second(amount: float, duration_s: float) -> float:
    return amount / duration_s if duration_s > 0 else 0.0


def tokens_per_second(records: Iterable[RequestRecord], bin_s: float = 1.0) -> list[float]:
    """Output tokens received per second in consecutive bins of `bin_s` from the run's start.

    Each chunk's tokens count in the bin where the chunk arrived, whatever the request's outcome.
    """
    totals: Counter[int] = Counter()
    for record in records:
        for chunk in record.chunks:
            totals[math.floor(chunk.at / bin_s)] += chunk.tokens
    if not totals:
        return []
    return [totals[index] / bin_s for index in range(max(totals) + 1)]
