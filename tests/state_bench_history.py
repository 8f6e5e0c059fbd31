"""The history the state bench writes: the records a real run of many sagas leaves.

Per saga, what a coordinator and three participants write today for a three-step saga
whose steps have nothing to confirm: the request, the ``pending`` status, three
``applied`` events, then in one transaction the ``commit`` decision and the
``committed`` status; and, once the saga is older than the retention, the
coordinator's tombstone. Each record carries the time it would have had. Written
fast: each kind of record is encoded once as a template (the wire form checked
against :func:`streams.encode`) and filled with the saga's id and times, and the
producer batches (about as a coordinator does) and compresses (``lz4``) without
delivery callbacks.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import confluent_kafka as ck

from saga.streams import (
    Decision,
    Mode,
    Outcome,
    SagaRequest,
    SagaState,
    SagaStatus,
    Step,
    StepEvent,
    StepProgress,
    StepStatus,
    encode,
)
from saga.streams.kafka import KafkaSettings

PARTICIPANTS = ("bank", "wallet", "rewards")
TX_CHARS = 10  # "s" and nine digits
_TX = "Q" * TX_CHARS
_CREATED, _AT, _DEADLINE = 9_100_000_000_001, 9_100_000_000_002, 9_100_000_000_003


def tx_name(n: int, prefix: str = "s") -> str:
    name = f"{prefix}{n:0{TX_CHARS - len(prefix)}d}"
    assert len(name) == TX_CHARS
    return name


def steps() -> tuple[Step, ...]:
    return tuple(
        Step(p, "increment", {"target": "accounts", "key": f"k{i}", "field": "b", "by": 1})
        for i, p in enumerate(PARTICIPANTS)
    )


def request(tx: str, created: int, deadline: int) -> SagaRequest:
    return SagaRequest(tx, "transfer", Mode.PARALLEL, steps(), deadline, created)


def status(tx: str, state: SagaState, created: int, at: int, deadline: int) -> SagaStatus:
    done = StepStatus.COMMITTED if state is SagaState.COMMITTED else StepStatus.PENDING
    reason = "all steps applied" if state is SagaState.COMMITTED else None
    fingerprint = request(tx, created, deadline).fingerprint()
    progress = tuple(StepProgress(p, done) for p in PARTICIPANTS)
    return SagaStatus(tx, "transfer", state, progress, reason, created, at, deadline, fingerprint)


class Templates:
    """Each record kind encoded once, filled by replacing the id and the times."""

    def __init__(self) -> None:
        c, a, d = _CREATED, _AT, _DEADLINE
        self.request = encode(request(_TX, c, d))
        self.pending = encode(status(_TX, SagaState.PENDING, c, a, d))
        self.committed = encode(status(_TX, SagaState.COMMITTED, c, a, d))
        self.decision = encode(Decision(_TX, Outcome.COMMIT, "all steps applied", a))
        self.applied = [
            encode(StepEvent(_TX, n, p, StepStatus.APPLIED, a)) for n, p in enumerate(PARTICIPANTS)
        ]
        self._check()

    @staticmethod
    def fill(template: bytes, tx: str, created: int, at: int, deadline: int) -> bytes:
        return (
            template.replace(_TX.encode(), tx.encode())
            .replace(b"9100000000001", str(created).encode())
            .replace(b"9100000000002", str(at).encode())
            .replace(b"9100000000003", str(deadline).encode())
        )

    def _check(self) -> None:
        tx, c, a, d = tx_name(7), 1_700_000_000_000, 1_700_000_000_500, 1_700_000_002_000
        assert self.fill(self.request, tx, c, a, d) == encode(request(tx, c, d))
        expected = encode(status(tx, SagaState.COMMITTED, c, a, d))
        assert self.fill(self.committed, tx, c, a, d) == expected
        event = encode(StepEvent(tx, 1, PARTICIPANTS[1], StepStatus.APPLIED, a))
        assert self.fill(self.applied[1], tx, c, a, d) == event


def fast_producer(settings: KafkaSettings) -> ck.Producer:
    return ck.Producer(
        {
            "bootstrap.servers": settings.bootstrap,
            **settings.extra,
            "partitioner": "murmur2_random",  # as every producer of saga: keys' partitions
            # Batches about the size a coordinator's transactions make (lz4, as saga's
            # producers): a reader's buffers depend on them, the write speed hardly.
            "linger.ms": 50,
            "batch.num.messages": 1000,
            "compression.type": "lz4",
            "queue.buffering.max.messages": 2_000_000,
            "queue.buffering.max.kbytes": 1024 * 1024,
            "enable.idempotence": False,
            "acks": 1,
        }
    )


def write_history(
    settings: KafkaSettings,
    first: int,
    sagas: int,
    rate: float,
    retention_ms: int,
    now: int,
    *,
    recent: bool,
    say: Callable[[str], None],
) -> dict[str, int]:
    """Write the records of sagas ``first`` to ``first + sagas - 1``, ending at ``now``.

    ``recent``: these are the last sagas before the measurement, so only the ones
    older than the retention get their tombstone; otherwise every one does (at the
    time the coordinator would have written it). Returns the records per topic.
    """
    topics = settings.topics
    producer = fast_producer(settings)
    t = Templates()
    step_ms = 1000.0 / rate
    tombstones: collections.deque[tuple[int, str]] = collections.deque()
    counts = collections.Counter[str]()
    fill = t.fill
    started = time.monotonic()

    def put(topic: str, key: str, value: bytes | None, at: int) -> None:
        while True:
            try:
                producer.produce(topic, value, key, timestamp=at)
                break
            except BufferError:
                producer.poll(0.5)
        counts[topic] += 1

    for i in range(sagas):
        created = now - int((sagas - i) * step_ms) - 1000
        tx = tx_name(first + i)
        while tombstones and tombstones[0][0] <= created:
            at, old = tombstones.popleft()
            put(topics.status, old, None, at)
        deadline, applied, decided = created + 2000, created + 200, created + 500
        put(topics.requests, tx, fill(t.request, tx, created, created, deadline), created)
        pending_at = created + 50
        put(topics.status, tx, fill(t.pending, tx, created, pending_at, deadline), pending_at)
        for template in t.applied:
            put(topics.events, tx, fill(template, tx, created, applied, deadline), applied)
        put(topics.decisions, tx, fill(t.decision, tx, created, decided, deadline), decided)
        put(topics.status, tx, fill(t.committed, tx, created, decided, deadline), decided)
        forget = deadline + retention_ms  # max(deadline, last change) + retention
        if forget <= now or not recent:
            tombstones.append((forget, tx))
        if i % 200_000 == 199_999:
            producer.poll(0)
            say(f"  {i + 1:,} sagas written ({time.monotonic() - started:.0f} s)")
    for at, old in tombstones:
        put(topics.status, old, None, at)
    left = producer.flush(600)
    if left:
        raise SystemExit(f"{left} records of the history were not delivered within 600 s")
    return dict(counts)


def write_statuses(settings: KafkaSettings, txs: list[str], rate: float) -> None:
    """``committed`` statuses of ``txs`` at ``rate`` a second, as a coordinator publishes
    them while they finish."""
    producer = fast_producer(settings)
    t = Templates()
    started = time.monotonic()
    for n, tx in enumerate(txs):
        if n % 500 == 0:  # in steps of 500: on time, within a tenth of a second
            time.sleep(max(0.0, started + n / rate - time.monotonic()))
            producer.poll(0)
        now = int(time.time() * 1000)
        value = t.fill(t.committed, tx, now - 500, now, now + 30_000)
        while True:
            try:
                producer.produce(settings.topics.status, value, tx, timestamp=now)
                break
            except BufferError:
                producer.poll(0.5)
    if producer.flush(300):
        raise SystemExit("the probe's statuses were not delivered within 300 s")
