"""A participant's observer: its metrics, its trace context, its ready line.

:class:`ParticipantObserver` is made by the runtime and called from its loop
(:mod:`streams._observe` says when and in which thread). Besides the common metrics
(:mod:`streams._metrics`, with ``service="participant-<name>"``) it exposes, each
labelled ``participant``:

=====================================================  =======  ==========================
``saga_participant_steps_total{status}``               counter  step events emitted:
                                                                ``applied``, ``failed``
                                                                (rejected), ``committed``
                                                                (confirmed), ``compensated``,
                                                                ``compensation_failed``
``saga_participant_records_skipped_total{reason}``     counter  ``invalid`` (left to the
                                                                coordinator's DLQ),
                                                                ``unauthenticated``,
                                                                ``not_mine`` (no step here)
``saga_participant_batches_total``                     counter  batches run
``saga_participant_storage_retries_total``             counter  storage retries (transient)
``saga_participant_poisoned_total``                    counter  items the storage failed on
``saga_participant_decisions_parked_total``            counter  decisions the store refused
                                                                after its retries (reported
                                                                ``compensation_failed``)
``saga_participant_pruned_total``                      counter  ledger entries pruned
``saga_participant_storage_seconds``                   hist.    one storage round trip
                                                                (a batch's attempt)
=====================================================  =======  ==========================

Participants write nothing to the DLQ (the coordinator does); what they skip is
counted above.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from saga.participants._storage import Report, RequestSeen, WorkItem
from saga.streams import StepStatus
from saga.streams._observe import LoopObserver
from saga.streams.kafka import Message

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Histogram
    from prometheus_client.core import Metric

    from saga.participants._runtime import ParticipantRuntime

T = TypeVar("T")

_SPAN_BY_STATUS = {
    StepStatus.APPLIED: "saga.participant.apply",
    StepStatus.FAILED: "saga.participant.apply",
    StepStatus.COMMITTED: "saga.participant.confirm",
    StepStatus.COMPENSATED: "saga.participant.compensate",
    StepStatus.COMPENSATION_FAILED: "saga.participant.compensate",
}


@dataclass(slots=True)
class ParticipantStats:
    """What a participant runtime did since it started (counters, read by its metrics)."""

    batches: int = 0
    records: int = 0
    items: int = 0
    events: int = 0
    skipped_invalid: int = 0
    retries: int = 0
    poisoned: int = 0
    pruned: int = 0  # ledger entries removed after the retention
    unauthenticated: int = 0  # records not acted on for their signature
    routed: int = 0  # records skipped undecoded: their routing headers name others


class ParticipantObserver(LoopObserver):
    """Observes one :class:`~participants._runtime.ParticipantRuntime` (see the module doc).

    ``description`` (what the command line knows: storage kind, targets) goes into
    the ready line.
    """

    def __init__(self, runtime: ParticipantRuntime, description: str = "") -> None:
        topics = runtime.topics
        super().__init__(
            f"participant-{runtime.name}",
            topics,
            lambda: runtime._consumer,
            trace_topics=(topics.requests, topics.decisions),
        )
        self._runtime = runtime
        self.description = description
        self.steps: Counter[str] = Counter()  # step status -> events emitted
        self.not_mine = 0
        self.parked = 0  # decisions the store refused, reported for an operator
        self._batch_started_ns = time.time_ns()
        self._storage_seconds: Histogram | None = None

    def ready_line(self, partitions: Sequence[int]) -> str:
        about = f" ({self.description})" if self.description else ""
        return (
            f"saga participant ready: {self._runtime.name}{about}, "
            f"{len(partitions)} of {self._runtime._partition_count} partitions of "
            f"{self.topics.requests}{self._metrics_text()}"
        )

    # ------------------------------------------------------------ loop hooks

    def polled(self, messages: Sequence[Message]) -> None:
        self._batch_started_ns = time.time_ns()
        super().polled(messages)

    def timed(self, execute: Callable[[list[WorkItem]], T]) -> Callable[[list[WorkItem]], T]:
        """``execute`` timed per call (each storage attempt), and each attempt a heartbeat.

        A storage that stays down keeps the loop in its retries: the process is alive
        (a restart would not help), so every attempt counts as the loop iterating.
        """

        def run(items: list[WorkItem]) -> T:
            self.health.beat()
            started = time.perf_counter()
            try:
                return execute(items)
            finally:
                if self._storage_seconds is not None:
                    seconds = time.perf_counter() - started
                    self._storage_seconds.labels(self._runtime.name).observe(seconds)

        return run

    def event_headers(self, report: Report) -> list[tuple[str, bytes]] | None:
        """Trace headers of the step event of ``report``: a span of this batch's work."""
        return self.continue_trace(
            _SPAN_BY_STATUS.get(report.status, "saga.participant.apply"),
            report.tx_id,
            start_ns=self._batch_started_ns,
            **{"saga.step": report.step, "saga.status": report.status.value},
        )

    def handled(self, items: Sequence[WorkItem], reports: Sequence[Report]) -> None:
        """A batch is done: its events are in the log."""
        self.steps.update(r.status.value for r in reports)
        self.not_mine += sum(1 for item in items if isinstance(item, RequestSeen))
        self.parked += sum(1 for r in reports if r.parked)

    # ------------------------------------------------------------ metrics

    def enable_metrics(self, registry: CollectorRegistry) -> None:
        # prometheus_client is imported only by a service that serves metrics.
        from prometheus_client import Histogram

        from saga.streams._metrics import LATENCY_BUCKETS

        self._storage_seconds = Histogram(
            "saga_participant_storage_seconds",
            "Seconds per storage round trip: one attempt at a batch's local transaction.",
            ["participant"],
            registry=registry,
            buckets=LATENCY_BUCKETS,
        )
        super().enable_metrics(registry)

    def families(self) -> Iterable[Metric]:
        from saga.streams._metrics import counter

        stats = self._runtime.stats
        name = self._runtime.name
        steps = dict(self.steps)  # a C-level copy: the loop thread may add a key
        yield counter(
            "saga_participant_steps",
            "Step events emitted, by status.",
            ["participant", "status"],
            [((name, s.value), steps.get(s.value, 0)) for s in _SPAN_BY_STATUS],
        )
        yield counter(
            "saga_participant_records_skipped",
            "Records read and not acted on, by reason.",
            ["participant", "reason"],
            [
                ((name, "invalid"), stats.skipped_invalid),
                ((name, "unauthenticated"), stats.unauthenticated),
                ((name, "not_mine"), self.not_mine),
                ((name, "routed"), stats.routed),  # skipped undecoded, by its headers
            ],
        )
        for metric, doc, value in (
            ("saga_participant_batches", "Batches run.", stats.batches),
            ("saga_participant_storage_retries", "Storage retries (transient).", stats.retries),
            ("saga_participant_poisoned", "Items the storage failed on.", stats.poisoned),
            ("saga_participant_decisions_parked", "Decisions the store refused.", self.parked),
            ("saga_participant_pruned", "Ledger entries pruned.", stats.pruned),
        ):
            yield counter(metric, doc, ["participant"], [((name,), value)])


__all__ = ["ParticipantObserver", "ParticipantStats"]
