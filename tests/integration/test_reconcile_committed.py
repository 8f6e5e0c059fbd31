"""``saga reconcile`` reads ``saga.committed``: each step it lists counts as that step's
``committed`` ``saga.step``; one listing another partition's saga is invalid.

Participants acknowledge the commit decisions of one batch with one ``saga.committed``
per events partition (``[[tx_id, step], ...]``, keyed by the first ``tx_id``) instead
of one ``committed`` event per step; older participants and custom producers still
write the per-step events, and a log may hold both. The log is seeded straight into
Kafka, the ledgers straight into the three stores (as :mod:`.test_reconcile` does).
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from saga.streams import StepsCommitted, encode
from saga.streams._signing import Keyring, create_key
from saga.streams.kafka import KafkaSettings, Producer, partition_for
from saga.streams.reconcile import ReconcileConfig, run
from saga.streams.reconcile._parse import partition_sql
from tests._infra import Services
from tests._system import fresh_topics
from tests.integration.test_reconcile import (
    GRACE,
    NOW,
    OLD,
    PARTITIONS,
    Seeder,
    Stores,
    _dlq_headers,
    audit,
    findings,
    open_stores,
)

if TYPE_CHECKING:
    from pymongo.database import Database

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ACKED = OLD + 3_000  # when the participants acknowledged the commits


@pytest.fixture
def settings(services: Services) -> Iterator[KafkaSettings]:
    yield from fresh_topics(services, "rcc", PARTITIONS)


@pytest.fixture
def stores(
    services: Services,
    pg_schema: tuple[str, str],
    mongo_db: Database[dict[str, Any]],
    redis_prefix: str,
) -> Iterator[Stores]:
    yield from open_stores(services, pg_schema, mongo_db, redis_prefix)


def together(prefix: str, count: int, partition: int = 0) -> list[str]:
    """``count`` transaction ids starting with ``prefix`` whose records share ``partition``."""
    found = [f"{prefix}-{i}" for i in range(200)]
    return [tx for tx in found if partition_for(tx, PARTITIONS) == partition][:count]


def elsewhere(tx: str) -> str:
    """A transaction id whose records are on another partition than ``tx``'s."""
    home = partition_for(tx, PARTITIONS)
    return next(f"far-{i}" for i in range(200) if partition_for(f"far-{i}", PARTITIONS) != home)


def acknowledge(
    s: Seeder, participant: str, steps: list[tuple[str, int]], *, ledger: bool = True
) -> bytes:
    """One ``saga.committed`` of ``participant`` for ``steps`` (keyed by the first
    ``tx_id``), as a participant writes it after a batch; returns its value."""
    record = StepsCommitted(participant, ACKED, tuple(steps))
    value = encode(record)
    s.send(s.settings.topics.events, record.tx_id, value)
    if ledger:
        for tx, step in steps:
            s.record(participant, tx, step, "committed", ACKED)
    return value


def committing(s: Seeder, tx: str, participants: tuple[str, ...], outcome: str = "commit") -> None:
    """A request whose every step is applied and has something to confirm, then decided."""
    s.request(tx, participants)
    for i in range(len(participants)):
        s.event(tx, i, "applied", confirm=True)
    s.decision(tx, outcome)


def test_partition_sql_is_partition_for(spark: Any) -> None:
    """The audit's murmur2 in Spark SQL gives every key the partition its producers do."""
    alphabet = string.ascii_letters + string.digits + "._:-"
    rnd = random.Random(7)
    keys = ["a", "ab", "abc", "abcd", "abcde", "tx-1", "Z" * 128]
    keys += ["".join(rnd.choices(alphabet, k=rnd.randint(1, 128))) for _ in range(500)]
    frame = spark.createDataFrame([(k,) for k in keys], "k STRING")
    for partitions in (1, 3, 7, 64):
        got = dict(frame.selectExpr("k", partition_sql("k", partitions)).collect())
        assert {k: got[k] for k in keys} == {k: partition_for(k, partitions) for k in keys}


def test_steps_committed_together_audit_like_committed_events(
    spark: Any, settings: KafkaSettings, stores: Stores, tmp_path: Path
) -> None:
    """Sagas whose ``committed`` steps come in ``saga.committed`` records (alone or mixed
    with per-step events) are ``ok``; a listed step counts for commits (I2), rollbacks
    (I3) and stuck steps as a ``committed`` event would; a ``saga.committed`` listing
    another partition's saga is invalid (counted, with its reason) and acknowledges
    nothing; its dead letter was rightly rejected, a valid one's was not (I6)."""
    t = settings.topics
    a, b, mixed, missing, rolled, stranger, home, dlq = together("ack", 8)
    far = elsewhere(home)
    with Producer(settings) as producer:
        s = Seeder(settings, producer)
        for tx in (a, b, home, dlq):
            committing(s, tx, ("bank", "shop"))
        committing(s, mixed, ("bank", "shop"))
        committing(s, missing, ("bank", "shop"))
        committing(s, stranger, ("bank",))
        committing(s, far, ("bank",))
        # One record per participant for a batch of sagas of one partition.
        acknowledge(s, "bank", [(a, 0), (b, 0), (mixed, 0), (missing, 0)])
        acknowledge(s, "shop", [(b, 1), (a, 1)])
        s.event(mixed, 1, "committed", ACKED)  # an older participant: one event per step
        # Listed by a participant that does not own the step: the coordinator ignores it.
        acknowledge(s, "loyalty", [(stranger, 0)], ledger=False)
        # A rollback whose applied step is listed as committed: I3.
        s.request(rolled, ("bank",))
        s.event(rolled, 0, "applied")
        s.decision(rolled, "rollback")
        acknowledge(s, "bank", [(rolled, 0)], ledger=False)
        # Lists `far`, whose records are on another partition: the whole record is invalid.
        acknowledge(s, "bank", [(home, 0), (home, 1), (far, 0)], ledger=False)
        # The coordinator's dead letters: the misplaced record (rightly rejected), and a
        # valid record of two of `dlq`'s steps, which it should have taken.
        misplaced = encode(StepsCommitted("bank", ACKED, ((home, 0), (far, 0))))
        s.send(t.dlq, home, misplaced, _dlq_headers(t.events, home, 1_000_001))
        valid = acknowledge(s, "bank", [(dlq, 0), (dlq, 1)], ledger=False)
        s.send(t.dlq, dlq, valid, _dlq_headers(t.events, dlq, 1_000_002))
        producer.flush(30)
    stores.write(s)

    result = audit(spark, settings, tmp_path, stores.ledger_specs())
    found = findings(spark, tmp_path)
    got = {tx: (r["class"], r["invariants"]) for tx, r in found.items()}
    assert got == {
        a: ("ok", []),
        b: ("ok", []),
        mixed: ("ok", []),
        missing: ("stuck_unfinished", []),
        stranger: ("stuck_unfinished", []),
        rolled: ("violation", ["I3"]),
        home: ("stuck_unfinished", []),
        far: ("stuck_unfinished", []),
        dlq: ("violation", ["I6"]),
    }, {tx: r["reasons"] for tx, r in found.items()}
    assert found[missing]["unfinished_steps"] == [1]
    assert found[home]["unfinished_steps"] == [0, 1]
    assert found[a]["events"] == 4  # two applied, two committed (in two records)
    assert "rollback, but step(s) 0 were committed" in found[rolled]["reasons"][0]
    assert "valid saga.committed" in found[dlq]["reasons"][0]

    summary = result.summary
    assert summary["invalid_records"] == {"requests": 0, "events": 1, "decisions": 0}
    explained = summary["invalid_explained"]
    assert explained["count"] == 1
    assert f"saga.committed lists {far}, which belongs on partition" in explained["first"]
    # Records, not step events: 15 applied, 1 committed event, 6 saga.committed.
    assert summary["records"]["events"] == 15 + 1 + 6
    assert summary["dlq"] == {
        "records": 2,
        "invalid": 0,
        "justified": 1,
        "violations": 1,
        "by_component": {"coordinator": 2},
    }


PRINCIPALS = ("coordinator", "client", "participant-bank", "participant-shop")


@dataclass
class SignedSeeder(Seeder):
    """A :class:`Seeder` whose records are signed by ``by``'s key."""

    keys: dict[str, Keyring] = field(default_factory=dict)
    by: str = "client"

    def send(self, topic: str, key: str | bytes, value: bytes, headers: Any = None) -> None:
        signed = self.keys[self.by].sign(topic, key, value, headers)
        self.producer.produce(topic, key, value, headers=signed)


def test_a_signed_saga_committed_counts_only_for_its_signer(
    spark: Any, settings: KafkaSettings, tmp_path: Path
) -> None:
    """With a key folder, a ``saga.committed`` counts only when signed by the participant
    it names: the one bank signed acknowledges bank's step; one naming shop that bank
    signed is forged (invalid), so shop's step stays unanswered."""
    folder = tmp_path / "keys"
    for principal in PRINCIPALS:
        create_key(folder, principal)
    ring = {p: Keyring.load(folder, p) for p in PRINCIPALS}
    tx = together("sig", 1)[0]
    with Producer(settings) as producer:
        s = SignedSeeder(settings, producer, keys=ring)
        s.request(tx, ("bank", "shop"))
        for step, who in ((0, "participant-bank"), (1, "participant-shop")):
            s.by = who
            s.event(tx, step, "applied", confirm=True)
        s.by = "coordinator"
        s.decision(tx, "commit")
        s.by = "participant-bank"
        acknowledge(s, "bank", [(tx, 0)])
        acknowledge(s, "shop", [(tx, 1)])  # bank's signature on shop's acknowledgement
        producer.flush(30)

    config = ReconcileConfig(
        settings=settings,
        out=tmp_path / "out",
        grace_ms=GRACE,
        now_ms=NOW,
        write_all=True,
        keys_dir=folder,
    )
    result = run(config, spark=spark, say=lambda _: None)
    row = findings(spark, tmp_path / "out")[tx]
    assert (row["class"], row["unfinished_steps"]) == ("stuck_unfinished", [1])
    assert result.summary["invalid_records"] == {"requests": 0, "events": 1, "decisions": 0}
    assert result.summary["signatures"]["forged_records"]["events"] == 1
