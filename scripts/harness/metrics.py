"""A server's ``/metrics``, scraped and read: samples by name and labels, counter and histogram
deltas between two scrapes, and the one quantile definition of every script and test.

    before = await scrape(http, url)
    ...
    after = await scrape(http, url)
    after.value("slotserve_requests_finished_total", finish_reason="cancelled")
    histogram_delta(before, after, "slotserve_cancel_to_slot_free_seconds").quantile(0.99)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class HistogramDelta:
    """A Prometheus histogram's observations between two scrapes (or since the start).

    Attributes:
        bounds: bucket upper bounds, ascending, the last one +Inf.
        cumulative: observations <= each bound.
        total: the sum of the observed values.
    """

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    total: float

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """The ``q``-quantile (0 <= q <= 1) as Prometheus' ``histogram_quantile`` estimates it:
        linear inside the bucket that holds rank ``q * count``, from 0 for the first bucket;
        the largest finite bound when the rank falls in the +Inf bucket; None without
        observations."""
        if not self.count:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for bound, count in zip(self.bounds, self.cumulative, strict=True):
            if count >= rank:
                if math.isinf(bound):
                    return lower
                if count == below:
                    return bound
                return lower + (bound - lower) * (rank - below) / (count - below)
            lower, below = bound, count
        return lower

    def bucket_counts(self) -> list[tuple[float, float]]:
        """(upper bound, observations in that bucket alone), +Inf included."""
        counts, below = [], 0.0
        for bound, count in zip(self.bounds, self.cumulative, strict=True):
            counts.append((bound, count - below))
            below = count
        return counts


@dataclass(frozen=True, slots=True)
class Metrics:
    """One scrape of /metrics: every sample by (name, sorted labels)."""

    samples: dict[tuple[str, Labels], float]

    @classmethod
    def parse(cls, text: str) -> Metrics:
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return cls(samples)

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples called ``name`` whose labels include ``labels`` (so with no
        labels, a labelled counter's total over its labels); 0 when there is none."""
        wanted = labels.items()
        return sum(
            value
            for (sample, sample_labels), value in self.samples.items()
            if sample == name and wanted <= dict(sample_labels).items()
        )

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``name``'s samples by the value of one label (``finish_reason`` -> count)."""
        values: dict[str, float] = {}
        for (sample, sample_labels), value in self.samples.items():
            labels = dict(sample_labels)
            if sample == name and label in labels:
                values[labels[label]] = values.get(labels[label], 0.0) + value
        return values

    def histogram(self, name: str) -> HistogramDelta:
        """The histogram ``name`` since the server started."""
        buckets = sorted(
            (float(dict(labels)["le"]), value)
            for (sample, labels), value in self.samples.items()
            if sample == name + "_bucket"
        )
        return HistogramDelta(
            tuple(bound for bound, _ in buckets),
            tuple(count for _, count in buckets),
            self.value(name + "_sum"),
        )


def counter_delta(before: Metrics, after: Metrics, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


def histogram_delta(before: Metrics, after: Metrics, name: str) -> HistogramDelta:
    """The observations of ``name`` between the two scrapes."""
    then, now = before.histogram(name), after.histogram(name)
    cumulative_before = then.cumulative
    if len(cumulative_before) != len(now.cumulative):
        cumulative_before = (0.0,) * len(now.cumulative)
    cumulative = tuple(a - b for a, b in zip(now.cumulative, cumulative_before, strict=True))
    return HistogramDelta(now.bounds, cumulative, now.total - then.total)


async def scrape(
    http: httpx.AsyncClient, url: str = "", *, headers: dict[str, str] | None = None
) -> Metrics:
    """``GET {url}/metrics`` (``url`` empty: the client's base URL).

    Raises:
        httpx.HTTPStatusError: the answer was not a 2xx (e.g. 401 without the API key).
    """
    response = await http.get(url + "/metrics", headers=headers)
    response.raise_for_status()
    return Metrics.parse(response.text)


def scrape_blocking(url: str, *, timeout_s: float = 10.0) -> Metrics:
    """``scrape`` for code without an event loop."""
    response = httpx.get(url + "/metrics", timeout=timeout_s, trust_env=False)
    response.raise_for_status()
    return Metrics.parse(response.text)
