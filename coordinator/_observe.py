"""The coordinator's observer: its metrics, its trace context, its ready line.

:class:`CoordinatorObserver` is made by the service and called from its loop
(:mod:`streams._observe` says when and in which thread). Besides the common metrics
(:mod:`streams._metrics`) it exposes:

================================================  =======  ==============================
``saga_sagas{state}``                             gauge    sagas held in memory, by state
                                                           (``placeholder``: events or an
                                                           abort whose request is not seen)
``saga_decisions_total{outcome, reason}``         counter  decisions, by outcome and class
``saga_decision_latency_seconds{outcome}``        hist.    request seen -> decision
``saga_completion_latency_seconds{state}``        hist.    request seen -> final state
``saga_dlq_records_total{topic}``                 counter  records sent to the DLQ, by source
``saga_batches_total``                            counter  transactions committed
``saga_kafka_transactions_aborted_total``         counter  transactions aborted (re-processed)
``saga_sagas_restored_total``                     counter  sagas rebuilt from the status topic
``saga_sagas_forgotten_total``                    counter  sagas forgotten after the retention
``saga_requests_expired_total``                   counter  requests refused as expired
``saga_records_unauthenticated_total``            counter  records refused for their signature
``saga_decisions_redriven_total``                 counter  decisions of stalled sagas sent
                                                           again (coordinator._chores)
================================================  =======  ==============================

Reason classes (:func:`reason_class`): ``all_applied`` (a commit), ``step_failed``,
``deadline``, ``abort``, ``unknown_participant``, ``compensated_early`` and
``other``. "Request seen" is when this process read the request; for a saga it
restored, the request's ``created_ms`` (the client's clock) stands in.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from saga.coordinator._machine import Saga
from saga.streams import Decision, SagaState, SagaStatus, StepEvent
from saga.streams._observe import LoopObserver
from saga.streams.kafka import Message

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Histogram
    from prometheus_client.core import Metric

    from saga.coordinator._service import CoordinatorService

REASON_CLASSES = (
    "all_applied",
    "step_failed",
    "deadline",
    "abort",
    "unknown_participant",
    "compensated_early",
    "other",
)
_STATES = (*(s.value for s in SagaState), "placeholder")
_SEEN_KEPT = 50_000  # request-seen times kept for the latency histograms


def reason_class(decision: Decision) -> str:
    """The bounded class of a decision's reason (its text quotes steps and users)."""
    reason = decision.reason.lower()
    if decision.outcome == "commit":
        return "all_applied"
    if reason.startswith("aborted"):
        return "abort"
    if reason.startswith("deadline"):
        return "deadline"
    if "participant" in reason and ("unknown" in reason or "announce" in reason):
        return "unknown_participant"
    if "compensated before a decision" in reason:
        return "compensated_early"
    if reason.startswith("step") and " failed" in reason:
        return "step_failed"
    return "other"


class CoordinatorObserver(LoopObserver):
    """Observes one :class:`~coordinator._service.CoordinatorService` (see the module doc)."""

    def __init__(self, service: CoordinatorService) -> None:
        topics = service.topics
        super().__init__(
            "coordinator",
            topics,
            lambda: service._consumer,
            trace_topics=(topics.requests,),
            # a saga restored after a restart: its request is not read again
            fallback_trace_topics=(topics.events,),
        )
        self._service = service
        self.decisions: Counter[tuple[str, str]] = Counter()  # (outcome, reason class)
        self.dlq: Counter[str] = Counter()  # source topic role -> records
        self.states: dict[str, int] = dict.fromkeys(_STATES, 0)
        # tx_id -> when this process first read its request (ms, the service's clock)
        self._seen: OrderedDict[str, int] = OrderedDict()
        self._decision_latency: Histogram | None = None
        self._completion_latency: Histogram | None = None

    def ready_line(self, partitions: Sequence[int]) -> str:
        total = self._service._partition_count
        return (
            f"saga coordinator ready: instance {self._service.instance_id}, "
            f"{len(partitions)} of {total} partitions of {self.topics.requests}"
            f"{self._metrics_text()}"
        )

    # ------------------------------------------------------------ loop hooks

    def polled(self, messages: Sequence[Message]) -> None:
        if self._decision_latency is not None:
            now = self._service.clock()
            for m in messages:
                if m.topic == self.topics.requests and m.key is not None and len(m.key) <= 128:
                    tx_id = m.key.decode("utf-8", "replace")
                    if tx_id not in self._seen:
                        self._seen[tx_id] = now
                        if len(self._seen) > _SEEN_KEPT:
                            self._seen.popitem(last=False)
        super().polled(messages)

    def decision_headers(self, decision: Decision) -> list[tuple[str, bytes]] | None:
        """Trace headers of a decision record: a ``saga.coordinator.decide`` span."""
        seen = self._seen.get(decision.tx_id)
        return self.continue_trace(
            "saga.coordinator.decide",
            decision.tx_id,
            start_ns=seen * 1_000_000 if seen is not None else None,
            **{"saga.outcome": decision.outcome.value},
        )

    def status_headers(self, tx_id: str) -> list[tuple[str, bytes]] | None:
        """Trace headers of a status record."""
        return self.trace_headers(tx_id)

    def committed(
        self,
        messages: Sequence[Message],
        changed: dict[str, tuple[int, Saga]],
        outputs: Iterable[tuple[int, Decision | SagaStatus | StepEvent, bytes]],
        rejected: Iterable[tuple[Message, str]],
    ) -> None:
        """A batch's transaction committed; its changes are not merged into memory yet."""
        partitions = self._service._partitions
        for tx_id, (p, saga) in changed.items():
            if not saga.state.final or not saga.request_seen:
                continue
            part = partitions.get(p)
            before = part.sagas.get(tx_id) if part is not None else None
            if before is not None and before.state.final:
                continue
            if self._completion_latency is not None:
                start = self._seen.get(tx_id, saga.created_ms)
                seconds = max(0, saga.updated_ms - start) / 1000
                self._completion_latency.labels(saga.state.value).observe(seconds)
            # Nothing more is written for it: its trace and timings can go.
            self.traces.forget(tx_id)
            self._seen.pop(tx_id, None)
        if self._decision_latency is None:
            return
        self.dlq.update(self.roles.get(m.topic, "other") for m, _ in rejected)
        for _, out, _ in outputs:
            if isinstance(out, Decision):
                self.decisions[(out.outcome.value, reason_class(out))] += 1
                entry = changed.get(out.tx_id)
                start = self._seen.get(out.tx_id, entry[1].created_ms if entry else out.at_ms)
                seconds = max(0, out.at_ms - start) / 1000
                self._decision_latency.labels(out.outcome.value).observe(seconds)

    # ------------------------------------------------------------ metrics

    def sample_state(self) -> None:
        states = dict.fromkeys(_STATES, 0)
        for part in list(self._service._partitions.values()):
            for saga in part.sagas.live.values():
                states["placeholder" if not saga.request_seen else saga.state.value] += 1
            for state, count in part.sagas.finished.counts.items():  # those on disk
                states[state] += count
        self.states = states

    def enable_metrics(self, registry: CollectorRegistry) -> None:
        # prometheus_client is imported only by a service that serves metrics.
        from prometheus_client import Histogram

        from saga.streams._metrics import LATENCY_BUCKETS

        self._decision_latency = Histogram(
            "saga_decision_latency_seconds",
            "Seconds from reading a saga's request to its decision.",
            ["outcome"],
            registry=registry,
            buckets=LATENCY_BUCKETS,
        )
        self._completion_latency = Histogram(
            "saga_completion_latency_seconds",
            "Seconds from reading a saga's request to its final state.",
            ["state"],
            registry=registry,
            buckets=LATENCY_BUCKETS,
        )
        super().enable_metrics(registry)

    def families(self) -> Iterable[Metric]:
        from saga.streams._metrics import counter, gauge

        stats = self._service.stats
        yield gauge(
            "saga_sagas",
            f"Sagas held in memory, by state (sampled every {self.sample_every_s:g} s or more).",
            ["state"],
            [((state,), n) for state, n in self.states.items()],
        )
        decisions = dict(self.decisions)  # a C-level copy: the loop thread may add a key
        yield counter(
            "saga_decisions",
            "Decisions written, by outcome and reason class.",
            ["outcome", "reason"],
            [(key, n) for key, n in sorted(decisions.items())],
        )
        yield counter(
            "saga_dlq_records",
            "Records sent to the DLQ, by the topic they came from.",
            ["topic"],
            [((role,), n) for role, n in sorted(dict(self.dlq).items())],
        )
        for name, doc, value in (
            ("saga_batches", "Kafka transactions committed.", stats.batches),
            (
                "saga_kafka_transactions_aborted",
                "Transactions aborted.",
                stats.aborted_transactions,
            ),
            ("saga_sagas_restored", "Sagas rebuilt from the status topic.", stats.restored),
            ("saga_sagas_forgotten", "Sagas forgotten after the retention.", stats.forgotten),
            ("saga_requests_expired", "Requests refused as expired.", stats.expired_requests),
            (
                "saga_records_unauthenticated",
                "Records refused for their signature.",
                stats.unauthenticated,
            ),
            (
                "saga_decisions_redriven",
                "Decisions of sagas stalled committing or rolling back, sent again.",
                stats.redriven,
            ),
        ):
            yield counter(name, doc, [], [((), value)])


__all__ = ["REASON_CLASSES", "CoordinatorObserver", "reason_class"]
