"""``saga reconcile`` on logs seeded on purpose, straight into Kafka and the ledgers.

Why this module is over 600 lines: it seeds one log and one set of ledgers that
all its cases share (seeding is the slow part), one case per class of finding.

Every class and every invariant the job checks has a transaction made to show
it (a missing decision, a double decision, a commit with a failed step, a
rollback whose applied step was never compensated, a step applied in a store
but absent from the log, a valid record on the DLQ, ...). The job must find
each one, with the right invariant, and nothing else; a clean log gives no
finding at all. The ledgers are written in the participants' own layouts
(PostgreSQL ``saga_ledger``, MongoDB ``saga_ledger``, Redis
``<prefix>:ledger:<participant>:tx:<tx_id>``), one store per participant.

One SparkSession serves the module (starting one takes about ten seconds).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa

from saga.streams import (
    Decision,
    Mode,
    Outcome,
    SagaAbort,
    SagaRequest,
    Step,
    StepEvent,
    StepStatus,
    encode,
)
from saga.streams.kafka import (
    Consumer,
    KafkaSettings,
    Producer,
    partition_for,
)
from saga.streams.reconcile import ReconcileConfig, parse_check, parse_ledger, parse_table, run
from tests._infra import Services
from tests._system import fresh_topics

if TYPE_CHECKING:
    from pymongo.database import Database

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

NOW = 1_800_000_000_000  # the audit's "now" (--now-ms)
GRACE = 60_000
OLD = NOW - 600_000  # long enough ago for anything to be stuck
RECENT = NOW - 5_000  # within the grace period
PARTICIPANTS = ("bank", "shop", "loyalty")  # PostgreSQL, MongoDB, Redis
PARTITIONS = 3  # of every topic
_ELSEWHERE = 1_000_000
"""Offsets past the end of the seeded log: the seeded dead letters stand for records
that are not in it (the audit leaves out a record its coordinator dead-lettered)."""


# ---------------------------------------------------------------- seeding


@dataclass
class Entry:
    participant: str
    tx_id: str
    step: int
    status: str
    effect: bool
    updated_ms: int


@dataclass
class Seeder:
    """Writes records of a made-up history to Kafka and remembers each ledger's entries."""

    settings: KafkaSettings
    producer: Producer
    ledger: dict[tuple[str, str, int], Entry] = field(default_factory=dict)
    requests: dict[str, SagaRequest] = field(default_factory=dict)

    def request(
        self,
        tx: str,
        participants: tuple[str, ...] = PARTICIPANTS,
        *,
        deadline: int = OLD + 30_000,
        created: int = OLD,
        item: str = "book",
    ) -> SagaRequest:
        steps = tuple(
            Step(p, "insert", {"target": "t", "key": f"{tx}-{i}", "value": {"item": item}})
            for i, p in enumerate(participants)
        )
        request = SagaRequest(tx, "test", Mode.PARALLEL, steps, deadline, created)
        self.requests.setdefault(tx, request)
        self.send(self.settings.topics.requests, tx, encode(request))
        return request

    def event(
        self,
        tx: str,
        step: int,
        status: str,
        at: int = OLD + 1_000,
        *,
        ledger: bool = True,
        confirm: bool = False,
    ) -> None:
        """A step event; ``confirm``: an ``applied`` one says ``"confirm": true`` (the step
        has something to confirm, so a commit expects its ``committed`` event)."""
        participant = self.requests[tx].steps[step].participant
        event = StepEvent(tx, step, participant, StepStatus(status), at)
        value = encode(event)
        if confirm:
            value = json.dumps({**json.loads(value), "confirm": True}).encode()
        self.send(self.settings.topics.events, tx, value)
        if ledger:
            self.record(participant, tx, step, status, at)

    def record(self, participant: str, tx: str, step: int, status: str, at: int) -> None:
        """What the participant's ledger holds after emitting ``status`` for the step."""
        old = self.ledger.get((participant, tx, step))
        effect = status == "applied" or (old is not None and old.effect)
        self.ledger[(participant, tx, step)] = Entry(participant, tx, step, status, effect, at)

    def decision(
        self, tx: str, outcome: str, at: int = OLD + 2_000, reason: str | None = None
    ) -> None:
        record = Decision(tx, Outcome(outcome), reason or f"decided {outcome}", at)
        self.send(self.settings.topics.decisions, tx, encode(record))

    def send(self, topic: str, key: str | bytes, value: bytes, headers: Any = None) -> None:
        self.producer.produce(topic, key, value, headers=headers)


def seed_clean(s: Seeder) -> set[str]:
    """Transactions that finished as they should; returns their ids."""
    # The log before the `confirm` field: every step of a commit reported `committed`.
    s.request("ok-commit")
    for i in range(3):
        s.event("ok-commit", i, "applied")
    s.decision("ok-commit", "commit")
    for i in range(3):
        s.event("ok-commit", i, "committed", OLD + 3_000)

    s.request("ok-rollback")
    s.event("ok-rollback", 0, "applied")
    s.event("ok-rollback", 1, "failed")
    s.event("ok-rollback", 2, "applied")
    s.decision("ok-rollback", "rollback")
    for i in range(3):
        s.event("ok-rollback", i, "compensated", OLD + 3_000)

    # Null compensation: the rollback (an operator's abort) came before the request.
    s.send(s.settings.topics.requests, "ok-null", encode(SagaAbort("ok-null", "no", OLD + 100)))
    s.decision("ok-null", "rollback", OLD + 200)
    s.request("ok-null")
    for i in range(3):
        s.event("ok-null", i, "compensated", OLD + 3_000)

    # Nothing to confirm: the commit decision finishes every step, no `committed` event
    # follows, and the ledgers keep the entries `applied`.
    s.request("ok-commit-no-confirm")
    for i in range(3):
        s.event("ok-commit-no-confirm", i, "applied")
    s.decision("ok-commit-no-confirm", "commit")

    # Only step 1 had something to confirm (`"confirm": true`): only it reports `committed`.
    s.request("ok-commit-confirm")
    for i in range(3):
        s.event("ok-commit-confirm", i, "applied", confirm=i == 1)
    s.decision("ok-commit-confirm", "commit")
    s.event("ok-commit-confirm", 1, "committed", OLD + 3_000)

    # A replayed decision: the same outcome twice is harmless.
    s.request("ok-replayed", ("bank",))
    s.event("ok-replayed", 0, "applied")
    s.decision("ok-replayed", "commit")
    s.decision("ok-replayed", "commit", OLD + 50_000)
    s.event("ok-replayed", 0, "committed", OLD + 3_000)

    # Sequential, compensated in reverse order after the last step failed.
    s.request("ok-sequential", ("bank", "shop"))
    s.event("ok-sequential", 0, "applied")
    s.event("ok-sequential", 1, "failed", OLD + 1_500)
    s.decision("ok-sequential", "rollback")
    s.event("ok-sequential", 1, "compensated", OLD + 2_500)
    s.event("ok-sequential", 0, "compensated", OLD + 3_000)

    # A step naming a participant the coordinator knows does not exist: it rolls back at
    # once and counts that step compensated itself; nobody ever reports it.
    s.request("ok-unknown", ("bank", "ghost"))
    s.decision("ok-unknown", "rollback", reason="step 1 names unknown participant(s): ghost")
    s.event("ok-unknown", 0, "compensated", OLD + 3_000)

    # Applied and compensated in the store, reported only as compensated: a participant
    # killed between its local commit and its events, with the request and the rollback in
    # that batch, re-reports the step's latest state only (found by the chaos suite).
    s.request("ok-crash-rollback", ("bank",))
    s.decision("ok-crash-rollback", "rollback")
    s.event("ok-crash-rollback", 0, "compensated", OLD + 3_000, ledger=False)
    s.ledger[("bank", "ok-crash-rollback", 0)] = Entry(
        "bank", "ok-crash-rollback", 0, "compensated", True, OLD + 3_000
    )
    return {
        "ok-commit",
        "ok-commit-no-confirm",
        "ok-commit-confirm",
        "ok-rollback",
        "ok-null",
        "ok-replayed",
        "ok-sequential",
        "ok-unknown",
        "ok-crash-rollback",
    }


def seed_findings(s: Seeder) -> dict[str, tuple[str, tuple[str, ...]]]:
    """One transaction per finding; returns ``{tx: (class, invariants)}`` expected."""
    expected: dict[str, tuple[str, tuple[str, ...]]] = {}

    s.request("inflight-pending", ("bank", "loyalty"), deadline=NOW + 60_000, created=RECENT)
    s.event("inflight-pending", 0, "applied", RECENT)
    # loyalty applied a moment ago and has not emitted yet: within grace, not a finding
    s.record("loyalty", "inflight-pending", 1, "applied", RECENT)
    expected["inflight-pending"] = ("in_flight", ())

    s.request("inflight-deciding", ("bank", "shop"))
    s.event("inflight-deciding", 0, "applied", confirm=True)
    s.event("inflight-deciding", 1, "applied", confirm=True)
    s.decision("inflight-deciding", "commit", RECENT)
    s.event("inflight-deciding", 0, "committed", RECENT)
    expected["inflight-deciding"] = ("in_flight", ())

    s.request("stuck-no-decision", ("bank", "shop"))
    s.event("stuck-no-decision", 0, "applied")
    expected["stuck-no-decision"] = ("stuck_no_decision", ())

    # Both steps have something to confirm; step 1 never reports `committed`.
    s.request("stuck-commit", ("bank", "shop"))
    s.event("stuck-commit", 0, "applied", confirm=True)
    s.event("stuck-commit", 1, "applied", confirm=True)
    s.decision("stuck-commit", "commit")
    s.event("stuck-commit", 0, "committed", OLD + 3_000)
    expected["stuck-commit"] = ("stuck_unfinished", ())

    # A rollback with an applied step that was never compensated.
    s.request("stuck-rollback")
    s.event("stuck-rollback", 0, "applied")
    s.event("stuck-rollback", 1, "failed")
    s.decision("stuck-rollback", "rollback")
    s.event("stuck-rollback", 1, "compensated", OLD + 3_000)
    s.event("stuck-rollback", 2, "compensated", OLD + 3_000)
    expected["stuck-rollback"] = ("stuck_unfinished", ())

    # loyalty never answered anything: it may have missed the request too.
    s.request("stuck-silent")
    s.event("stuck-silent", 0, "applied")
    s.event("stuck-silent", 1, "failed")
    s.decision("stuck-silent", "rollback")
    s.event("stuck-silent", 0, "compensated", OLD + 3_000)
    s.event("stuck-silent", 1, "compensated", OLD + 3_000)
    expected["stuck-silent"] = ("stuck_unfinished", ())

    s.request("comp-failed", ("bank", "shop"))
    s.event("comp-failed", 0, "applied")
    s.event("comp-failed", 1, "failed")
    s.decision("comp-failed", "rollback")
    s.event("comp-failed", 0, "compensation_failed", OLD + 3_000)
    s.event("comp-failed", 1, "compensated", OLD + 3_000)
    expected["comp-failed"] = ("compensation_failed", ())

    s.request("v-double-decision", ("bank",))
    s.event("v-double-decision", 0, "applied")
    s.decision("v-double-decision", "commit")
    s.decision("v-double-decision", "rollback", OLD + 2_500)
    s.event("v-double-decision", 0, "committed", OLD + 3_000)
    expected["v-double-decision"] = ("violation", ("I1",))

    s.request("v-commit-failed", ("bank", "shop"))
    s.event("v-commit-failed", 0, "applied")
    s.event("v-commit-failed", 1, "failed")
    s.decision("v-commit-failed", "commit")
    s.event("v-commit-failed", 0, "committed", OLD + 3_000)
    s.event("v-commit-failed", 1, "committed", OLD + 3_000)
    expected["v-commit-failed"] = ("violation", ("I2",))

    # Hanging: the step was compensated (null compensation), then applied after all.
    s.request("v-applied-after-rollback", ("bank",))
    s.decision("v-applied-after-rollback", "rollback")
    s.event("v-applied-after-rollback", 0, "compensated", OLD + 2_500)
    s.event("v-applied-after-rollback", 0, "applied", OLD + 2_600)
    expected["v-applied-after-rollback"] = ("violation", ("I3",))

    s.request("v-late", ("bank",), deadline=OLD + 30_000)
    s.event("v-late", 0, "applied", OLD + 40_000)
    s.decision("v-late", "commit", OLD + 41_000)
    s.event("v-late", 0, "committed", OLD + 42_000)
    expected["v-late"] = ("violation", ("I3",))

    # I4, one per store: applied (then compensated) in the store, absent from the log ...
    for tx, participant in (("v-store-sql", "bank"), ("v-store-redis", "loyalty")):
        s.request(tx, (participant,))
        s.decision(tx, "rollback")
        s.ledger[(participant, tx, 0)] = Entry(participant, tx, 0, "compensated", True, OLD)
        expected[tx] = ("violation", ("I4",))
    # ... and in the log, absent from the store.
    s.request("v-log-mongo", ("shop",))
    s.event("v-log-mongo", 0, "applied", ledger=False)
    s.decision("v-log-mongo", "commit")
    s.event("v-log-mongo", 0, "committed", OLD + 3_000, ledger=False)
    expected["v-log-mongo"] = ("violation", ("I4",))

    # A transaction the log knows nothing of, applied in the SQL ledger.
    s.record("bank", "v-ghost", 0, "applied", OLD)
    expected["v-ghost"] = ("violation", ("I4",))

    # I6: a valid step event on the dead-letter topic.
    s.request("v-dlq", ("bank",))
    s.event("v-dlq", 0, "applied")
    s.decision("v-dlq", "commit")
    s.event("v-dlq", 0, "committed", OLD + 3_000)
    valid = encode(StepEvent("v-dlq", 0, "bank", StepStatus.COMMITTED, OLD + 3_000))
    s.send(
        s.settings.topics.dlq,
        "v-dlq",
        valid,
        _dlq_headers(s.settings.topics.events, "v-dlq", _ELSEWHERE + 7),
    )
    expected["v-dlq"] = ("violation", ("I6",))
    return expected


def seed_noise(s: Seeder) -> None:
    """Records every consumer skips, and dead letters that were rightly rejected."""
    t = s.settings.topics
    s.send(t.requests, "junk", b"not json at all")
    s.send(t.events, "junk", b'{"v": 1, "type": "saga.step"}')
    # Keyed by another transaction: consumers ignore it, so must the audit.
    stray = StepEvent("ok-commit", 0, "bank", StepStatus.FAILED, OLD)
    s.send(t.events, "someone-else", encode(stray))
    s.send(t.decisions, "ok-commit", b'{"v": 2, "type": "saga.decision"}')
    # Dead letters: garbage, a conflicting resubmission, an abort after the decision.
    s.send(t.dlq, "junk", b"\xff\xfe", _dlq_headers(t.requests, "junk", _ELSEWHERE + 3))
    conflicting = SagaRequest(
        "ok-commit", "test", Mode.PARALLEL, (Step("bank", "delete", {}),), OLD + 30_000, OLD
    )
    s.send(
        t.dlq,
        "ok-commit",
        encode(conflicting),
        _dlq_headers(t.requests, "ok-commit", _ELSEWHERE + 99),
    )
    late_abort = SagaAbort("ok-rollback", "too late", OLD + 5_000)
    s.send(
        t.dlq,
        "ok-rollback",
        encode(late_abort),
        _dlq_headers(t.requests, "ok-rollback", _ELSEWHERE + 98),
    )


def seed_every_class(
    settings: KafkaSettings, stores: Stores
) -> tuple[set[str], dict[str, tuple[str, tuple[str, ...]]]]:
    """The clean sagas, every class of finding and the noise, on the log and in the three
    stores' ledgers; returns what ``seed_clean`` and ``seed_findings`` returned."""
    with Producer(settings) as producer:
        s = Seeder(settings, producer)
        clean = seed_clean(s)
        expected = seed_findings(s)
        seed_noise(s)
        producer.flush(30)
    stores.write(s)
    return clean, expected


def _dlq_headers(source: str, key: str, offset: int) -> list[tuple[str, bytes]]:
    """A coordinator's dead-letter headers for the record keyed ``key`` at ``offset`` of
    ``source``, on the partition its key gives (the DLQ judge checks it)."""
    partition = partition_for(key, PARTITIONS)
    return [
        ("saga.error", b"rejected"),
        ("saga.source.topic", source.encode()),
        ("saga.source.partition", str(partition).encode()),
        ("saga.source.offset", str(offset).encode()),
        ("saga.component", b"coordinator"),
    ]


# ---------------------------------------------------------------- ledgers


def write_ledgers(
    entries: list[Entry],
    engine: sa.Engine,
    schema: str,
    mongo: Database[dict[str, Any]],
    redis_url: str,
    redis_prefix: str,
) -> None:
    """Each participant's entries in its store's layout (the adapters' own helpers)."""
    from saga.participants._actions import READ_COMMITTED_BEFORE
    from saga.participants._barrier import LedgerEntry, LedgerStatus
    from saga.participants._ledger import entry_json as _entry_text
    from saga.participants.mongo._ledger import _entry_fields
    from saga.participants.sql._adapter import define_ledger

    def entry(e: Entry) -> LedgerEntry:
        return LedgerEntry(
            tx_id=e.tx_id,
            step=e.step,
            status=LedgerStatus(e.status),
            action="insert",
            args={"target": "t"},
            n_steps=3,
            deadline_ms=OLD + 30_000,
            effect=e.effect,
            before=READ_COMMITTED_BEFORE,  # every seeded request is read_committed (I7)
            updated_ms=e.updated_ms,
        )

    metadata = sa.MetaData(schema=schema)
    table = define_ledger(metadata)
    metadata.create_all(engine)
    rows = [
        {
            "participant": e.participant,
            "tx_id": e.tx_id,
            "step": e.step,
            "status": e.status,
            "action": "insert",
            "args": {"target": "t"},
            "mode": "parallel",
            "n_steps": 3,
            "deadline_ms": OLD + 30_000,
            "effect": e.effect,
            "before": READ_COMMITTED_BEFORE,
            "reason": None,
            "rollback_pending": False,
            "successor_compensated": False,
            "updated_ms": e.updated_ms,
        }
        for e in entries
        if e.participant == "bank"
    ]
    # A rollback marker (step -1) is never a step of its own.
    rows.append({**rows[0], "tx_id": "ok-null", "step": -1, "status": "compensated"})
    with engine.begin() as conn:
        conn.execute(sa.insert(table), rows)

    docs = [
        {
            "_id": f"{e.participant}:{e.tx_id}:{e.step}",
            "participant": e.participant,
            "tx_id": e.tx_id,
            "step": e.step,
            "rev": 1,
            **_entry_fields(entry(e)),
        }
        for e in entries
        if e.participant == "shop"
    ]
    mongo["saga_ledger"].insert_many(docs)

    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        for e in entries:
            if e.participant == "loyalty":
                key = f"{redis_prefix}:ledger:loyalty:tx:{e.tx_id}"
                client.hset(key, str(e.step), _entry_text(entry(e)))
        client.hset(f"{redis_prefix}:ledger:loyalty:tx:ok-null", "rolled_back", "{}")
    finally:
        client.close()


# ---------------------------------------------------------------- fixtures


@pytest.fixture
def settings(services: Services) -> Iterator[KafkaSettings]:
    yield from fresh_topics(services, "rc", PARTITIONS)


@dataclass
class Stores:
    engine: sa.Engine
    schema: str
    mongo: Database[dict[str, Any]]
    redis_url: str
    redis_prefix: str
    services: Services

    def write(self, seeder: Seeder) -> None:
        """The seeder's ledger entries, into the three stores."""
        write_ledgers(
            list(seeder.ledger.values()),
            self.engine,
            self.schema,
            self.mongo,
            self.redis_url,
            self.redis_prefix,
        )

    def ledger_specs(self) -> list[str]:
        pg = self.services.postgres_url
        mongo = self.services.mongo_url
        return [
            f"sql:{pg}#schema={self.schema}",
            f"mongo:{mongo}#database={self.mongo.name}",
            f"redis:{self.redis_url}#prefix={self.redis_prefix}",
        ]


def open_stores(
    services: Services,
    pg_schema: tuple[str, str],
    mongo_db: Database[dict[str, Any]],
    redis_prefix: str,
) -> Iterator[Stores]:
    """The body of the ``stores`` fixture, shared with the modules that seed like this one."""
    url, schema = pg_schema
    engine = sa.create_engine(url)
    try:
        yield Stores(
            engine, schema, mongo_db, services.redis_url, redis_prefix.rstrip(":"), services
        )
    finally:
        engine.dispose()


@pytest.fixture
def stores(
    services: Services,
    pg_schema: tuple[str, str],
    mongo_db: Database[dict[str, Any]],
    redis_prefix: str,
) -> Iterator[Stores]:
    yield from open_stores(services, pg_schema, mongo_db, redis_prefix)


def audit(
    spark: Any,
    settings: KafkaSettings,
    out: Path,
    ledgers: list[str],
    *,
    tables: tuple[str, ...] = (),
    checks: tuple[str, ...] = (),
    replay: bool = False,
    since_ms: int | None = None,
    ending_offsets: dict[str, dict[int, int]] | None = None,
) -> Any:
    config = ReconcileConfig(
        settings=settings,
        out=out,
        grace_ms=GRACE,
        now_ms=NOW,
        since_ms=since_ms,
        ending_offsets=ending_offsets,
        ledgers=tuple(parse_ledger(s) for s in ledgers),
        tables=tuple(parse_table(t) for t in tables),
        checks=tuple(parse_check(c) for c in checks),
        replay=replay,
        write_all=True,
        show=100,
    )
    return run(config, spark=spark, say=lambda _: None)


def findings(spark: Any, out: Path) -> dict[str, dict[str, Any]]:
    rows = spark.read.parquet(str(out / "findings")).collect()
    return {r["tx_id"]: r.asDict(recursive=True) for r in rows}


def read_all(settings: KafkaSettings, topic: str) -> list[tuple[int, bytes | None, bytes | None]]:
    """(partition, key, value) of every record of ``topic``."""
    consumer = Consumer(settings, client_id="test-reconcile")
    try:
        found = []
        for p in range(consumer.list_partitions(topic)):
            low, high = consumer.watermarks(topic, p)
            if high <= low:
                continue
            consumer.assign([(topic, p, low)])
            while True:
                batch = consumer.poll_batch(1000, 1.0)
                found += [(m.partition, m.key, m.value) for m in batch]
                pos = consumer.position([(topic, p)])[(topic, p)]
                if pos is not None and pos >= high:
                    break
        return found
    finally:
        consumer.close()


# ---------------------------------------------------------------- tests


def test_a_clean_log_gives_no_finding(
    spark: Any, settings: KafkaSettings, stores: Stores, tmp_path: Path, services: Services
) -> None:
    """Finished sagas only (commit, rollback, null compensation, a replayed decision,
    sequential) with agreeing ledgers in all three stores: zero findings, exit 0."""
    with Producer(settings) as producer:
        s = Seeder(settings, producer)
        clean = seed_clean(s)
        producer.flush(30)
    stores.write(s)
    result = audit(spark, settings, tmp_path, stores.ledger_specs())
    summary = result.summary
    assert summary["exit_code"] == 0, summary
    assert summary["transactions"] == len(clean)
    assert {k: v for k, v in summary["classes"].items() if v} == {"ok": len(clean)}
    assert all(v == 0 for v in summary["invariants"].values())
    assert {r["tx_id"] for r in findings(spark, tmp_path).values()} == clean
    assert all(r["class"] == "ok" for r in findings(spark, tmp_path).values())
    assert summary["replay"]["planned"] == 0
    assert [(x["participants"], x["entries"] > 0) for x in summary["ledgers"]] == [
        (["bank"], True),
        (["shop"], True),
        (["loyalty"], True),
    ]


def test_every_seeded_finding_is_found_and_nothing_else(
    spark: Any, settings: KafkaSettings, stores: Stores, tmp_path: Path, services: Services
) -> None:
    clean, expected = seed_every_class(settings, stores)
    result = audit(spark, settings, tmp_path, stores.ledger_specs())
    found = findings(spark, tmp_path)

    got = {
        tx: (r["class"], tuple(r["invariants"])) for tx, r in found.items() if r["class"] != "ok"
    }
    assert got == expected, json.dumps(
        {tx: found[tx]["reasons"] for tx in set(got) | set(expected) if tx in found}, indent=1
    )
    assert {tx for tx, r in found.items() if r["class"] == "ok"} == clean

    reasons = {tx: " | ".join(found[tx]["reasons"]) for tx in expected}
    assert "both commit and rollback" in reasons["v-double-decision"]
    assert "commit, but step(s) 1 failed" in reasons["v-commit-failed"]
    assert "applied after being compensated" in reasons["v-applied-after-rollback"]
    assert "after the deadline" in reasons["v-late"]
    assert "took effect in sql" in reasons["v-store-sql"]
    assert "took effect in redis" in reasons["v-store-redis"]
    assert "applied by shop, but its ledger has no effect" in reasons["v-log-mongo"]
    assert "took effect in sql" in reasons["v-ghost"]
    assert "valid saga.step" in reasons["v-dlq"]
    assert found["stuck-rollback"]["unfinished_steps"] == [0]
    assert found["stuck-commit"]["unfinished_steps"] == [1]

    summary = result.summary
    assert summary["exit_code"] == 1
    assert summary["invalid_records"] == {"requests": 1, "events": 2, "decisions": 1}
    assert summary["dlq"] == {
        "records": 4,
        "invalid": 1,
        "justified": 2,
        "violations": 1,
        "by_component": {"coordinator": 4},
    }
    # what the dry run would send: decisions first, requests after
    plan = [json.loads(line) for line in (tmp_path / "replay.jsonl").read_text().splitlines()]
    assert [(p["tx_id"], p["kind"], p["sent"]) for p in plan] == [
        ("stuck-commit", "decision", False),
        ("stuck-rollback", "decision", False),
        ("stuck-silent", "decision", False),
        ("stuck-no-decision", "request", False),
        ("stuck-silent", "request", False),
    ]


def test_replay_republishes_the_original_records(
    spark: Any, settings: KafkaSettings, tmp_path: Path
) -> None:
    """--replay re-sends the stuck sagas' original request/decision bytes, keyed and
    partitioned as the originals; nothing is sent for the others."""
    with Producer(settings) as producer:
        s = Seeder(settings, producer)
        seed_clean(s)
        s.request("stuck-no-decision", ("bank", "shop"))
        s.event("stuck-no-decision", 0, "applied")
        s.request("stuck-commit", ("bank", "shop"))
        s.event("stuck-commit", 0, "applied", confirm=True)
        s.event("stuck-commit", 1, "applied", confirm=True)
        s.decision("stuck-commit", "commit")
        producer.flush(30)
    t = settings.topics
    requests_before = read_all(settings, t.requests)
    decisions_before = read_all(settings, t.decisions)

    result = audit(spark, settings, tmp_path, [], replay=True)
    assert result.summary["replay"] == {
        "mode": "sent",
        "planned": 2,
        "decisions": 1,
        "requests": 1,
        "sent": 2,
    }
    new_requests = Counter(read_all(settings, t.requests)) - Counter(requests_before)
    new_decisions = Counter(read_all(settings, t.decisions)) - Counter(decisions_before)
    assert new_requests == Counter(r for r in requests_before if r[1] == b"stuck-no-decision")
    assert new_decisions == Counter(d for d in decisions_before if d[1] == b"stuck-commit")
    assert sum(new_requests.values()) == sum(new_decisions.values()) == 1


def test_business_checks_over_the_three_stores(
    spark: Any, settings: KafkaSettings, stores: Stores, tmp_path: Path, services: Services
) -> None:
    """Spark SQL over a PostgreSQL table, a MongoDB collection and Redis hash records:
    a check holds with no row or with ok true; it fails otherwise, and the run exits 1."""
    with stores.engine.begin() as conn:
        conn.execute(sa.text(f'CREATE TABLE "{stores.schema}".accounts (id text, balance int)'))
        conn.execute(
            sa.text(f"INSERT INTO \"{stores.schema}\".accounts VALUES ('a', 70), ('b', 80)")
        )
    stores.mongo["orders"].insert_many([{"_id": "o1", "qty": 2}, {"_id": "o2", "qty": 3.5}])
    import redis

    client = redis.Redis.from_url(stores.redis_url)
    client.hset(f"{stores.redis_prefix}:points:alice", mapping={"points": "10"})
    client.hset(f"{stores.redis_prefix}:points:bob", mapping={"points": "20"})
    client.close()
    with Producer(settings) as producer:
        seed_clean(Seeder(settings, producer))
        producer.flush(30)

    pg, mongo = services.postgres_url, services.mongo_url
    tables = (
        f"accounts=sql:{pg}#schema={stores.schema}",
        f"orders=mongo:{mongo}#database={stores.mongo.name}",
        f"points=redis:{stores.redis_url}#prefix={stores.redis_prefix}",
    )
    checks = (
        "money=SELECT sum(balance) = 150 AS ok, sum(balance) AS total FROM accounts",
        "no-negative=SELECT id FROM accounts WHERE balance < 0",
        "orders=SELECT count(*) = 2 AND sum(qty) = 5.5 AS ok FROM orders",
        "points=SELECT sum(CAST(points AS INT)) AS total, sum(CAST(points AS INT)) = 30 AS ok "
        "FROM points",
        "wrong=SELECT sum(balance) = 999 AS ok, sum(balance) AS total FROM accounts",
    )
    result = audit(spark, settings, tmp_path, [], tables=tables, checks=checks)
    verdicts = {c["name"]: c["holds"] for c in result.summary["checks"]}
    assert verdicts == {
        "money": True,
        "no-negative": True,
        "orders": True,
        "points": True,
        "wrong": False,
    }, result.summary["checks"]
    wrong = next(c for c in result.summary["checks"] if c["name"] == "wrong")
    assert wrong["rows"] == [{"ok": False, "total": 150}]
    assert result.summary["exit_code"] == 1
    assert result.summary["verdict"] == "check wrong fails"


def test_a_time_window_and_an_offset_range(
    spark: Any, settings: KafkaSettings, tmp_path: Path
) -> None:
    """--since judges only transactions whose request is in the window (one whose request
    came before is left out, not misjudged); --ending-offsets stops the read there."""
    t = settings.topics
    with Producer(settings) as producer:
        s = Seeder(settings, producer)
        s.request("before", ("bank",))
        s.event("before", 0, "applied")
        producer.flush(30)
    with Consumer(settings, client_id="test-ends") as reader:
        ends = {
            topic: {p: reader.watermarks(topic, p)[1] for p in range(PARTITIONS)}
            for topic in (t.requests, t.events, t.decisions)
        }
    time.sleep(1.5)  # record timestamps are the producer's clock
    since = time.time_ns() // 1_000_000
    time.sleep(0.5)
    with Producer(settings) as producer:
        s.producer = producer
        s.request("after", ("bank",))
        s.event("after", 0, "applied")
        s.decision("before", "rollback")
        s.event("before", 0, "compensated", OLD + 3_000)
        producer.flush(30)

    def judged(out: Path) -> dict[str, str]:
        return {tx: r["class"] for tx, r in findings(spark, out).items()}

    audit(spark, settings, tmp_path / "all", [])
    assert judged(tmp_path / "all") == {"before": "ok", "after": "stuck_no_decision"}
    audit(spark, settings, tmp_path / "window", [], since_ms=since)
    assert judged(tmp_path / "window") == {"after": "stuck_no_decision"}
    result = audit(spark, settings, tmp_path / "range", [], ending_offsets=ends)
    assert judged(tmp_path / "range") == {"before": "stuck_no_decision"}
    assert result.summary["records"]["total"] == 2
