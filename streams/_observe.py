"""What a service loop tells the outside: liveness, readiness, trace context, metrics.

The coordinator service and the participant runtime each hold one observer
(:class:`LoopObserver`'s subclasses in ``coordinator._observe`` and
``participants._observe``) and call it from their loop: :meth:`LoopObserver.polled`
after every poll. Everything that touches the Kafka consumer (readiness, consumer
lag) runs there, in the loop's thread, never in the HTTP server's: the consumer is
not shared across threads. The HTTP endpoints (:mod:`streams._http`) only read what
the loop last recorded.

* **alive** (``/healthz``): the loop iterated within ``stale_after_s`` (default 60 s;
  a coordinator restoring many sagas, or a participant retrying its storage, still
  iterates: the retry beats on every attempt);
* **ready** (``/readyz``): alive, and the consumer holds partitions that the service
  has taken over (a coordinator restores a partition's sagas inside the poll that
  assigns it, so a poll that returns has restored them). An instance that holds no
  partition (more instances than partitions) is alive but not ready;
* the first time it is ready, the service logs one INFO line on the ``saga.ready``
  logger, which the command line shows at the default level (see :mod:`streams._logs`);
* **trace context**: the context of the records read (``traceparent`` headers) is
  remembered per transaction, bounded (:class:`~streams._trace.TraceMemory`), so what
  the service writes for a transaction continues its trace;
* **metrics**, when turned on (:meth:`LoopObserver.enable_metrics`): sampled values
  (lag, sagas by state) are refreshed every ``sample_every_s`` (at least 50 times what
  sampling took, so a large state never costs more than 2 % of the loop).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from saga.streams._otel import Spans
from saga.streams._trace import TraceContext, TraceMemory, parse
from saga.streams.kafka import Message

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Histogram
    from prometheus_client.core import Metric

    from saga.streams._topics import Topics
    from saga.streams.log import LogConsumer

log = logging.getLogger("saga.observe")
ready_log = logging.getLogger("saga.ready")
"""The logger of the one line a service writes when it is ready (shown by default)."""

_MAX_KEY = 128  # a transaction id's limit; longer keys are the DLQ's business, not ours


class Health:
    """Liveness and readiness of one loop; written by the loop, read by any thread."""

    def __init__(self, stale_after_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._last_beat: float | None = None
        self._ready = False
        self._why_not = "starting"
        self._lock = threading.Lock()

    def beat(self) -> None:
        """The loop iterated."""
        self._last_beat = self._clock()

    def set_ready(self, ready: bool, why_not: str = "") -> None:
        with self._lock:
            self._ready = ready
            self._why_not = why_not

    def loop_age_s(self) -> float | None:
        """Seconds since the loop last iterated (``None``: it has not started)."""
        last = self._last_beat
        return None if last is None else max(0.0, self._clock() - last)

    def alive(self) -> tuple[bool, str]:
        """``(alive, why not)``."""
        age = self.loop_age_s()
        if age is None:
            return False, "the service loop has not started"
        if age > self.stale_after_s:
            return False, f"the service loop last iterated {age:.0f} s ago"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        """``(ready, why not)``: alive and serving its partitions."""
        alive, why = self.alive()
        if not alive:
            return False, why
        with self._lock:
            return (True, "ok") if self._ready else (False, self._why_not)


def topic_roles(topics: Topics) -> dict[str, str]:
    """Topic name -> its role (``requests``, ``events``, ...): a bounded metric label."""
    return {
        topics.requests: "requests",
        topics.events: "events",
        topics.decisions: "decisions",
        topics.status: "status",
        topics.dlq: "dlq",
    }


class LoopObserver:
    """The part of a service's observer that the coordinator and the participants share.

    ``service`` names the process in metric labels (``coordinator``,
    ``participant-<name>``); ``consumer`` returns the service's consumer (looked up
    when needed: the service makes it after its observer may exist). Subclasses say
    which topics' trace context to remember (``trace_topics``: the latest record's
    wins; ``fallback_trace_topics``: only while none is known), what the ready line
    says, and sample their own state in :meth:`sample_state`.
    """

    def __init__(
        self,
        service: str,
        topics: Topics,
        consumer: Callable[[], LogConsumer],
        *,
        trace_topics: Iterable[str] = (),
        fallback_trace_topics: Iterable[str] = (),
        sample_every_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.service = service
        self.topics = topics
        self.roles = topic_roles(topics)
        self._consumer = consumer
        self._trace_topics = frozenset(trace_topics)
        self._fallback_trace_topics = frozenset(fallback_trace_topics)
        self._read_trace_topics = self._trace_topics | self._fallback_trace_topics
        self.sample_every_s = sample_every_s
        self._clock = clock
        self.health = Health(clock=clock)
        self.spans = Spans(f"saga.{service.split('-', 1)[0]}")
        self.traces = TraceMemory()
        self.registry: CollectorRegistry | None = None
        self.endpoint: str | None = None  # where the metrics are served, for the ready line
        self.lag: dict[tuple[str, int], int] = {}  # (topic role, partition) -> records behind
        self.records_read: Counter[str] = Counter()  # topic role -> records polled
        self._batch: Histogram | None = None
        self._announced = False
        self._next_sample = 0.0

    # ------------------------------------------------------------ the loop's calls

    def polled(self, messages: Sequence[Message]) -> None:
        """After each poll, in the loop's thread: beat, remember trace context, sample."""
        self.health.beat()
        for m in messages:
            if m.headers and m.topic in self._read_trace_topics:
                self._remember(m)
        if self._batch is not None and messages:
            self._batch.labels(self.service).observe(len(messages))
            self.records_read.update(self.roles.get(m.topic, "other") for m in messages)
        now = self._clock()
        if not self._announced or now >= self._next_sample:
            try:
                self._check_ready()
                if self.registry is not None and now >= self._next_sample:
                    self.lag = self._sample_lag()
                    self.sample_state()
            except Exception as exc:  # observing must never stop the service
                log.debug("sampling failed: %s: %s", type(exc).__name__, exc)
            if self.sample_every_s > 0:  # 0: at every poll (tests)
                spent = self._clock() - now
                self._next_sample = now + max(self.sample_every_s, 50 * spent)

    def _remember(self, m: Message) -> None:
        if m.key is None or len(m.key) > _MAX_KEY:
            return
        try:
            tx_id = m.key.decode("utf-8")
        except UnicodeDecodeError:
            return
        if m.topic in self._fallback_trace_topics and self.traces.get(tx_id) is not None:
            return  # known from a record that comes first; not worth parsing again
        context = parse(m.headers)
        if context is not None:
            self.traces.remember(tx_id, context)

    def _check_ready(self) -> None:
        assigned = self._consumer().assignment()
        held = sorted({p for t, p in assigned if t == self.topics.requests})
        if not held:
            self.health.set_ready(False, f"no partition of {self.topics.requests} assigned yet")
            return
        self.health.set_ready(True)
        if not self._announced:
            self._announced = True
            ready_log.info("%s", self.ready_line(held))

    def _sample_lag(self) -> dict[tuple[str, int], int]:
        consumer = self._consumer()
        assigned = consumer.assignment()
        positions = consumer.position(assigned)
        lag: dict[tuple[str, int], int] = {}
        for (topic, partition), position in positions.items():
            if position is None:
                continue
            _, high = consumer.watermarks(topic, partition, timeout=1.0)
            lag[(self.roles.get(topic, "other"), partition)] = max(0, high - position)
        return lag

    # ------------------------------------------------------------ for subclasses

    def ready_line(self, partitions: Sequence[int]) -> str:
        """The line logged once when the service is first ready."""
        held = self._partitions_text(partitions)
        return f"saga {self.service} ready: {held}{self._metrics_text()}"

    def _partitions_text(self, partitions: Sequence[int]) -> str:
        return f"{len(partitions)} partitions of {self.topics.requests} assigned"

    def _metrics_text(self) -> str:
        return f", metrics on {self.endpoint}/metrics" if self.endpoint else ""

    def sample_state(self) -> None:
        """Refresh sampled metrics of the service's own state (loop thread)."""

    def enable_metrics(self, registry: CollectorRegistry) -> None:
        """Register this service's metrics in ``registry`` (before the loop starts).

        Subclasses add their histograms, then call this; their counters and gauges come
        from :meth:`families`, read at scrape time.
        """
        from saga.streams._metrics import ServiceCollector, batch_histogram

        self._batch = batch_histogram(registry)
        registry.register(ServiceCollector(self._all_families))
        self.registry = registry

    def _all_families(self) -> Iterator[Metric]:
        from saga.streams._metrics import counter, gauge

        me = (self.service,)
        yield gauge(
            "saga_ready",
            "1 when the service is ready (/readyz).",
            ["service"],
            [(me, 1.0 if self.health.ready()[0] else 0.0)],
        )
        age = self.health.loop_age_s()
        yield gauge(
            "saga_loop_age_seconds",
            "Seconds since the service loop last iterated.",
            ["service"],
            [(me, age if age is not None else float("nan"))],
        )
        yield counter(
            "saga_records_read",
            "Records polled, by topic.",
            ["service", "topic"],
            [((self.service, role), n) for role, n in sorted(dict(self.records_read).items())],
        )
        yield gauge(
            "saga_consumer_lag",
            "Records between the consumer's position and the partition's high watermark "
            f"(sampled every {self.sample_every_s:g} s or more).",
            ["service", "topic", "partition"],
            [((self.service, role, str(p)), n) for (role, p), n in sorted(self.lag.items())],
        )
        yield from self.families()

    def families(self) -> Iterable[Metric]:
        """The service's own counters and gauges, read at scrape time (any thread)."""
        return ()

    def continue_trace(
        self, name: str, tx_id: str, start_ns: int | None = None, **attributes: str | int
    ) -> list[tuple[str, bytes]] | None:
        """Headers that continue ``tx_id``'s trace through a span ``name`` (none: no trace).

        Only a transaction whose records carried a trace context gets one: a saga
        sent without one (an old client, a replay) is not given a trace halfway.
        """
        parent = self.traces.get(tx_id)
        if parent is None:
            return None
        context: TraceContext = self.spans.record(
            name, parent, start_ns=start_ns, attributes={"saga.tx_id": tx_id, **attributes}
        )
        return context.headers()

    def trace_headers(self, tx_id: str) -> list[tuple[str, bytes]] | None:
        """Headers that carry ``tx_id``'s trace (a new span id, no span exported), or none."""
        parent = self.traces.get(tx_id)
        return None if parent is None else parent.child().headers()


__all__ = ["Health", "LoopObserver", "ready_log", "topic_roles"]
