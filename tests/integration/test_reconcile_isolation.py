"""``saga reconcile`` reports a step whose effect reached its store before its saga's
commit, where the ledgers can tell (I7, class ``early_effect``; issue 28).

The log is seeded straight into Kafka and the ledger entries are written straight
into the three stores in the participants' own layouts (PostgreSQL ``saga_ledger``
for ``bank``, MongoDB ``saga_ledger`` for ``shop``, Redis hashes for ``loyalty``),
so each store's reader of the entry's level is exercised. Found: a
``read_committed`` entry ``committed`` under a rollback decision or with no decision
at all, and a built-in step of a ``read_committed`` request whose entry has a plain
before-image (it was written at apply). Not found: the same shapes at level
``none``, a custom action, a request older than the isolation field, an entry
committed within the grace period; a clean log of both levels gives no finding.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa

from saga.participants._actions import READ_COMMITTED_BEFORE
from saga.participants._barrier import LedgerEntry, LedgerStatus
from saga.participants._ledger import entry_fields, entry_json
from saga.streams import (
    Decision,
    Isolation,
    Mode,
    Outcome,
    SagaRequest,
    Step,
    StepEvent,
    StepStatus,
    encode,
)
from saga.streams.kafka import KafkaSettings, Producer
from saga.streams.reconcile._sources import jdbc_level
from tests._infra import Services
from tests._system import fresh_topics
from tests.integration.test_reconcile import (
    NOW,
    OLD,
    PARTITIONS,
    RECENT,
    Stores,
    audit,
    findings,
    open_stores,
)

if TYPE_CHECKING:
    from pymongo.database import Database

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture
def settings(services: Services) -> Iterator[KafkaSettings]:
    yield from fresh_topics(services, "rci", PARTITIONS)


@pytest.fixture
def stores(
    services: Services,
    pg_schema: tuple[str, str],
    mongo_db: Database[dict[str, Any]],
    redis_prefix: str,
) -> Iterator[Stores]:
    yield from open_stores(services, pg_schema, mongo_db, redis_prefix)


MARK = dict(READ_COMMITTED_BEFORE)
"""A read_committed step's before: only its level's mark."""


@dataclass
class Log:
    """A made-up history: records for Kafka and each participant's ledger entries."""

    records: list[tuple[str, str, bytes]] = field(default_factory=list)
    entries: list[tuple[str, LedgerEntry]] = field(default_factory=list)
    requests: dict[str, SagaRequest] = field(default_factory=dict)

    def saga(
        self,
        tx: str,
        steps: list[tuple[str, str]],
        level: Isolation | None = Isolation.READ_COMMITTED,
        deadline: int = OLD + 30_000,
    ) -> None:
        """A request of ``(participant, action)`` steps; ``level`` None: the request is
        older than the isolation field (it has none)."""
        request = SagaRequest(
            tx,
            "test",
            Mode.PARALLEL,
            tuple(Step(p, a, {"target": "t", "key": tx}) for p, a in steps),
            deadline,
            OLD,
            isolation=level or Isolation.READ_COMMITTED,
        )
        value = encode(request)
        if level is None:
            plain = json.loads(value)
            del plain["isolation"]
            value = json.dumps(plain).encode()
        self.requests[tx] = request
        self.records.append(("requests", tx, value))

    def event(self, tx: str, step: int, status: str, at: int, *, confirm: bool = False) -> None:
        participant = self.requests[tx].steps[step].participant
        event = StepEvent(tx, step, participant, StepStatus(status), at, confirm=confirm)
        self.records.append(("events", tx, encode(event)))

    def decision(self, tx: str, outcome: str, at: int = OLD + 2_000) -> None:
        self.records.append(("decisions", tx, encode(Decision(tx, Outcome(outcome), "x", at))))

    def entry(self, tx: str, step: int, status: str, before: Any, at: int = OLD + 3_000) -> None:
        """The participant's ledger entry for ``tx``'s step, its effect taken."""
        request = self.requests[tx]
        s = request.steps[step]
        self.entries.append(
            (
                s.participant,
                LedgerEntry(
                    tx_id=tx,
                    step=step,
                    status=LedgerStatus(status),
                    action=s.action,
                    args=s.args,
                    n_steps=len(request.steps),
                    deadline_ms=request.deadline_ms,
                    effect=True,
                    before=before,
                    updated_ms=at,
                ),
            )
        )

    def committed(self, tx: str, before: Any, *, confirm: bool) -> None:
        """Every step applied, the commit, and (``confirm``) every step committed."""
        n = len(self.requests[tx].steps)
        for i in range(n):
            self.event(tx, i, "applied", OLD + 1_000, confirm=confirm)
        self.decision(tx, "commit")
        for i in range(n):
            if confirm:
                self.event(tx, i, "committed", OLD + 3_000)
            self.entry(tx, i, "committed" if confirm else "applied", before)

    def rolled_back(self, tx: str, before: Any, *, confirm: bool) -> None:
        """Every step applied, the rollback, every step compensated."""
        n = len(self.requests[tx].steps)
        for i in range(n):
            self.event(tx, i, "applied", OLD + 1_000, confirm=confirm)
        self.decision(tx, "rollback")
        for i in range(n):
            self.event(tx, i, "compensated", OLD + 3_000)
            self.entry(tx, i, "compensated", before)

    def write(self, settings: KafkaSettings, stores: Stores) -> None:
        topics = {
            "requests": settings.topics.requests,
            "events": settings.topics.events,
            "decisions": settings.topics.decisions,
        }
        with Producer(settings) as producer:
            for topic, key, value in self.records:
                producer.produce(topics[topic], key, value)
            producer.flush(30)
        write_entries(stores, self.entries)


def write_entries(stores: Stores, entries: list[tuple[str, LedgerEntry]]) -> None:
    """Each participant's entries in its store's own layout (the adapters' helpers)."""
    import redis

    from saga.participants.mongo._ledger import _entry_fields
    from saga.participants.sql._ledger import define_ledger

    metadata = sa.MetaData(schema=stores.schema)
    table = define_ledger(metadata)
    metadata.create_all(stores.engine)
    rows = [{"participant": p, **entry_fields(e)} for p, e in entries if p == "bank"]
    if rows:
        with stores.engine.begin() as conn:
            conn.execute(sa.insert(table), rows)
    docs = [
        {
            "_id": f"{p}:{e.tx_id}:{e.step}",
            "participant": p,
            "tx_id": e.tx_id,
            "step": e.step,
            "rev": 1,
            **_entry_fields(e),
        }
        for p, e in entries
        if p == "shop"
    ]
    stores.mongo["saga_ledger"].insert_many(docs) if docs else None
    client = redis.Redis.from_url(stores.redis_url)
    try:
        for p, e in entries:
            if p == "loyalty":
                key = f"{stores.redis_prefix}:ledger:loyalty:tx:{e.tx_id}"
                client.hset(key, str(e.step), entry_json(e))
    finally:
        client.close()


ALL = [("bank", "insert"), ("shop", "put"), ("loyalty", "increment")]


def seed_clean(log: Log) -> dict[str, str]:
    """Sagas of both levels that keep isolation as the ledgers record it; tx -> class."""
    log.saga("ok-rc-commit", ALL)
    log.committed("ok-rc-commit", MARK, confirm=True)
    log.saga("ok-rc-rollback", ALL)
    log.rolled_back("ok-rc-rollback", MARK, confirm=True)
    # `none` writes at apply, by choice: plain before-images, nothing to confirm.
    log.saga("ok-none-commit", ALL, Isolation.NONE)
    log.committed("ok-none-commit", {"balance": 5}, confirm=False)
    log.saga("ok-none-rollback", ALL, Isolation.NONE)
    log.rolled_back("ok-none-rollback", {"balance": 5}, confirm=False)
    # A custom action keeps a plain before at every level; no ledger shows its isolation.
    log.saga("ok-custom", [("bank", "reserve_seat"), ("loyalty", "award")])
    log.committed("ok-custom", {"seat": "12A"}, confirm=False)
    # Older than the isolation field: its participants wrote every step at apply.
    log.saga("ok-old-request", ALL, level=None)
    log.committed("ok-old-request", {"balance": 5}, confirm=False)
    # Committed a moment ago: its commit may be after the log's snapshot (within grace).
    log.saga("ok-recent", [("bank", "insert")], deadline=NOW + 60_000)
    log.event("ok-recent", 0, "applied", RECENT, confirm=True)
    log.entry("ok-recent", 0, "committed", MARK, at=RECENT)
    return {
        "ok-rc-commit": "ok",
        "ok-rc-rollback": "ok",
        "ok-none-commit": "ok",
        "ok-none-rollback": "ok",
        "ok-custom": "ok",
        "ok-old-request": "ok",
        "ok-recent": "in_flight",
    }


def seed_early(log: Log) -> dict[str, tuple[str, str]]:
    """One early effect per shape and store; tx -> what its reason must say."""
    # read_committed, written although the saga rolled back (PostgreSQL) ...
    log.saga("e-committed-rollback", [("bank", "insert")])
    log.event("e-committed-rollback", 0, "applied", OLD + 1_000, confirm=True)
    log.decision("e-committed-rollback", "rollback")
    log.entry("e-committed-rollback", 0, "committed", MARK)
    # ... or with no decision at all (MongoDB).
    log.saga("e-committed-undecided", [("shop", "put")])
    log.event("e-committed-undecided", 0, "applied", OLD + 1_000, confirm=True)
    log.entry("e-committed-undecided", 0, "committed", MARK)
    # A read_committed request whose built-in step was written at apply (Redis) ...
    log.saga("e-at-apply", [("loyalty", "increment")])
    log.committed("e-at-apply", {"points": "0"}, confirm=False)
    # ... and one rolled back afterwards: readers saw it all the same (PostgreSQL).
    log.saga("e-at-apply-rollback", [("bank", "update")])
    log.rolled_back("e-at-apply-rollback", {"balance": 5}, confirm=False)
    return {
        "e-committed-rollback": (
            "(read_committed) was written in sql",
            "(participant bank, ledger status committed) but the log has a rollback decision",
        ),
        "e-committed-undecided": (
            "(read_committed) was written in mongo",
            "(participant shop, ledger status committed) but the log has no decision",
        ),
        "e-at-apply": (
            "of a read_committed saga was written in redis",
            "at apply (participant loyalty recorded level none for it, ledger status applied)",
        ),
        "e-at-apply-rollback": (
            "of a read_committed saga was written in sql",
            "at apply (participant bank recorded level none for it, ledger status compensated)",
        ),
    }


def test_early_effects_are_found_in_every_store(
    spark: Any, settings: KafkaSettings, stores: Stores, tmp_path: Path
) -> None:
    log = Log()
    clean = seed_clean(log)
    early = seed_early(log)
    log.write(settings, stores)
    result = audit(spark, settings, tmp_path, stores.ledger_specs())
    found = findings(spark, tmp_path)

    got = {tx: (r["class"], tuple(r["invariants"])) for tx, r in found.items()}
    assert got == {
        **{tx: (c, ()) for tx, c in clean.items()},
        **{tx: ("early_effect", ("I7",)) for tx in early},
    }, json.dumps({tx: r["reasons"] for tx, r in found.items() if r["reasons"]}, indent=1)
    for tx, says in early.items():
        (reason,) = found[tx]["reasons"]
        assert reason.startswith("I7: step 0 ") and all(part in reason for part in says), reason

    summary = result.summary
    assert summary["classes"]["early_effect"] == len(early)
    assert summary["invariants"]["I7"] == len(early)
    assert summary["exit_code"] == 1
    assert f"early effect: {len(early)}" in summary["verdict"]


def test_a_clean_log_of_both_levels_reports_none(
    spark: Any, settings: KafkaSettings, stores: Stores, tmp_path: Path
) -> None:
    log = Log()
    clean = seed_clean(log)
    log.write(settings, stores)
    result = audit(spark, settings, tmp_path, stores.ledger_specs())
    summary = result.summary
    assert summary["exit_code"] == 0, summary["verdict"]
    assert summary["classes"]["early_effect"] == 0
    assert summary["invariants"]["I7"] == 0
    assert {tx: r["class"] for tx, r in findings(spark, tmp_path).items()} == clean
    assert [(x["participants"], x["entries"] > 0) for x in summary["ledgers"]] == [
        (["bank"], True),
        (["shop"], True),
        (["loyalty"], True),
    ]


def test_the_jdbc_reader_reads_the_level_as_the_local_one(spark: Any) -> None:
    """A cluster run reads the SQL ledger through JDBC (``before`` as JSON text)."""
    from pyspark.sql import functions as F

    befores = [json.dumps(MARK), json.dumps({"balance": 5}), "null", None]
    frame = spark.createDataFrame([(b,) for b in befores], "before STRING")
    levels = [r[0] for r in frame.select(jdbc_level(F.col("before"))).collect()]
    assert levels == ["read_committed", "none", "none", "none"]
