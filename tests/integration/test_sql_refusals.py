"""What the database refuses belongs to one step (issue 31, item 2), on PostgreSQL and SQLite.

A trigger that raises for account 2 (``RAISE EXCEPTION`` on PostgreSQL, ``RAISE(ABORT)``
on SQLite), a custom handler whose statement the database refuses, and, on PostgreSQL,
a lock timeout: each fails its own step with the store's words while the other items of
the batch go on; a commit or a compensation the database refuses is run again, then
parked and reported ``compensation_failed``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from saga.participants._barrier import LedgerStatus
from saga.participants._handlers import Handler
from saga.participants._storage import Storage
from saga.participants.sql._adapter import SqlSession, SqlStorage
from saga.streams import Isolation, StepStatus
from tests.integration.test_sql_storage import (
    Database,
    SqlHarness,
    commit,
    postgres_database,
    requested,
    rollback,
    sql_harness,
    sqlite_database,
)

pytestmark = pytest.mark.integration


@pytest.fixture(params=["postgresql", "sqlite"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    made = postgres_database() if request.param == "postgresql" else sqlite_database(tmp_path)
    with made as db:
        yield db


@pytest.fixture
def postgres_db() -> Iterator[Database]:
    with postgres_database() as db:
        yield db


NONE = Isolation.NONE
FROZEN_CODE = {"postgresql": "P0001", "sqlite": "SQLITE_CONSTRAINT_TRIGGER"}
STORE = {"postgresql": "PostgreSQL", "sqlite": "SQLite"}


def dialect(db: Database) -> str:
    return db.engine.dialect.name


def freeze(db: Database) -> None:
    """Account 2 cannot change: a trigger raises ``account frozen``."""
    with db.engine.begin() as conn:
        if dialect(db) == "sqlite":
            conn.exec_driver_sql(
                "CREATE TRIGGER frozen_guard BEFORE UPDATE ON accounts WHEN old.id = 2 "
                "BEGIN SELECT RAISE(ABORT, 'account frozen'); END"
            )
            return
        conn.exec_driver_sql(
            f'CREATE FUNCTION "{db.schema}".frozen_guard() RETURNS trigger LANGUAGE plpgsql AS $$ '
            "BEGIN IF NEW.id = 2 THEN RAISE EXCEPTION 'account frozen'; END IF; "
            "RETURN NEW; END $$"
        )
        conn.exec_driver_sql(
            f'CREATE TRIGGER frozen_guard BEFORE UPDATE ON "{db.schema}".accounts '
            f'FOR EACH ROW EXECUTE FUNCTION "{db.schema}".frozen_guard()'
        )


def thaw(db: Database) -> None:
    with db.engine.begin() as conn:
        if dialect(db) == "sqlite":
            conn.exec_driver_sql("DROP TRIGGER frozen_guard")
        else:
            conn.exec_driver_sql(f'DROP TRIGGER frozen_guard ON "{db.schema}".accounts')


def bump(key: int, by: int) -> dict[str, Any]:
    return {"target": "accounts", "key": key, "field": "balance", "by": by}


def frozen(db: Database, what: str) -> str:
    return f"{STORE[dialect(db)]} refused {what}: account frozen ({FROZEN_CODE[dialect(db)]})"


def quick(storage: Storage) -> SqlStorage:
    """``storage``, running a refused item again without the production backoff."""
    assert isinstance(storage, SqlStorage)
    storage.refusal_backoff_s = 0.01
    return storage


def balance(harness: SqlHarness, key: int) -> int:
    record = harness.record("accounts", key)
    assert record is not None
    return int(record["balance"])


def test_a_triggers_exception_fails_its_step_alone(database: Database) -> None:
    with sql_harness(database) as harness:
        freeze(database)
        got = harness.storage.execute(
            [
                requested("tx-1", "increment", bump(1, 5), isolation=NONE),
                requested("tx-2", "increment", bump(2, 5), isolation=NONE),
                requested("tx-3", "increment", bump(1, 5), isolation=NONE),
            ]
        )
        assert [(r.tx_id, r.status) for r in got] == [
            ("tx-1", StepStatus.APPLIED),
            ("tx-2", StepStatus.FAILED),
            ("tx-3", StepStatus.APPLIED),
        ]
        assert got[1].reason == frozen(database, "the increment of accounts/2")
        assert (balance(harness, 1), balance(harness, 2)) == (110, 50)
        [entry] = harness.storage.ledger("tx-2")
        assert entry.status is LedgerStatus.FAILED


def test_a_refused_commit_is_parked_then_committed_by_a_later_decision(database: Database) -> None:
    with sql_harness(database) as harness:
        storage = quick(harness.storage)
        # read_committed: the reservation leaves the row alone; the commit writes it.
        assert [
            r.status for r in storage.execute([requested("tx-1", "increment", bump(2, 5))])
        ] == [StepStatus.APPLIED]
        freeze(database)
        [parked] = storage.execute([commit("tx-1")])
        assert parked.status is StepStatus.COMPENSATION_FAILED and parked.parked
        assert parked.reason == (
            "commit refused, left applied for a re-driven decision: "
            + frozen(database, "the commit of the increment of accounts/2")
        )
        [entry] = storage.ledger("tx-1")
        assert entry.status is LedgerStatus.APPLIED  # the reservation is kept
        assert balance(harness, 2) == 50
        thaw(database)
        [done] = storage.execute([commit("tx-1")])
        assert done.status is StepStatus.COMMITTED and not done.parked
        assert balance(harness, 2) == 55


def test_a_refused_compensation_is_parked_and_a_later_rollback_retries_it(
    database: Database,
) -> None:
    with sql_harness(database) as harness:
        storage = quick(harness.storage)
        storage.execute([requested("tx-1", "increment", bump(2, 5), isolation=NONE)])
        assert balance(harness, 2) == 55
        freeze(database)
        [parked] = storage.execute([rollback("tx-1")])
        assert parked.status is StepStatus.COMPENSATION_FAILED and parked.parked
        assert parked.reason == "compensation failed: " + frozen(
            database, "the compensation of the increment of accounts/2"
        )
        [entry] = storage.ledger("tx-1")
        assert entry.status is LedgerStatus.COMPENSATION_FAILED
        thaw(database)
        [done] = storage.execute([rollback("tx-1")])
        assert done.status is StepStatus.COMPENSATED
        assert balance(harness, 2) == 50


def _audit(session: SqlSession, args: Mapping[str, Any]) -> None:
    session.execute(sa.text("INSERT INTO saga_no_such_table VALUES (1)"))


def _nothing(session: SqlSession, args: Mapping[str, Any], before: Any) -> None:
    return None


def test_a_driver_error_in_a_custom_handler_fails_its_step(database: Database) -> None:
    with sql_harness(database) as harness:
        storage = harness.make(handlers={"audit": Handler(_audit, _nothing)})
        got = storage.execute(
            [
                requested("tx-1", "audit", {}),
                requested("tx-2", "increment", bump(1, 5), isolation=NONE),
            ]
        )
        assert [(r.tx_id, r.status) for r in got] == [
            ("tx-1", StepStatus.FAILED),
            ("tx-2", StepStatus.APPLIED),
        ]
        code = "42P01" if dialect(database) == "postgresql" else "SQLITE_ERROR"
        assert got[0].reason is not None
        assert got[0].reason.startswith(f"{STORE[dialect(database)]} refused the audit step: ")
        assert got[0].reason.endswith(f"({code})")
        assert balance(harness, 1) == 105


def test_a_lock_timeout_fails_its_step_after_its_runs(postgres_db: Database) -> None:
    with sql_harness(postgres_db) as harness:
        url = f"{postgres_db.url}?options=-c%20lock_timeout%3D200"
        storage = quick(harness.make(url=url))
        with postgres_db.engine.connect() as other, other.begin():
            table = postgres_db.tables["accounts"]
            other.execute(sa.select(table).where(table.c.id == 2).with_for_update())
            got = storage.execute(
                [
                    requested("tx-1", "increment", bump(2, 5)),
                    requested("tx-2", "increment", bump(1, 5)),
                ]
            )
        assert [(r.tx_id, r.status) for r in got] == [
            ("tx-1", StepStatus.FAILED),
            ("tx-2", StepStatus.APPLIED),
        ]
        assert got[0].reason == (
            "PostgreSQL timed out on the increment of accounts/2: "
            "canceling statement due to lock timeout (55P03)"
        )
