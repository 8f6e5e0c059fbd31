"""Isolation on the SQL storage (PostgreSQL, SQLite and MariaDB), through its real API.

``read_committed`` (docs/architecture.md §9): a row changes only when its saga's commit
is applied, so a plain ``SELECT`` sees committed values only; increments reserve, other
actions hold (a step on another saga's held record fails naming the holder); holds live
in ``<ledger>_holds``, changed with the ledger. ``none`` writes at once, and its
compensation refuses (``compensation_failed``) to overwrite another's work or cross a bound.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from saga.participants._barrier import LedgerStatus
from saga.participants._handlers import Handler
from saga.participants._storage import Storage, WorkItem
from saga.participants.sql._adapter import SqlStorage
from saga.participants.sql._ledger import BatchLedger
from saga.streams import Isolation, Mode, StepStatus, TransientError
from tests.integration._mariadb import mariadb_database
from tests.integration.test_sql_storage import (
    Database,
    SqlHarness,
    commit,
    only_status,
    postgres_database,
    requested,
    rollback,
    sql_harness,
    sqlite_database,
)

pytestmark = pytest.mark.integration

NONE = Isolation.NONE
APPLIED, FAILED = StepStatus.APPLIED, StepStatus.FAILED
COMMITTED, COMPENSATED = StepStatus.COMMITTED, StepStatus.COMPENSATED
COMPENSATION_FAILED = StepStatus.COMPENSATION_FAILED


@pytest.fixture(params=["postgresql", "sqlite", "mariadb"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "mariadb":
        made = mariadb_database()
    else:
        made = postgres_database() if request.param == "postgresql" else sqlite_database(tmp_path)
    with made as db:
        yield db


@pytest.fixture(params=["batch", "careful"])
def harness(request: pytest.FixtureRequest, database: Database) -> Iterator[SqlHarness]:
    """The demo's rows plus accounts/3 (0) and accounts/5 (5). ``careful``: the storage has
    a custom handler, so every batch runs each step in a savepoint and statement by
    statement (the holds too); ``batch``: built-in steps only, the batch's copy of the
    rows and holds (:mod:`participants.sql._holds`)."""
    with sql_harness(database) as made:
        made.seed("accounts", 3, {"owner": "xavier", "balance": 0})
        made.seed("accounts", 5, {"owner": "kim", "balance": 5})
        if request.param == "batch":
            yield made
            return
        noop = Handler(lambda session, args: None, lambda session, args, before: None)
        storage = made.make(handlers={"noop": noop})
        storage.setup()
        yield replace(made, storage=storage)


def bump(key: Any, by: Any, **bounds: Any) -> dict[str, Any]:
    return {"target": "accounts", "key": key, "field": "balance", "by": by, **bounds}


def setting(key: Any, **fields: Any) -> dict[str, Any]:
    return {"target": "accounts", "key": key, "set": fields}


def statuses(reports: list[Any]) -> list[tuple[str, StepStatus]]:
    return [(r.tx_id, r.status) for r in reports]


def balance(db: Database, key: int) -> Any:
    """What any reader outside the product sees: ``SELECT balance FROM accounts``."""
    table = f"{db.schema}.accounts" if db.schema else "accounts"
    query = sa.text(f"SELECT balance FROM {table} WHERE id = :key")
    with db.engine.connect() as connection:
        return connection.execute(query, {"key": key}).scalar_one_or_none()


def holds(db: Database) -> list[tuple[Any, ...]]:
    """The holds table's rows: (target, record, field, tx_id, step, kind), bounds left out."""
    table = sa.Table("saga_ledger_holds", sa.MetaData(schema=db.schema), autoload_with=db.engine)
    c = table.c
    query = (
        sa.select(c.target, c.record, c.field, c.tx_id, c.step, c.kind)
        .where(c.kind != "bounds")
        .order_by(c.tx_id, c.step)
    )
    with db.engine.connect() as connection:
        return [tuple(row) for row in connection.execute(query)]


# ---------------------------------------------------------------- the three anomalies


def test_no_dirty_read(harness: SqlHarness) -> None:
    """T1 credits accounts/3 by 100 and is not decided: a plain SELECT reads 0 until the
    commit is applied, then 100."""
    db, storage = harness.db, harness.storage
    got = storage.execute([requested("T1", "increment", bump(3, 100), n_steps=2)])
    assert statuses(got) == [("T1", APPLIED)] and got[0].confirm
    assert balance(db, 3) == 0
    assert holds(db) == [("accounts", "3", "balance", "T1", 0, "reserve")]
    assert statuses(storage.execute([commit("T1")])) == [("T1", COMMITTED)]
    assert balance(db, 3) == 100
    assert holds(db) == []


def test_no_dirty_spend_and_no_broken_bound(harness: SqlHarness) -> None:
    """T1 credits accounts/3 +100 (open); T2's debit of 100 with min 0 fails (escrow counts
    only the committed value and the reservations that lower it); T1 rolls back:
    nothing changed."""
    db, storage = harness.db, harness.storage
    assert statuses(storage.execute([requested("T1", "increment", bump(3, 100))])) == [
        ("T1", APPLIED)
    ]
    [spent] = storage.execute([requested("T2", "increment", bump(3, -100, min=0))])
    assert (spent.status, spent.reason) == (
        FAILED,
        "accounts/3 balance would be -100, below the minimum 0",
    )
    assert statuses(storage.execute([rollback("T1")])) == [("T1", COMPENSATED)]
    assert balance(db, 3) == 0
    assert holds(db) == []


def test_no_lost_update(harness: SqlHarness) -> None:
    """T3 updates accounts/5 5 -> 7 (open); T4's update fails naming T3; T3 rolls back:
    5; T4 submitted again then applies and commits: 9."""
    db, storage = harness.db, harness.storage
    storage.execute([requested("T3", "update", setting(5, balance=7))])
    [lost] = storage.execute([requested("T4", "update", setting(5, balance=9))])
    assert (lost.status, lost.reason) == (
        FAILED,
        "accounts/5 is held by saga T3 (step 0) until its decision; retry after it",
    )
    assert balance(db, 5) == 5
    storage.execute([rollback("T3")])
    assert balance(db, 5) == 5
    again = storage.execute([requested("T4-again", "update", setting(5, balance=9))])
    assert statuses(again) == [("T4-again", APPLIED)]
    assert balance(db, 5) == 5
    storage.execute([commit("T4-again")])
    assert balance(db, 5) == 9


# ---------------------------------------------------------------- holds of each action


def test_insert_put_and_delete_hold_their_records(harness: SqlHarness) -> None:
    """Each holds its record from apply to decision: the row shows the committed value
    throughout, another saga's step on it fails naming the holder, the commit writes."""
    db, storage = harness.db, harness.storage
    new = {"target": "accounts", "key": 7, "value": {"owner": "gina", "balance": 3}}
    over = {"target": "accounts", "key": 1, "value": {"owner": "al", "balance": 1}}
    gone = {"target": "accounts", "key": 2}
    got = storage.execute(
        [
            requested("T1", "insert", new),
            requested("T2", "put", over),
            requested("T3", "delete", gone),
        ]
    )
    assert statuses(got) == [("T1", APPLIED), ("T2", APPLIED), ("T3", APPLIED)]
    assert harness.record("accounts", 7) is None
    assert (harness.record("accounts", 1) or {})["owner"] == "alice"
    assert harness.record("accounts", 2) is not None
    blocked = storage.execute(
        [
            requested("T4", "insert", new),
            requested("T5", "put", {"target": "accounts", "key": 7, "value": {"owner": "x"}}),
            requested("T6", "increment", bump(1, 1)),
            requested("T7", "update", setting(2, owner="y"), isolation=NONE),
        ]
    )
    assert [(r.tx_id, r.status, r.reason) for r in blocked] == [
        (tx, FAILED, f"accounts/{key} is held by saga {holder} (step 0) until its decision; {end}")
        for tx, key, holder, end in (
            ("T4", 7, "T1", "retry after it"),
            ("T5", 7, "T1", "retry after it"),
            ("T6", 1, "T2", "retry after it"),
            ("T7", 2, "T3", "retry after it"),
        )
    ]
    assert statuses(storage.execute([commit("T1"), commit("T2"), rollback("T3")])) == [
        ("T1", COMMITTED),
        ("T2", COMMITTED),
        ("T3", COMPENSATED),
    ]
    assert harness.record("accounts", 7) == {"owner": "gina", "balance": 3, "credit": None}
    assert (harness.record("accounts", 1) or {})["owner"] == "al"
    assert harness.record("accounts", 2) is not None  # the delete rolled back
    storage.execute([requested("T8", "delete", gone)])
    assert harness.record("accounts", 2) is not None
    storage.execute([commit("T8")])
    assert harness.record("accounts", 2) is None
    assert holds(db) == []


def test_a_step_the_database_would_refuse_fails_at_apply(harness: SqlHarness) -> None:
    """What the commit could not write fails the step at apply: a NOT NULL column left
    out (tried in a savepoint, rolled back at once), a value the integer column cannot
    hold once the open reservations commit (32 bits on PostgreSQL, 64 on SQLite)."""
    db, storage = harness.db, harness.storage
    postgresql = db.schema is not None
    got = storage.execute(
        [
            requested("T1", "insert", {"target": "accounts", "key": 9, "value": {"balance": 1}}),
            requested("T2", "increment", bump(3, 2**62)),
            requested("T3", "increment", bump(3, 2**62)),
        ]
    )
    assert statuses(got) == [
        ("T1", FAILED),
        ("T2", FAILED if postgresql else APPLIED),
        ("T3", FAILED),
    ]
    assert got[0].reason and got[0].reason.startswith("insert was refused by the database")
    assert got[2].reason and got[2].reason.endswith(
        "does not fit column accounts.balance (INTEGER)"
    )
    assert harness.record("accounts", 9) is None
    assert len(holds(db)) == (0 if postgresql else 1)


def test_steps_of_one_saga_on_one_record_are_compatible(harness: SqlHarness) -> None:
    """One saga inserts a record, increments it twice and updates it: each step sees the
    saga's own earlier steps; the commit writes them in step order; another saga is
    refused meanwhile."""
    storage = harness.storage
    steps = [
        ("insert", {"target": "accounts", "key": 8, "value": {"owner": "hal", "balance": 10}}),
        ("increment", bump(8, 5)),
        ("increment", bump(8, -15, min=0)),
        ("update", setting(8, owner="hal2")),
    ]
    items: list[WorkItem] = [
        requested("T1", action, args, step=i, n_steps=len(steps))
        for i, (action, args) in enumerate(steps)
    ]
    assert {r.status for r in storage.execute(items)} == {APPLIED}
    [other] = storage.execute([requested("T2", "increment", bump(8, 1))])
    assert (
        other.reason == "accounts/8 is held by saga T1 (step 0) until its decision; retry after it"
    )
    assert harness.record("accounts", 8) is None
    assert only_status(storage.execute([commit("T1")])) == [
        ("T1", i, COMMITTED) for i in range(len(steps))
    ]
    assert harness.record("accounts", 8) == {"owner": "hal2", "balance": 0, "credit": None}


# ---------------------------------------------------------------- escrow on a hot row


def test_reservations_of_sagas_on_one_row_never_conflict(harness: SqlHarness) -> None:
    """Two sagas debit accounts/1 (100) by 30 each: both reserve; a third debit of 50
    would leave -10 once they commit and fails; both commit: 40."""
    db, storage = harness.db, harness.storage
    got = storage.execute(
        [
            requested("T1", "increment", bump(1, -30, min=0)),
            requested("T2", "increment", bump(1, -30, min=0)),
        ]
    )
    assert statuses(got) == [("T1", APPLIED), ("T2", APPLIED)]
    [third] = storage.execute([requested("T3", "increment", bump(1, -50, min=0))])
    assert third.reason == (
        "accounts/1 balance would be -10 (counting open reservations), below the minimum 0"
    )
    assert statuses(storage.execute([commit("T2")])) == [("T2", COMMITTED)]
    assert statuses(storage.execute([commit("T1")])) == [("T1", COMMITTED)]
    assert balance(db, 1) == 40


def test_parallel_workers_on_one_hot_row_keep_the_bound(harness: SqlHarness) -> None:
    """Two workers (their own connections) reserve debits of 5 from accounts/1 (100, min
    0) at once, 30 sagas in all: exactly 20 apply, whoever wins each race, and their
    commits leave 0."""
    db = harness.db
    workers = [harness.make(), harness.make()]
    reports: list[Any] = []
    lock = threading.Lock()

    def work(storage: Storage, offset: int) -> None:
        for batch in range(5):
            items: list[WorkItem] = [
                requested(f"W{offset}-{batch}-{i}", "increment", bump(1, -5, min=0))
                for i in range(3)
            ]
            deadline = time.monotonic() + 30
            while True:
                try:
                    got = storage.execute(items)
                    break
                except TransientError:  # SQLite's one writer: try again
                    assert time.monotonic() < deadline
            with lock:
                reports.extend(got)

    threads = [threading.Thread(target=work, args=(w, n)) for n, w in enumerate(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    applied = [r.tx_id for r in reports if r.status is APPLIED]
    assert len(reports) == 30 and len(applied) == 20
    assert balance(db, 1) == 100
    done = workers[0].execute([commit(tx) for tx in applied])
    assert {r.status for r in done} == {COMMITTED} and len(done) == 20
    assert balance(db, 1) == 0
    assert holds(db) == []


def test_two_workers_inserting_one_key_hold_it_once(database: Database) -> None:
    """Two workers (one on the batch path, one careful) insert the same absent key at the
    same moment: the record lock lets exactly one hold it, the other fails naming it."""
    noop = Handler(lambda session, args: None, lambda session, args, before: None)
    with sql_harness(database) as harness:
        workers = [harness.make(), harness.make(handlers={"noop": noop})]
        for worker in workers:
            worker.setup()
        for attempt in range(6):
            key = 100 + attempt
            start = threading.Barrier(2)
            reports: list[Any] = []

            def work(
                storage: Storage, n: int, key: int = key, start: Any = start, reports: Any = reports
            ) -> None:
                value = {"owner": f"w{n}", "balance": n}
                step = requested(
                    f"I{key}-{n}", "insert", {"target": "accounts", "key": key, "value": value}
                )
                start.wait()
                deadline = time.monotonic() + 30
                while True:
                    try:
                        reports.extend(storage.execute([step]))
                        return
                    except TransientError:  # SQLite's one writer: try again
                        assert time.monotonic() < deadline

            threads = [threading.Thread(target=work, args=(w, n)) for n, w in enumerate(workers)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
            assert sorted(r.status for r in reports) == [APPLIED, FAILED]
            [lost] = [r for r in reports if r.status is FAILED]
            assert lost.reason and lost.reason.startswith(f"accounts/{key} is held by saga I{key}-")
            assert harness.record("accounts", key) is None


# ---------------------------------------------------------------- decisions, crashes, retention


def test_commit_and_release_are_idempotent(harness: SqlHarness) -> None:
    """A repeated decision re-reports and changes nothing; a rollback after the commit
    (never sent, but replayed logs are hostile) leaves the committed value."""
    db, storage = harness.db, harness.storage
    storage.execute(
        [requested("T1", "increment", bump(3, 7)), requested("T2", "increment", bump(3, 5))]
    )
    assert statuses(storage.execute([commit("T1"), commit("T1")])) == [
        ("T1", COMMITTED),
        ("T1", COMMITTED),
    ]
    assert statuses(storage.execute([rollback("T2"), rollback("T2")])) == [
        ("T2", COMPENSATED),
        ("T2", COMPENSATED),
    ]
    assert statuses(storage.execute([rollback("T1"), commit("T2")])) == [("T2", COMPENSATED)]
    storage.execute([commit("T1")])
    assert balance(db, 3) == 7
    assert holds(db) == []


def test_holds_survive_a_retried_batch_and_a_restart(
    harness: SqlHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch that dies before its commit leaves neither the ledger entry nor the hold;
    one run again with savepoints (a neighbour the database refuses) records the hold
    once; a storage opened afresh (a restarted participant) finds it and commits it."""
    db, storage = harness.db, harness.storage
    reserve = requested("T1", "increment", bump(3, 10))
    flush = BatchLedger.flush

    def crash(self: BatchLedger) -> None:
        raise RuntimeError("killed before the commit")

    monkeypatch.setattr(BatchLedger, "flush", crash)
    with pytest.raises(RuntimeError):
        storage.execute([reserve])
    monkeypatch.setattr(BatchLedger, "flush", flush)
    assert storage.ledger() == [] and holds(db) == []

    refused = {"target": "accounts", "key": 9, "value": {"balance": 1}}  # owner missing
    got = storage.execute([reserve, requested("T2", "insert", refused, isolation=NONE)])
    assert statuses(got) == [("T1", APPLIED), ("T2", FAILED)]
    assert holds(db) == [("accounts", "3", "balance", "T1", 0, "reserve")]
    storage.close()

    restarted = harness.make()
    assert statuses(restarted.execute([reserve])) == [("T1", APPLIED)]  # re-reported
    assert holds(db) == [("accounts", "3", "balance", "T1", 0, "reserve")]
    assert statuses(restarted.execute([commit("T1")])) == [("T1", COMMITTED)]
    assert balance(db, 3) == 10


def test_pruning_the_ledger_never_drops_a_hold(harness: SqlHarness) -> None:
    """An applied, undecided ``read_committed`` step is not finished: pruning keeps its
    entry and never touches the holds table; once committed, the entry goes in time."""
    db, storage = harness.db, harness.storage
    storage.execute([requested("T1", "update", setting(5, balance=6))])
    assert storage.prune(horizon_ms=2**62, limit=100) == 0
    assert holds(db) == [("accounts", "5", "", "T1", 0, "hold")]
    storage.execute([commit("T1")])
    assert storage.prune(horizon_ms=2**62, limit=100) == 1
    assert holds(db) == [] and balance(db, 5) == 6


def test_an_older_ledger_gets_its_holds_table(database: Database) -> None:
    """A ledger made before isolation (no holds table) is upgraded in place by setup."""
    with sql_harness(database) as harness:
        storage = harness.storage
        assert isinstance(storage, SqlStorage)
        with database.engine.begin() as connection:
            storage.holds_table.drop(connection)
        again = harness.make()
        again.setup()
        assert statuses(again.execute([requested("T1", "increment", bump(1, 1))])) == [
            ("T1", APPLIED)
        ]
        assert holds(database) == [("accounts", "1", "balance", "T1", 0, "reserve")]


def test_a_read_committed_batch_costs_the_same_statements_whatever_its_size(
    database: Database,
) -> None:
    """Reservations and their commits, five or fifty: the same number of statements
    (built-in steps only: the batch's copy of the rows and their holds)."""
    with sql_harness(database) as harness:
        _same_statements(harness)


def _same_statements(harness: SqlHarness) -> None:
    storage = harness.storage
    assert isinstance(storage, SqlStorage)
    for key in range(10, 20):
        harness.seed("accounts", key, {"owner": f"o{key}", "balance": 0})
    sent: list[str] = []
    sa.event.listen(storage._engine, "before_cursor_execute", lambda *a: sent.append(a[2]))

    def run(prefix: str, n: int) -> tuple[int, int]:
        sent.clear()
        items: list[WorkItem] = [
            requested(f"{prefix}-{i}", "increment", bump(10 + i % 10, 1, min=0)) for i in range(n)
        ]
        assert {r.status for r in storage.execute(items)} == {APPLIED}
        applying = len(sent)
        sent.clear()
        done = storage.execute([commit(f"{prefix}-{i}") for i in range(n)])
        assert {r.status for r in done} == {COMMITTED}
        return applying, len(sent)

    small, large = run("small", 5), run("large", 50)
    assert small == large, f"{small} statements for 5 steps, {large} for 50"
    assert harness.record("accounts", 10) == {"owner": "o10", "balance": 6, "credit": None}


# ---------------------------------------------------------------- none: never silently


def test_none_lost_update_ends_compensation_failed(harness: SqlHarness) -> None:
    """T3 updates accounts/5 5 -> 7 and T4 -> 9 (both ``none``, T4 is not refused); T3's
    rollback would restore 5 over T4's 9: it fails naming the record, and 9 stays."""
    db, storage = harness.db, harness.storage
    storage.execute([requested("T3", "update", setting(5, balance=7), isolation=NONE)])
    assert balance(db, 5) == 7
    got = storage.execute([requested("T4", "update", setting(5, balance=9), isolation=NONE)])
    assert statuses(got) == [("T4", APPLIED)]
    storage.execute([commit("T4")])
    [undo] = storage.execute([rollback("T3")])
    assert (undo.status, undo.reason) == (
        COMPENSATION_FAILED,
        "compensation failed: accounts/5 changed since this step wrote it: balance is 9, "
        "not 7; not restored",
    )
    assert balance(db, 5) == 9
    [entry] = storage.ledger("T3")
    assert entry.status is LedgerStatus.COMPENSATION_FAILED


def test_none_compensation_keeps_a_bound_a_step_relied_on(harness: SqlHarness) -> None:
    """T1 credits accounts/3 +100 and T2 debits 100 with min 0 (both ``none``, T2 spends
    T1's money); T1's rollback would leave -100: it fails naming the record, 0 stays."""
    db, storage = harness.db, harness.storage
    storage.execute([requested("T1", "increment", bump(3, 100), isolation=NONE)])
    got = storage.execute([requested("T2", "increment", bump(3, -100, min=0), isolation=NONE)])
    assert statuses(got) == [("T2", APPLIED)]
    [undo] = storage.execute([rollback("T1")])
    assert (undo.status, undo.reason) == (
        COMPENSATION_FAILED,
        "compensation failed: accounts/3 balance would be -100 after undoing this step, "
        "below the minimum 0 that a bounded increment relied on; not restored",
    )
    assert balance(db, 3) == 0


def test_none_steps_respect_read_committed_holds(harness: SqlHarness) -> None:
    """A ``none`` debit counts the open reservations of ``read_committed`` sagas, and a
    ``none`` write to a held record fails naming the holder: a committed read_committed
    saga's guarantees do not depend on the level of the others."""
    storage = harness.storage
    storage.execute([requested("T1", "increment", bump(1, -80, min=0))])
    storage.execute([requested("T2", "update", setting(5, owner="z"))])
    got = storage.execute(
        [
            requested("T3", "increment", bump(1, -30, min=0), isolation=NONE),
            requested("T4", "increment", bump(5, 1), isolation=NONE),
        ]
    )
    assert [(r.status, r.reason) for r in got] == [
        (
            FAILED,
            "accounts/1 balance would be -10 (counting open reservations), below the minimum 0",
        ),
        (FAILED, "accounts/5 is held by saga T2 (step 0) until its decision; retry after it"),
    ]


def test_sequential_read_committed_saga(harness: SqlHarness) -> None:
    """A sequential saga's steps reserve in turn and commit together."""
    db, storage = harness.db, harness.storage
    first = requested("T1", "increment", bump(1, -10, min=0), mode=Mode.SEQUENTIAL, n_steps=2)
    second = requested(
        "T1",
        "increment",
        bump(3, 10),
        step=1,
        mode=Mode.SEQUENTIAL,
        n_steps=2,
        predecessor_applied=True,
    )
    assert only_status(storage.execute([first, second])) == [("T1", 0, APPLIED), ("T1", 1, APPLIED)]
    assert (balance(db, 1), balance(db, 3)) == (100, 0)
    storage.execute([commit("T1")])
    assert (balance(db, 1), balance(db, 3)) == (90, 10)


def test_a_padded_key_names_one_record(tmp_path: Path) -> None:
    """``char(4)``: ``"ab"`` and ``"ab  "`` are one row to PostgreSQL, so one record to the
    holds: an update held under one spelling refuses a step under the other."""
    with postgres_database() as db:
        metadata = sa.MetaData(schema=db.schema)
        codes = sa.Table(
            "codes",
            metadata,
            sa.Column("code", sa.CHAR(4), primary_key=True),
            sa.Column("n", sa.BigInteger),
        )
        metadata.create_all(db.engine)
        with db.engine.begin() as connection:
            connection.execute(sa.insert(codes).values(code="ab", n=1))
        with sql_harness(db) as harness:
            storage = harness.make(targets=("codes",))
            more = {"target": "codes", "key": "ab", "field": "n", "by": 2}
            held = {"target": "codes", "key": "ab  ", "set": {"n": 7}}
            got = storage.execute(
                [requested("T1", "increment", more), requested("T2", "update", held)]
            )
            assert [(r.status, r.reason) for r in got] == [
                (APPLIED, None),
                (
                    FAILED,
                    "codes/ab   is held by saga T1 (step 0) until its decision; retry after it",
                ),
            ]
            storage.execute([commit("T1")])
        with db.engine.connect() as connection:
            assert connection.execute(sa.select(codes.c.n)).scalar_one() == 3
