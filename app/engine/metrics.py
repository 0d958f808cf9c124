"""Prometheus metrics of one engine, in its own registry (so several apps can live in one process).

Names follow ``../shared/API.md``. Gauges are derived from the scheduler when scraped (rule:
derive, don't store), so they can never drift from the real queue and slot state.

The same engine metrics are also rendered under vLLM's names (API.md "Metrics under vLLM's
names"), so that routers, the Gateway API Inference Extension's endpoint picker and autoscalers
read a replica as they read a vLLM pod: ``VllmNamedMetrics`` renames at scrape time what the
engine's registry holds, so the two sets of names always agree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

# Buckets in seconds, chosen to resolve both the mock (sub-ms steps) and a CPU model (tens of ms).
_LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
_LOOP_LAG_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
# How often the event loop's lag is sampled (app.api.server.watch_event_loop_lag), in seconds.
EVENT_LOOP_LAG_INTERVAL_S = 0.01
_BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)

# vLLM's family name for each of ours that has the same meaning (kind and unit included).
# A counter's family name has no ``_total``; its sample is ``<family>_total``.
VLLM_FAMILY_NAMES = {
    "slotserve_requests_running": "vllm:num_requests_running",
    "slotserve_requests_waiting": "vllm:num_requests_waiting",
    "slotserve_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
    "slotserve_prefix_cache_queries": "vllm:prefix_cache_queries",
    "slotserve_prefix_cache_hits": "vllm:prefix_cache_hits",
    "slotserve_prompt_tokens": "vllm:prompt_tokens",
    "slotserve_generated_tokens": "vllm:generation_tokens",
    "slotserve_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "slotserve_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "slotserve_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "slotserve_spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    "slotserve_spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "slotserve_spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}


class EngineMetrics:
    """The engine's counters and histograms; ``render()`` gives the Prometheus text format."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests_waiting = Gauge(
            "slotserve_requests_waiting", "Requests waiting for a batch slot.", registry=r
        )
        self.requests_running = Gauge(
            "slotserve_requests_running", "Requests holding a batch slot.", registry=r
        )
        self.requests_finished = Counter(
            "slotserve_requests_finished",
            "Requests that ended, by finish_reason.",
            ["finish_reason"],
            registry=r,
        )
        self.requests_rejected = Counter(
            "slotserve_requests_rejected",
            "Requests refused before they were queued, by error type.",
            ["type"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "slotserve_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generated_tokens = Counter(
            "slotserve_generated_tokens", "Tokens generated (sampled).", registry=r
        )
        self.time_to_first_token = Histogram(
            "slotserve_time_to_first_token_seconds",
            "From arrival to the first generated token.",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "slotserve_inter_token_latency_seconds",
            "Between two consecutive generated tokens of one request.",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.request_latency = Histogram(
            "slotserve_request_latency_seconds",
            "From arrival to the final event.",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.batch_size = Histogram(
            "slotserve_batch_size",
            "Rows (sequences) per model step.",
            buckets=_BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.step_duration = Histogram(
            "slotserve_model_step_seconds",
            "Wall time of one model step.",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.cancel_to_free = Histogram(
            "slotserve_cancel_to_slot_free_seconds",
            "From a cancel command being issued to its slot being free.",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.prefix_cache_queries = Counter(
            "slotserve_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache at admission (paged KV cache).",
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "slotserve_prefix_cache_hits",
            "Prompt tokens found in the prefix cache at admission (not prefilled again).",
            registry=r,
        )
        self.kv_cache_usage = Gauge(
            "slotserve_kv_cache_usage_ratio",
            "KV blocks held by running sequences / all KV blocks (cached free blocks count as "
            "free); 0 without a paged KV cache.",
            registry=r,
        )
        self.preemptions = Counter(
            "slotserve_preemptions",
            "Running sequences sent back to the waiting queue for lack of a free KV block "
            "(recomputed when readmitted).",
            registry=r,
        )
        self.spec_decode_drafts = Counter(
            "slotserve_spec_decode_num_drafts",
            "Rows that verified a speculative draft (--speculative-ngram).",
            registry=r,
        )
        self.spec_decode_draft_tokens = Counter(
            "slotserve_spec_decode_num_draft_tokens",
            "Drafted tokens verified by the model (--speculative-ngram).",
            registry=r,
        )
        self.spec_decode_accepted_tokens = Counter(
            "slotserve_spec_decode_num_accepted_tokens",
            "Drafted tokens the model accepted (acceptance rate: accepted / drafted).",
            registry=r,
        )
        self.event_loop_lag = Histogram(
            "slotserve_event_loop_lag_seconds",
            "How late the event loop ran a timer it was asked to run every "
            f"{EVENT_LOOP_LAG_INTERVAL_S * 1000:g} ms: time it could answer no client.",
            buckets=_LOOP_LAG_BUCKETS_S,
            registry=r,
        )

    def count_draft(self, drafted: int, accepted: int) -> None:
        """One speculative row verified: ``drafted`` tokens, ``accepted`` of them kept."""
        self.spec_decode_drafts.inc()
        self.spec_decode_draft_tokens.inc(drafted)
        self.spec_decode_accepted_tokens.inc(accepted)

    @property
    def spec_decode_acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens so far; None before any draft (``/info``)."""
        sample = self.registry.get_sample_value
        drafted = sample("slotserve_spec_decode_num_draft_tokens_total") or 0.0
        accepted = sample("slotserve_spec_decode_num_accepted_tokens_total") or 0.0
        return accepted / drafted if drafted else None

    def track_kv_cache(self, usage: Callable[[], float]) -> None:
        """Binds the KV usage gauge to the block manager's ``usage`` (read at scrape time)."""
        self.kv_cache_usage.set_function(usage)

    def track_queue(self, waiting: Callable[[], int], running: Callable[[], int]) -> None:
        """Binds the gauges to functions that read the scheduler's state at scrape time."""
        self.requests_waiting.set_function(waiting)
        self.requests_running.set_function(running)

    def render(self, *, model_name: str | None = None) -> bytes:
        """The Prometheus text of ``registry``; with ``model_name``, followed by the vLLM-named
        families of ``VllmNamedMetrics`` labelled with it."""
        text = generate_latest(self.registry)
        if model_name is None:
            return text
        return text + generate_latest(VllmNamedMetrics(self.registry, model_name))


class VllmNamedMetrics:
    """The families of ``VLLM_FAMILY_NAMES`` read from ``source`` when collected, renamed, each
    sample with a ``model_name`` label added (vLLM labels every metric with it).

    A collector for ``generate_latest`` (anything with ``collect()``), built per scrape: it holds
    no values of its own.
    """

    def __init__(self, source: CollectorRegistry, model_name: str) -> None:
        self._source = source
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            vllm_name = VLLM_FAMILY_NAMES.get(family.name)
            if vllm_name is not None:
                yield self._renamed(family, vllm_name)

    def _renamed(self, family: Metric, vllm_name: str) -> Metric:
        renamed = Metric(vllm_name, family.documentation, family.type)
        renamed.samples = [
            sample._replace(
                name=vllm_name + sample.name.removeprefix(family.name),
                labels={**sample.labels, "model_name": self._model_name},
            )
            for sample in family.samples
        ]
        return renamed
