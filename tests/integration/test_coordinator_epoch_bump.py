"""A coordinator on the real broker: an epoch bump is ridden through, a real fence stops it.

A bare ``init_transactions`` of the coordinator's ``transactional.id`` by another
producer bumps the epoch exactly as the broker does when it aborts a transaction
itself (e.g. across a transaction coordinator failover), with no newer group member:
the coordinator must make a new producer and go on deciding, each saga once. A newer
coordinator with the same instance id takes the transactional id *and* the static
group membership: the older one must stop (zombie fencing keeps exactly-once).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from saga.coordinator._service import CoordinatorService
from saga.streams import (
    Decision,
    FatalKafkaError,
    Mode,
    SagaRequest,
    Step,
    StepEvent,
    StepStatus,
    decode_as,
    encode,
)
from saga.streams.kafka import (
    Consumer,
    KafkaSettings,
    Producer,
    TransactionalProducer,
    create_topics,
    delete_topics,
)
from tests._infra import Services

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PARTITIONS = 2


@pytest.fixture
def settings(services: Services, topic_prefix: str) -> Iterator[KafkaSettings]:
    made = KafkaSettings(bootstrap=services.kafka_bootstrap, prefix=topic_prefix)
    create_topics(made, PARTITIONS)
    yield made
    delete_topics(made, made.topics.all)


class _Running:
    """A coordinator's run loop in a thread; what it died of, if it did."""

    def __init__(self, settings: KafkaSettings, instance_id: str) -> None:
        self.service = CoordinatorService(settings, instance_id=instance_id)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name=f"coord-{instance_id}")
        self.thread.start()

    def _main(self) -> None:
        try:
            self.service.run()
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        self.service.stop()
        self.thread.join(30)


def _settle(settings: KafkaSettings, tx: str) -> None:
    """A one-step saga and its step's applied event."""
    now = int(time.time() * 1000)
    request = SagaRequest(
        tx_id=tx,
        saga="transfer",
        mode=Mode.PARALLEL,
        steps=(Step("ledger", "increment", {"key": "a", "by": 1}),),
        deadline_ms=now + 120_000,
        created_ms=now,
    )
    with Producer(settings) as producer:
        producer.produce(settings.topics.requests, tx, encode(request))
        event = StepEvent(tx, 0, "ledger", StepStatus.APPLIED, now)
        producer.produce(settings.topics.events, tx, encode(event))
        producer.flush(10)


class _Decisions:
    """A read_committed reader of the decisions topic."""

    def __init__(self, settings: KafkaSettings) -> None:
        self.reader = Consumer(settings, group_id=None, client_id="failover-test.reader")
        self.reader.assign([(settings.topics.decisions, p, 0) for p in range(PARTITIONS)])
        self.seen: list[str] = []

    def until(self, txs: set[str], timeout: float = 60.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while not txs <= set(self.seen) and time.monotonic() < deadline:
            for m in self.reader.poll_batch(100, 0.5):
                d = decode_as(m.value, Decision)
                if isinstance(d, Decision):
                    self.seen.append(d.tx_id)
        return self.seen


def test_an_epoch_bump_without_a_newer_instance_is_ridden_through(
    settings: KafkaSettings,
) -> None:
    instance = f"f{uuid.uuid4().hex[:6]}"
    running = _Running(settings, instance)
    decisions = _Decisions(settings)
    try:
        _settle(settings, "tx-before")
        assert "tx-before" in decisions.until({"tx-before"}), running.error
        bump = TransactionalProducer(settings, f"{settings.prefix}.coordinator.{instance}")
        bump.init()  # what the broker does to a transaction it aborts itself
        bump.close()
        _settle(settings, "tx-after")
        seen = decisions.until({"tx-after"})
        assert running.error is None and running.thread.is_alive(), running.error
        assert sorted(seen) == ["tx-after", "tx-before"]  # each decided once
        assert running.service._txns.resets >= 1
        assert sorted(decisions.until({"never"}, timeout=3)) == ["tx-after", "tx-before"]
    finally:
        decisions.reader.close()
        running.stop()


def test_a_newer_instance_with_the_same_id_still_stops_the_older(
    settings: KafkaSettings,
) -> None:
    instance = f"f{uuid.uuid4().hex[:6]}"
    older = _Running(settings, instance)
    decisions = _Decisions(settings)
    newer: _Running | None = None
    try:
        _settle(settings, "tx-first")
        assert "tx-first" in decisions.until({"tx-first"}), older.error
        newer = _Running(settings, instance)
        older.thread.join(60)
        assert not older.thread.is_alive(), "the older instance went on beside the newer"
        assert isinstance(older.error, FatalKafkaError), older.error
        assert "fenced" in str(older.error)
        _settle(settings, "tx-second")
        assert sorted(decisions.until({"tx-second"})) == ["tx-first", "tx-second"]
        assert newer.error is None and newer.thread.is_alive(), newer.error
    finally:
        decisions.reader.close()
        if newer is not None:
            newer.stop()
        older.stop()
