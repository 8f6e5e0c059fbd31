"""What a store says about one step belongs to that step (issue 31, item 2).

The classification tables of every adapter (PostgreSQL by SQLSTATE, SQLite by error
name, MySQL by error number, Redis, MongoDB), and the storage base class's policy on a
refusal: a step the store refuses fails at once, one that timed out is run again a
bounded number of times and then fails, and a decision the store refuses is run again
and then parked and reported, all without stopping the batch.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import psycopg
import pymysql
import pytest
import sqlalchemy as sa
from pymongo import errors as mongo_errors
from redis import exceptions as redis_errors
from sqlalchemy import exc as sa_exc

from saga import participants
from saga.participants._refusals import StoreRefused, Verdict, step_name
from saga.participants.mongo import _errors as mongo
from saga.participants.redis import _errors as redis
from saga.participants.sql import _errors as sql
from saga.streams import Mode, Outcome, StepStatus, TransientError

# ---------------------------------------------------------------- PostgreSQL, by SQLSTATE


def pg_error(sqlstate: str, message: str = "boom") -> sa_exc.DBAPIError:
    """psycopg's exception for ``sqlstate``, as SQLAlchemy hands it over."""
    orig = psycopg.errors.lookup(sqlstate)(message)
    wrapped = sa_exc.DBAPIError.instance("SELECT 1", None, orig, psycopg.Error)
    assert isinstance(wrapped, sa_exc.DBAPIError)
    return wrapped


@pytest.mark.parametrize(
    ("sqlstate", "expected"),
    [
        ("P0001", Verdict.REFUSED),  # a trigger's RAISE EXCEPTION
        ("P0004", Verdict.REFUSED),  # a failed ASSERT
        ("23505", Verdict.REFUSED),  # unique violation
        ("23514", Verdict.REFUSED),  # check violation
        ("22003", Verdict.REFUSED),  # numeric value out of range
        ("22P02", Verdict.REFUSED),  # invalid text representation
        ("42P01", Verdict.REFUSED),  # undefined table
        ("42601", Verdict.REFUSED),  # syntax error
        ("42501", Verdict.REFUSED),  # insufficient privilege
        ("57014", Verdict.TIMEOUT),  # query canceled: statement_timeout
        ("55P03", Verdict.TIMEOUT),  # lock not available: lock_timeout
        ("40001", Verdict.TRANSIENT),  # serialization failure
        ("40P01", Verdict.TRANSIENT),  # deadlock detected
        ("08006", Verdict.TRANSIENT),  # connection failure
        ("53300", Verdict.TRANSIENT),  # too many connections
        ("53100", Verdict.TRANSIENT),  # disk full
        ("57P01", Verdict.TRANSIENT),  # admin shutdown
        ("25006", Verdict.TRANSIENT),  # read-only transaction (a standby)
        ("XX000", Verdict.TRANSIENT),  # internal error
        ("28P01", Verdict.CONFIGURATION),  # invalid password
    ],
)
def test_postgresql_errors_by_sqlstate(sqlstate: str, expected: Verdict) -> None:
    assert sql.verdict(pg_error(sqlstate)) is expected


def test_a_raised_exception_is_the_steps_refusal_in_the_stores_words() -> None:
    refused = sql.step_refusal(
        pg_error("P0001", "account frozen\nCONTEXT: PL/pgSQL function freeze() line 3"),
        step_name("increment", {"target": "accounts", "key": "frozen"}),
    )
    assert isinstance(refused, StoreRefused) and not refused.timeout
    assert refused.reason == (
        "PostgreSQL refused the increment of accounts/frozen: account frozen (P0001)"
    )


def test_a_timeout_is_the_steps_after_its_retries() -> None:
    refused = sql.step_refusal(
        pg_error("57014", "canceling statement due to statement timeout"), "the slow step"
    )
    assert isinstance(refused, StoreRefused) and refused.timeout
    assert refused.reason == (
        "PostgreSQL timed out on the slow step: "
        "canceling statement due to statement timeout (57014)"
    )


def test_transient_errors_are_not_the_steps() -> None:
    assert sql.step_refusal(pg_error("40P01"), "x") is None
    assert sql.step_refusal(pg_error("08006"), "x") is None


def test_a_lost_connection_is_transient_whatever_its_code() -> None:
    lost = pg_error("P0001")
    lost.connection_invalidated = True
    assert sql.verdict(lost) is Verdict.TRANSIENT
    assert sql.verdict(sa_exc.DisconnectionError("gone")) is Verdict.TRANSIENT


def test_only_a_statement_wrong_for_the_schema_is_a_configuration_error_at_the_boundary() -> None:
    assert sql.is_schema_error(pg_error("42P01"))
    assert sql.is_schema_error(pg_error("42501"))
    # psycopg raises a RAISE EXCEPTION as a ProgrammingError too: it is not one.
    assert not sql.is_schema_error(pg_error("P0001"))
    assert not sql.is_schema_error(pg_error("23505"))


def test_a_failed_login_without_a_code_is_configuration_and_a_lost_one_transient() -> None:
    auth = psycopg.OperationalError('FATAL:  password authentication failed for user "x"')
    assert sql.verdict(sa_exc.OperationalError("", None, auth)) is Verdict.CONFIGURATION
    down = psycopg.OperationalError("connection refused")
    assert sql.verdict(sa_exc.OperationalError("", None, down)) is Verdict.TRANSIENT


# ---------------------------------------------------------------- SQLite, by error name


@contextmanager
def sqlite_db(tmp_path: Path) -> Iterator[sa.Engine]:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE accounts (id TEXT PRIMARY KEY, balance INTEGER)")
        conn.exec_driver_sql("INSERT INTO accounts VALUES ('frozen', 1), ('alice', 1)")
        conn.exec_driver_sql(
            "CREATE TRIGGER freeze BEFORE UPDATE ON accounts WHEN old.id = 'frozen' "
            "BEGIN SELECT RAISE(ABORT, 'account frozen'); END"
        )
    try:
        yield engine
    finally:
        engine.dispose()


def sqlite_error(engine: sa.Engine, statement: str) -> sa_exc.DBAPIError:
    with pytest.raises(sa_exc.DBAPIError) as info, engine.begin() as conn:
        conn.exec_driver_sql(statement)
    return info.value


def test_sqlite_errors_by_name(tmp_path: Path) -> None:
    with sqlite_db(tmp_path) as engine:
        raised = sqlite_error(engine, "UPDATE accounts SET balance = 2 WHERE id = 'frozen'")
        assert sql.error_code(raised) == "SQLITE_CONSTRAINT_TRIGGER"
        assert sql.verdict(raised) is Verdict.REFUSED
        refused = sql.step_refusal(raised, "the update of accounts/frozen")
        assert refused is not None and refused.reason == (
            "SQLite refused the update of accounts/frozen: account frozen "
            "(SQLITE_CONSTRAINT_TRIGGER)"
        )
        duplicate = sqlite_error(engine, "INSERT INTO accounts VALUES ('alice', 1)")
        assert sql.verdict(duplicate) is Verdict.REFUSED
        missing = sqlite_error(engine, "SELECT * FROM no_such_table")
        assert sql.verdict(missing) is Verdict.REFUSED
        assert sql.is_schema_error(missing) and not sql.is_schema_error(raised)
        # Another connection holds the write lock past the busy timeout: transient.
        holder = sqlite3.connect(tmp_path / "db.sqlite", isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            busy = sa.create_engine(
                f"sqlite:///{tmp_path / 'db.sqlite'}", connect_args={"timeout": 0.05}
            )
            locked = sqlite_error(busy, "UPDATE accounts SET balance = 3 WHERE id = 'alice'")
            busy.dispose()
        finally:
            holder.rollback()
            holder.close()
        assert (sql.error_code(locked) or "").startswith("SQLITE_BUSY")
        assert sql.verdict(locked) is Verdict.TRANSIENT


# ---------------------------------------------------------------- MySQL, by error number


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (pymysql.err.OperationalError(1205, "Lock wait timeout exceeded"), Verdict.TIMEOUT),
        (pymysql.err.OperationalError(3024, "maximum statement time exceeded"), Verdict.TIMEOUT),
        (pymysql.err.OperationalError(1644, "account frozen"), Verdict.REFUSED),  # SIGNAL
        (pymysql.err.IntegrityError(1062, "Duplicate entry"), Verdict.REFUSED),
        (pymysql.err.OperationalError(1213, "Deadlock found"), Verdict.TRANSIENT),
        (pymysql.err.OperationalError(2003, "Can't connect"), Verdict.TRANSIENT),
        (pymysql.err.OperationalError(1045, "Access denied"), Verdict.CONFIGURATION),
    ],
)
def test_mysql_errors_by_number(error: Exception, expected: Verdict) -> None:
    wrapped = sa_exc.DBAPIError.instance("SELECT 1", None, error, pymysql.err.Error)
    assert sql.verdict(wrapped) is expected
    assert sql.store_name(wrapped) == "MySQL"


# ---------------------------------------------------------------- Redis


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (
            redis_errors.ResponseError(
                "WRONGTYPE Operation against a key holding the wrong kind of value"
            ),
            Verdict.REFUSED,
        ),
        (redis_errors.ResponseError("ERR wrong number of arguments for 'hset'"), Verdict.REFUSED),
        (redis_errors.ResponseError("ERR user_script:1: Script attempted"), Verdict.REFUSED),
        (redis_errors.DataError("Invalid input of type: 'NoneType'"), Verdict.REFUSED),
        (redis_errors.ResponseError("OOM command not allowed"), Verdict.TRANSIENT),
        (redis_errors.ResponseError("BUSY Redis is busy running a script"), Verdict.TRANSIENT),
        (redis_errors.ReadOnlyError("READONLY You can't write"), Verdict.TRANSIENT),
        (redis_errors.ConnectionError("Connection refused"), Verdict.TRANSIENT),
        (redis_errors.TimeoutError("Timeout reading"), Verdict.TRANSIENT),
        (redis_errors.BusyLoadingError("LOADING"), Verdict.TRANSIENT),
        (redis_errors.WatchError("changed"), Verdict.TRANSIENT),
        (redis_errors.AuthenticationError("invalid password"), Verdict.CONFIGURATION),
        (redis_errors.NoPermissionError("NOPERM"), Verdict.CONFIGURATION),
    ],
)
def test_redis_errors(error: Exception, expected: Verdict) -> None:
    assert redis.verdict(error) is expected
    refused = redis.step_refusal(error, "the put of accounts/1")
    assert (refused is not None) is (expected is Verdict.REFUSED)


def test_a_wrongtype_reply_is_the_steps_refusal_in_redis_words() -> None:
    refused = redis.step_refusal(
        redis_errors.ResponseError("WRONGTYPE Operation against a key"), "the bump step"
    )
    assert refused is not None
    assert refused.reason == "Redis refused the bump step: WRONGTYPE Operation against a key"


# ---------------------------------------------------------------- MongoDB


@pytest.mark.parametrize(
    ("error", "expected", "steps"),
    [
        (
            mongo_errors.WriteError(
                "Document failed validation", 121, {"errmsg": "Document failed validation"}
            ),
            Verdict.REFUSED,
            True,
        ),
        (
            mongo_errors.DuplicateKeyError("E11000 duplicate key", 11000, {"errmsg": "E11000"}),
            Verdict.REFUSED,
            True,
        ),
        (mongo_errors.DocumentTooLarge("too large"), Verdict.REFUSED, True),
        (mongo_errors.ExecutionTimeout("operation exceeded time limit", 50), Verdict.TIMEOUT, True),
        (mongo_errors.AutoReconnect("connection reset"), Verdict.TRANSIENT, False),
        (mongo_errors.NotPrimaryError("not primary"), Verdict.TRANSIENT, False),
        (mongo_errors.OperationFailure("not writable primary", 10107), Verdict.TRANSIENT, False),
        (mongo_errors.OperationFailure("write conflict", 112), Verdict.TRANSIENT, False),
        (mongo_errors.OperationFailure("unauthorized", 13), Verdict.CONFIGURATION, True),
        (mongo_errors.OperationFailure("auth failed", 18), Verdict.CONFIGURATION, False),
    ],
)
def test_mongodb_errors(error: Exception, expected: Verdict, steps: bool) -> None:
    """``steps``: inside an action it is the step's (a missing privilege on the step's own
    collection is; the credentials are not)."""
    assert mongo.verdict(error) is expected
    assert (mongo.step_refusal(error, "the insert of orders/o-1") is not None) is steps


def test_a_bulk_write_refusal_names_the_first_document_error() -> None:
    error = mongo_errors.BulkWriteError(
        {"writeErrors": [{"errmsg": "E11000 duplicate key error", "code": 11000}]}
    )
    refused = mongo.step_refusal(error, "the reserve step", "FerretDB")
    assert refused is not None
    assert refused.reason == "FerretDB refused the reserve step: E11000 duplicate key error (65)"


# ---------------------------------------------------------------- the storage base class


class Store:
    """What the in-memory storage's actions do: each action name refuses its own way."""

    def __init__(self) -> None:
        self.commits_refused = 0  # how many more commit attempts the store refuses
        self.compensations_refused = 0
        self.timeouts = 0  # how many more applies of "slow" time out
        self.runs: list[str] = []


class Actions(participants.Actions[Store]):
    def apply(self, native: Store, action: str, args: Mapping[str, Any]) -> Any:
        native.runs.append(f"apply {action}")
        if action == "frozen":
            raise StoreRefused("PostgreSQL refused the frozen step: account frozen (P0001)")
        if action == "slow" and native.timeouts:
            native.timeouts -= 1
            raise StoreRefused("PostgreSQL timed out on the slow step (57014)", timeout=True)
        return None

    def compensate(self, native: Store, action: str, args: Mapping[str, Any], before: Any) -> None:
        native.runs.append(f"compensate {action}")
        if native.compensations_refused:
            native.compensations_refused -= 1
            raise StoreRefused("PostgreSQL refused the compensation (23514)")

    def confirm(self, native: Store, action: str, args: Mapping[str, Any]) -> None:
        native.runs.append(f"confirm {action}")
        if native.commits_refused:
            native.commits_refused -= 1
            raise StoreRefused("PostgreSQL refused the commit (P0001)")


class Unit(participants.Unit[Store]):
    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.native = storage.store

    def entry(self, tx_id: str, step: int) -> participants.LedgerEntry | None:
        return self.storage.entries.get((tx_id, step))

    def entries(self, tx_id: str) -> list[participants.LedgerEntry]:
        return [e for (tx, _), e in sorted(self.storage.entries.items()) if tx == tx_id]

    def tx_rolled_back(self, tx_id: str) -> bool:
        return False

    def known_fingerprint(self, tx_id: str) -> str | None:
        return None

    def write(self, entry: participants.LedgerEntry) -> None:
        self.storage.entries[(entry.tx_id, entry.step)] = entry

    def rollback_effect(self) -> None:
        pass


class Storage(participants.LedgerStorage[Store, None]):
    refusal_backoff_s = 0.001

    def __init__(self) -> None:
        super().__init__()
        self.name, self.where = "bank", "memory"
        self.actions = Actions()
        self.store = Store()
        self.entries: dict[tuple[str, int], participants.LedgerEntry] = {}

    def prepare(self) -> None:
        pass

    @contextmanager
    def open_batch(self, items: Sequence[participants.WorkItem], attempt: int) -> Iterator[None]:
        yield None

    def open_unit(
        self, batch: None, item: participants.WorkItem, previous: participants.Unit[Store] | None
    ) -> Unit:
        return Unit(self)

    def translate(self, exc: BaseException, what: str) -> NoReturn:
        raise TransientError(str(exc)) from exc

    def ledger(self, tx_id: str | None = None) -> list[participants.LedgerEntry]:
        return [e for (tx, _), e in self.entries.items() if tx_id in (None, tx)]

    def in_flight_sequential(self) -> set[str]:
        return set()

    def prune(self, horizon_ms: int, limit: int) -> int:
        return 0


def request(tx_id: str, action: str) -> participants.Requested:
    return participants.Requested(tx_id, 0, action, {}, Mode.PARALLEL, 1, 10_000, 1)


def outcomes(reports: Sequence[participants.Report]) -> list[tuple[str, StepStatus, bool]]:
    return [(r.tx_id, r.status, r.parked) for r in reports]


def test_a_refused_step_fails_at_once_and_the_batch_goes_on() -> None:
    storage = Storage()
    reports = storage.execute([request("tx-1", "frozen"), request("tx-2", "fine")])
    assert outcomes(reports) == [
        ("tx-1", StepStatus.FAILED, False),
        ("tx-2", StepStatus.APPLIED, False),
    ]
    assert reports[0].reason == "PostgreSQL refused the frozen step: account frozen (P0001)"
    assert storage.store.runs == ["apply frozen", "apply fine"]  # no second run
    assert storage.entries[("tx-1", 0)].status is participants.LedgerStatus.FAILED


def test_a_step_that_times_out_runs_again_and_may_pass() -> None:
    storage = Storage()
    storage.store.timeouts = 2
    reports = storage.execute([request("tx-1", "slow")])
    assert outcomes(reports) == [("tx-1", StepStatus.APPLIED, False)]
    assert storage.store.runs == ["apply slow"] * 3


def test_a_step_that_keeps_timing_out_fails_after_its_runs_and_the_batch_goes_on() -> None:
    storage = Storage()
    storage.store.timeouts = 100
    reports = storage.execute([request("tx-1", "slow"), request("tx-2", "fine")])
    assert outcomes(reports) == [
        ("tx-1", StepStatus.FAILED, False),
        ("tx-2", StepStatus.APPLIED, False),
    ]
    assert reports[0].reason == "PostgreSQL timed out on the slow step (57014)"
    # refusal_attempts runs; the refusal is then recorded without running the action again
    assert storage.store.runs == ["apply slow"] * storage.refusal_attempts + ["apply fine"]


def test_a_refused_compensation_is_retried_then_parked_and_reported() -> None:
    storage = Storage()
    storage.execute([request("tx-1", "fine")])
    storage.store.compensations_refused = 100
    reports = storage.execute([participants.DecisionArrived("tx-1", Outcome.ROLLBACK, 2)])
    assert outcomes(reports) == [("tx-1", StepStatus.COMPENSATION_FAILED, True)]
    assert reports[0].reason == "compensation failed: PostgreSQL refused the compensation (23514)"
    assert storage.store.runs.count("compensate fine") == storage.refusal_attempts
    entry = storage.entries[("tx-1", 0)]
    assert entry.status is participants.LedgerStatus.COMPENSATION_FAILED
    # A re-driven rollback once the store accepts it compensates the step.
    storage.store.compensations_refused = 0
    again = storage.execute([participants.DecisionArrived("tx-1", Outcome.ROLLBACK, 3)])
    assert outcomes(again) == [("tx-1", StepStatus.COMPENSATED, False)]


def test_a_refused_commit_is_parked_the_step_left_applied_for_a_redriven_decision() -> None:
    storage = Storage()
    storage.execute([request("tx-1", "fine")])
    storage.store.commits_refused = 100
    reports = storage.execute([participants.DecisionArrived("tx-1", Outcome.COMMIT, 2)])
    assert outcomes(reports) == [("tx-1", StepStatus.COMPENSATION_FAILED, True)]
    assert reports[0].reason == (
        "commit refused, left applied for a re-driven decision: "
        "PostgreSQL refused the commit (P0001)"
    )
    assert storage.store.runs.count("confirm fine") == storage.refusal_attempts
    assert storage.entries[("tx-1", 0)].status is participants.LedgerStatus.APPLIED
    storage.store.commits_refused = 0
    again = storage.execute([participants.DecisionArrived("tx-1", Outcome.COMMIT, 3)])
    assert outcomes(again) == [("tx-1", StepStatus.COMMITTED, False)]


def test_a_commit_refused_once_passes_on_its_second_run() -> None:
    storage = Storage()
    storage.execute([request("tx-1", "fine")])
    storage.store.commits_refused = 1
    reports = storage.execute([participants.DecisionArrived("tx-1", Outcome.COMMIT, 2)])
    assert outcomes(reports) == [("tx-1", StepStatus.COMMITTED, False)]
