"""Prometheus metrics shared by the services: a per-service registry, buckets, families.

Every service gets its own :class:`prometheus_client.CollectorRegistry` (never the
global one), so several services can run in one process (tests) and the endpoint
shows nothing but saga's metrics. Counters the services already keep (their
``stats``) are read at scrape time by a collector (:class:`ServiceCollector`); only
histograms are observed where things happen.

Label cardinality is bounded by the deployment, never by the traffic: ``service``
(``coordinator`` or ``participant-<name>``), ``topic`` (the role of a saga topic:
``requests``, ``events``, ``decisions``, ``status``, ``dlq``), ``partition`` (the
partitions this process holds), ``state``, ``outcome``, ``reason`` (a fixed set of
classes) and ``status`` (a step's status). No label ever holds a transaction id or
free text.

Common metrics (every service):

==================================  =======  ====================================
``saga_ready{service}``             gauge    1 when ``/readyz`` answers 200
``saga_loop_age_seconds{service}``  gauge    seconds since the loop last iterated
``saga_records_read_total``         counter  records polled, by ``service``, ``topic``
``saga_batch_records``              hist.    records per non-empty poll, by ``service``
``saga_consumer_lag``               gauge    records behind the high watermark, by
                                             ``service``, ``topic``, ``partition``
==================================  =======  ====================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Final

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS: Final = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    float("inf"),
)
"""Seconds: from a fast saga's milliseconds to a deadline of minutes."""

BATCH_BUCKETS: Final = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, float("inf"))
"""Records per batch: up to the services' largest batch size."""


def new_registry() -> CollectorRegistry:
    """A registry of one service's metrics (not prometheus_client's global one)."""
    return CollectorRegistry(auto_describe=False)


def batch_histogram(registry: CollectorRegistry) -> Histogram:
    return Histogram(
        "saga_batch_records",
        "Records per non-empty poll of the service's loop.",
        ["service"],
        registry=registry,
        buckets=BATCH_BUCKETS,
    )


Samples = Iterable[tuple[tuple[str, ...], float]]
"""``(label values, value)`` pairs."""


def counter(
    name: str, documentation: str, labels: Iterable[str], values: Samples
) -> CounterMetricFamily:
    """A counter family (``name`` without ``_total``) with one sample per label tuple."""
    family = CounterMetricFamily(name, documentation, labels=list(labels))
    for label_values, value in values:
        family.add_metric(list(label_values), value)
    return family


def gauge(
    name: str, documentation: str, labels: Iterable[str], values: Samples
) -> GaugeMetricFamily:
    """A gauge family with one sample per label tuple."""
    family = GaugeMetricFamily(name, documentation, labels=list(labels))
    for label_values, value in values:
        family.add_metric(list(label_values), value)
    return family


class ServiceCollector(Collector):
    """Collects, at each scrape, the families ``families()`` returns."""

    def __init__(self, families: Callable[[], Iterable[Metric]]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families()


__all__ = [
    "BATCH_BUCKETS",
    "LATENCY_BUCKETS",
    "ServiceCollector",
    "batch_histogram",
    "counter",
    "gauge",
    "new_registry",
]
