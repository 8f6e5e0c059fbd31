"""The SQL storage against real databases: what only SQL has (types, columns, savepoints,
advisory locks, the driver's errors).

Why this module is over 600 lines: its cases share one database set-up per
dialect (PostgreSQL and SQLite), the slow part; one case per SQL-only behaviour.

The storage contract every adapter passes (docs/architecture.md §3 built-in actions, §4 barrier) is
``TestStorageContract`` in ``test_storage_contract.py``, which builds its SQL storages
with the databases and harness defined here. Every PostgreSQL test runs in a schema of
its own, dropped afterwards; every SQLite test in a file of its own.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.schema import CreateSchema, DropSchema

from saga.participants._barrier import LedgerStatus, Requested
from saga.participants._handlers import Handler, Reject
from saga.participants._storage import DecisionArrived, Report, Storage
from saga.participants.sql._adapter import SqlSession, SqlStorage
from saga.streams import (
    BusinessRejection,
    ConfigurationError,
    Isolation,
    Mode,
    Outcome,
    StepStatus,
    TransientError,
)

pytestmark = pytest.mark.integration

POSTGRES_URL = os.environ.get(
    "SAGA_POSTGRES_URL", "postgresql://saga:saga@127.0.0.1:15432/saga"
).replace("postgresql://", "postgresql+psycopg://", 1)
TARGETS = ("accounts", "orders")
NOW = 1_700_000_000_000
DEADLINE = NOW + 60_000

Fields = dict[str, Any]


# ---------------------------------------------------------------- databases


def business_tables(metadata: sa.MetaData) -> dict[str, sa.Table]:
    """The demo's shapes: integer, numeric and text columns; ``secrets`` is not a target."""
    accounts = sa.Table(
        "accounts",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("balance", sa.Integer, nullable=False, server_default="0"),
        sa.Column("credit", sa.Numeric(12, 2)),
    )
    orders = sa.Table(
        "orders",
        metadata,
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("item", sa.Text),
        sa.Column("qty", sa.Integer),
        sa.Column("price", sa.Numeric(12, 2)),
    )
    secrets = sa.Table(
        "secrets",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("value", sa.Text),
    )
    return {"accounts": accounts, "orders": orders, "secrets": secrets}


@dataclass
class Database:
    """A fresh database (a PostgreSQL schema or an SQLite file) with the business tables."""

    url: str
    schema: str | None
    engine: sa.Engine
    tables: dict[str, sa.Table]


@contextmanager
def postgres_database() -> Iterator[Database]:
    """A fresh PostgreSQL schema with the business tables; dropped afterwards."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    engine = sa.create_engine(POSTGRES_URL)
    with engine.begin() as connection:
        connection.execute(CreateSchema(schema))
    metadata = sa.MetaData(schema=schema)
    tables = business_tables(metadata)
    metadata.create_all(engine)
    try:
        yield Database(POSTGRES_URL, schema, engine, tables)
    finally:
        with engine.begin() as connection:
            connection.execute(DropSchema(schema, cascade=True))
        engine.dispose()


@contextmanager
def sqlite_database(folder: Path) -> Iterator[Database]:
    """A fresh SQLite file in ``folder`` with the business tables."""
    url = f"sqlite:///{folder / 'saga.db'}"
    engine = sa.create_engine(url)
    metadata = sa.MetaData()
    tables = business_tables(metadata)
    metadata.create_all(engine)
    try:
        yield Database(url, None, engine, tables)
    finally:
        engine.dispose()


@pytest.fixture
def postgres_db() -> Iterator[Database]:
    with postgres_database() as db:
        yield db


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Iterator[Database]:
    with sqlite_database(tmp_path) as db:
        yield db


DATABASE_FIXTURES = {"postgresql": "postgres_db", "sqlite": "sqlite_db"}


@pytest.fixture(params=sorted(DATABASE_FIXTURES))
def database(request: pytest.FixtureRequest) -> Database:
    db: Database = request.getfixturevalue(DATABASE_FIXTURES[request.param])
    return db


# ---------------------------------------------------------------- the harness


@dataclass
class SqlHarness:
    """A storage under test plus direct access to its business data."""

    storage: Storage
    db: Database
    make: Callable[..., Storage] = field(repr=False)

    def seed(self, target: str, key: Any, fields: Fields) -> None:
        table = self.db.tables[target]
        pk = next(iter(table.primary_key.columns)).name
        with self.db.engine.begin() as connection:
            connection.execute(sa.insert(table).values({pk: key, **fields}))

    def record(self, target: str, key: Any) -> Fields | None:
        table = self.db.tables[target]
        pk = next(iter(table.primary_key.columns))
        with self.db.engine.connect() as connection:
            row = connection.execute(sa.select(table).where(pk == key)).mappings().first()
        if row is None:
            return None
        return {name: value for name, value in row.items() if name != pk.name}

    def remove(self, target: str, key: Any) -> None:
        """Delete a record behind the participant's back."""
        table = self.db.tables[target]
        pk = next(iter(table.primary_key.columns))
        with self.db.engine.begin() as connection:
            connection.execute(sa.delete(table).where(pk == key))

    def snapshot(self) -> dict[str, list[tuple[Any, ...]]]:
        out: dict[str, list[tuple[Any, ...]]] = {}
        with self.db.engine.connect() as connection:
            for name, table in self.db.tables.items():
                rows = connection.execute(sa.select(table)).all()
                out[name] = sorted((tuple(row) for row in rows), key=repr)
        return out


@contextmanager
def sql_harness(db: Database) -> Iterator[SqlHarness]:
    made: list[Storage] = []

    def make(**overrides: Any) -> Storage:
        options: dict[str, Any] = {"name": "bank", "targets": TARGETS, "schema": db.schema}
        options.update(overrides)
        name = options.pop("name")
        targets = options.pop("targets")
        storage = SqlStorage(name, options.pop("url", db.url), targets, **options)
        made.append(storage)
        return storage

    storage = make()
    storage.setup()
    harness = SqlHarness(storage, db, make)
    harness.seed("accounts", 1, {"owner": "alice", "balance": 100, "credit": Decimal("10.50")})
    harness.seed("accounts", 2, {"owner": "bob", "balance": 50, "credit": None})
    harness.seed("orders", "o-1", {"item": "book", "qty": 1, "price": Decimal("9.99")})
    harness.seed("secrets", 1, {"value": "do not touch"})
    try:
        yield harness
    finally:
        for each in made:
            each.close()


# ---------------------------------------------------------------- work items


def requested(
    tx_id: str,
    action: str,
    args: Mapping[str, Any],
    *,
    step: int = 0,
    mode: Mode = Mode.PARALLEL,
    n_steps: int = 1,
    deadline_ms: int = DEADLINE,
    now_ms: int = NOW,
    predecessor_applied: bool = False,
    isolation: Isolation = Isolation.READ_COMMITTED,
) -> Requested:
    return Requested(
        tx_id=tx_id,
        step=step,
        action=action,
        args=args,
        mode=mode,
        n_steps=n_steps,
        deadline_ms=deadline_ms,
        now_ms=now_ms,
        predecessor_applied=predecessor_applied,
        isolation=isolation,
    )


def rollback(tx_id: str, now_ms: int = NOW + 1_000) -> DecisionArrived:
    return DecisionArrived(tx_id, Outcome.ROLLBACK, now_ms)


def commit(tx_id: str, now_ms: int = NOW + 1_000) -> DecisionArrived:
    return DecisionArrived(tx_id, Outcome.COMMIT, now_ms)


def report(
    tx_id: str,
    status: StepStatus,
    step: int = 0,
    reason: str | None = None,
    *,
    confirm: bool = False,
) -> Report:
    return Report(tx_id, step, status, reason, confirm)


def only_status(reports: list[Report]) -> list[tuple[str, int, StepStatus]]:
    return [(r.tx_id, r.step, r.status) for r in reports]


# ---------------------------------------------------------------- SQL specifics


class TestSqlTypesAndColumns:
    """What the contract leaves to each storage: the SQL schema's types, defaults and keys."""

    @pytest.mark.parametrize(
        ("action", "args", "expected"),
        [
            pytest.param(
                "insert",
                {"target": "orders", "key": "o-2", "value": {"id": "o-2", "item": "pen"}},
                ("orders", "o-2", {"item": "pen", "qty": None, "price": None}),
                id="insert-repeating-the-key-column",
            ),
            pytest.param(
                "put",
                {"target": "accounts", "key": 1, "value": {"balance": "7", "credit": "1.25"}},
                ("accounts", 1, {"owner": "alice", "balance": 7, "credit": Decimal("1.25")}),
                id="put-converts-text-to-the-column-type",
            ),
            pytest.param(
                "put",
                {"target": "accounts", "key": "9", "value": {"owner": "dan"}},
                ("accounts", 9, {"owner": "dan", "balance": 0, "credit": None}),
                id="put-new-row-takes-the-column-defaults",
            ),
            pytest.param(
                "increment",
                {"target": "accounts", "key": 1, "field": "credit", "by": 0.1},
                ("accounts", 1, {"owner": "alice", "balance": 100, "credit": Decimal("10.60")}),
                id="increment-numeric-column-exactly",
            ),
        ],
    )
    @pytest.mark.parametrize("level", list(Isolation))
    def test_values_take_the_column_types(
        self,
        database: Database,
        action: str,
        args: dict[str, Any],
        expected: tuple[str, Any, Fields],
        level: Isolation,
    ) -> None:
        """``none`` writes at apply (and its rollback restores the data exactly);
        ``read_committed`` writes the same values at commit."""
        with sql_harness(database) as harness:
            before = harness.snapshot()
            held = level is Isolation.READ_COMMITTED
            assert harness.storage.execute([requested("tx-1", action, args, isolation=level)]) == [
                report("tx-1", StepStatus.APPLIED, confirm=held)
            ]
            target, key, record = expected
            if held:
                assert harness.snapshot() == before
                harness.storage.execute([commit("tx-1")])
                assert harness.record(target, key) == record
                return
            assert harness.record(target, key) == record
            harness.storage.execute([rollback("tx-1")])
            assert harness.snapshot() == before

    def test_before_image_is_json_with_exact_numerics(self, database: Database) -> None:
        with sql_harness(database) as harness:
            harness.storage.execute(
                [
                    requested(
                        "tx-1",
                        "put",
                        {"target": "accounts", "key": 1, "value": {"balance": 1}},
                        isolation=Isolation.NONE,
                    )
                ]
            )
            [entry] = harness.storage.ledger("tx-1")
            assert entry.before == {"id": 1, "owner": "alice", "balance": 100, "credit": "10.50"}

    @pytest.mark.parametrize(
        ("action", "args", "reason"),
        [
            (
                "increment",
                {"target": "accounts", "key": 1, "field": "balance", "by": 0.5},
                "the increment of accounts/1 is 0.5, which does not fit column "
                "accounts.balance (INTEGER)",
            ),
            (
                "increment",
                {"target": "accounts", "key": 1, "field": "owner", "by": 1},
                "accounts.owner is not a numeric column",
            ),
            (
                "update",
                {"target": "accounts", "key": 1, "set": {"colour": "red"}},
                "accounts has no column 'colour'",
            ),
            (
                "update",
                {"target": "accounts", "key": 1, "set": {"id": 5}},
                "update of accounts/1 may not change the key column 'id'",
            ),
            ("insert", {"target": "accounts", "key": 5, "value": {"balance": 1}}, None),
            ("update", {"target": "accounts", "key": "abc", "set": {"balance": 1}}, None),
        ],
    )
    def test_schema_rejections(
        self, database: Database, action: str, args: dict[str, Any], reason: str | None
    ) -> None:
        with sql_harness(database) as harness:
            before = harness.snapshot()
            [got] = harness.storage.execute([requested("tx-1", action, args)])
            assert got.status is StepStatus.FAILED
            assert got.reason
            if reason is not None:
                assert got.reason == reason
            assert harness.snapshot() == before


def test_a_database_error_rejects_only_its_own_step(database: Database) -> None:
    """A batch of built-in steps runs without savepoints; a step the database refuses
    (NOT NULL here) makes the batch run again with them, and only that step fails.
    (Level ``none``, which writes at apply; under ``read_committed`` the insert is
    tried in a savepoint of its own: test_sql_isolation.py.)"""
    with sql_harness(database) as harness:
        bump = {"target": "accounts", "key": 1, "field": "balance", "by": 5}
        refused = {"target": "accounts", "key": 7, "value": {"balance": 1}}  # owner missing
        none = Isolation.NONE
        got = harness.storage.execute(
            [
                requested("tx-1", "increment", bump, isolation=none),
                requested("tx-2", "insert", refused, isolation=none),
                requested("tx-3", "increment", bump, isolation=none),
            ]
        )
        assert [(r.tx_id, r.status) for r in got] == [
            ("tx-1", StepStatus.APPLIED),
            ("tx-2", StepStatus.FAILED),
            ("tx-3", StepStatus.APPLIED),
        ]
        assert got[1].reason and "refused the insert of accounts/7: " in got[1].reason
        assert harness.record("accounts", 1) == {
            "owner": "alice",
            "balance": 110,
            "credit": Decimal("10.50"),
        }
        assert harness.record("accounts", 7) is None
        statuses = {(e.tx_id, e.status) for e in harness.storage.ledger()}
        assert statuses == {
            ("tx-1", LedgerStatus.APPLIED),
            ("tx-2", LedgerStatus.FAILED),
            ("tx-3", LedgerStatus.APPLIED),
        }


def test_the_barrier_off_switch_is_the_storages_own(database: Database) -> None:
    """The chaos suite's negative control reaches the barrier through the storage's fault
    hooks: with ``barrier-off`` a repeated request applies again; without, it does not."""
    from saga.streams._faults import KillFaults

    bump = {"target": "accounts", "key": 1, "field": "balance", "by": 5}
    step = requested("tx-1", "increment", bump, isolation=Isolation.NONE)  # writes at apply
    with sql_harness(database) as harness:
        harness.storage.execute([step])
        harness.storage.execute([step])
        assert (harness.record("accounts", 1) or {})["balance"] == 105
        unsafe = harness.make(faults=KillFaults(switches="barrier-off"))
        unsafe.execute([step])
        assert (harness.record("accounts", 1) or {})["balance"] == 110


def reserve(session: SqlSession, args: Mapping[str, Any]) -> Any:
    orders = session.table("orders")
    found = session.execute(sa.select(orders.c.qty).where(orders.c.id == args["order"])).first()
    if found is None:
        raise Reject(f"order {args['order']} does not exist")
    session.execute(sa.update(orders).where(orders.c.id == args["order"]).values(qty=0))
    if args.get("explode"):
        raise Reject("the handler changed its mind")
    return {"qty": found.qty}


def release(session: SqlSession, args: Mapping[str, Any], before: Any) -> None:
    orders = session.table("orders")
    session.execute(sa.update(orders).where(orders.c.id == args["order"]).values(qty=before["qty"]))


def test_custom_handlers_run_in_the_same_transaction(database: Database) -> None:
    with sql_harness(database) as harness:
        storage = harness.make(name="shop", handlers={"reserve": Handler(reserve, release)})
        storage.setup()
        before = harness.snapshot()
        reports = storage.execute(
            [
                requested("tx-1", "reserve", {"order": "o-1", "explode": True}),
                requested("tx-2", "reserve", {"order": "o-1"}),
                requested(
                    "tx-3",
                    "increment",
                    {"target": "orders", "key": "o-1", "field": "qty", "by": 4},
                    isolation=Isolation.NONE,  # writes at apply, as the handler does
                ),
            ]
        )
        assert reports == [
            report("tx-1", StepStatus.FAILED, reason="the handler changed its mind"),
            report("tx-2", StepStatus.APPLIED),
            report("tx-3", StepStatus.APPLIED),
        ]
        assert harness.record("orders", "o-1") == {
            "item": "book",
            "qty": 4,
            "price": Decimal("9.99"),
        }
        assert [e.before for e in storage.ledger("tx-2")] == [{"qty": 1}]
        storage.execute([rollback("tx-3"), rollback("tx-2")])
        assert harness.snapshot() == before


def test_unreachable_database_is_a_transient_error() -> None:
    storage = SqlStorage("bank", "postgresql://saga:saga@127.0.0.1:1/saga", ["accounts"])
    try:
        with pytest.raises(TransientError) as info:
            storage.setup()
        message = str(info.value)
        assert message.startswith(
            "participant 'bank' could not set up its ledger and tables: "
            "PostgreSQL at 127.0.0.1:1/saga is unavailable or failed ("
        )
        assert "saga:saga" not in message  # never the password
        assert info.value.retryable
        with pytest.raises(TransientError, match="could not set up"):
            storage.execute([rollback("tx-1")])
    finally:
        storage.close()


def test_lost_connection_is_a_transient_error_and_the_batch_is_retried(
    postgres_db: Database,
) -> None:
    with sql_harness(postgres_db) as harness:
        step = requested(
            "tx-1",
            "increment",
            {"target": "accounts", "key": 2, "field": "balance", "by": 1},
            isolation=Isolation.NONE,  # writes at apply
        )

        # Kill our own server process mid-batch, after the effect ran.
        def kill_self(session: SqlSession, args: Mapping[str, Any]) -> Any:
            session.execute(sa.text("SELECT pg_terminate_backend(pg_backend_pid())"))
            return None

        storage = harness.make(name="flaky", handlers={"boom": Handler(kill_self, release)})
        storage.setup()
        with pytest.raises(TransientError, match="could not run a batch"):
            storage.execute([step, requested("tx-2", "boom", {})])
        assert harness.record("accounts", 2) == {"owner": "bob", "balance": 50, "credit": None}
        assert storage.ledger() == []
        # The pool notices the dead connection; the retried batch goes through.
        assert storage.execute([step]) == [report("tx-1", StepStatus.APPLIED)]
        assert harness.record("accounts", 2) == {"owner": "bob", "balance": 51, "credit": None}


def test_two_workers_on_one_step_apply_it_once(postgres_db: Database) -> None:
    """A zombie and its successor get the same request: one applies, the other re-reports."""
    with sql_harness(postgres_db) as harness:
        workers = [harness.make(), harness.make()]
        step = requested(
            "tx-1", "increment", {"target": "accounts", "key": 2, "field": "balance", "by": 1}
        )
        outcomes: list[object] = []

        def work(storage: Storage) -> None:
            try:
                outcomes.append(storage.execute([step]))
            except TransientError as exc:
                outcomes.append(exc)

        accounts = postgres_db.tables["accounts"]
        with postgres_db.engine.connect() as holder:
            # Hold the business row so that both workers are inside their batch at once.
            holder.execute(sa.select(accounts).where(accounts.c.id == 2).with_for_update())
            threads = [threading.Thread(target=work, args=(w,)) for w in workers]
            for thread in threads:
                thread.start()
            # pg_locks is live (pg_stat_activity is a per-transaction snapshot).
            waiting = sa.text("SELECT count(*) FROM pg_locks WHERE NOT granted")
            deadline = time.monotonic() + 20
            with postgres_db.engine.connect() as probe:
                while probe.execute(waiting).scalar_one() < 2:
                    assert time.monotonic() < deadline, "the workers never queued up"
                    probe.rollback()
                    time.sleep(0.05)
            holder.rollback()
        for thread in threads:
            thread.join(timeout=30)

        # The advisory lock made the second wait for the first: no collision, no retry.
        assert outcomes == [[report("tx-1", StepStatus.APPLIED, confirm=True)]] * 2
        [entry] = workers[1].ledger("tx-1")
        assert entry.status is LedgerStatus.APPLIED
        # One reservation: its commit adds the amount once.
        assert workers[1].execute([commit("tx-1")]) == [report("tx-1", StepStatus.COMMITTED)]
        assert harness.record("accounts", 2) == {"owner": "bob", "balance": 51, "credit": None}


def test_request_racing_its_rollback_on_another_worker_is_never_applied(
    postgres_db: Database,
) -> None:
    """Hanging prevention across workers: the rollback marker's batch holds the transaction."""
    with sql_harness(postgres_db) as harness:
        inside, go_on = threading.Event(), threading.Event()

        def hold(session: SqlSession, args: Mapping[str, Any]) -> Any:
            session.execute(sa.select(1))
            inside.set()
            assert go_on.wait(timeout=30)
            return None

        zombie = harness.make(handlers={"hold": Handler(hold, release)})
        successor = harness.make()
        before = harness.snapshot()
        outcomes: dict[str, list[Report]] = {}

        def run(name: str, storage: Storage, items: list[Any]) -> None:
            outcomes[name] = storage.execute(items)

        # The zombie records the rollback of tx-1 and, in the same batch, lingers.
        rolling_back = threading.Thread(
            target=run,
            args=("zombie", zombie, [rollback("tx-1"), requested("tx-2", "hold", {})]),
        )
        rolling_back.start()
        assert inside.wait(timeout=20), "the zombie's batch never reached its handler"
        late = requested(
            "tx-1", "insert", {"target": "accounts", "key": 3, "value": {"owner": "c"}}
        )
        requesting = threading.Thread(target=run, args=("successor", successor, [late]))
        requesting.start()
        advisory = sa.text(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        )
        deadline = time.monotonic() + 20
        with postgres_db.engine.connect() as probe:
            while probe.execute(advisory).scalar_one() < 1:
                assert time.monotonic() < deadline, "the successor never waited for the zombie"
                probe.rollback()
                time.sleep(0.05)
        go_on.set()
        rolling_back.join(timeout=30)
        requesting.join(timeout=30)

        assert outcomes["zombie"] == [report("tx-2", StepStatus.APPLIED)]
        assert outcomes["successor"] == [report("tx-1", StepStatus.COMPENSATED)]
        assert harness.snapshot() == before


def test_ledger_entry_written_meanwhile_is_a_transient_error(database: Database) -> None:
    """The backstop: an entry read as absent but written by someone else before our insert."""
    from saga.participants._barrier import LedgerEntry
    from saga.participants.sql._ledger import BatchLedger

    with sql_harness(database) as harness:
        storage = harness.storage
        assert isinstance(storage, SqlStorage)
        storage.execute([])  # set up
        entry = LedgerEntry("tx-1", 0, LedgerStatus.APPLIED, "delete", {"target": "accounts"})
        with database.engine.connect() as connection:
            ledger = BatchLedger(storage.name, storage.ledger_table, connection)
            ledger.load(["tx-1"])
            assert ledger.entry("tx-1", 0) is None
            connection.commit()  # let the other writer in (SQLite has one writer at a time)
            other = harness.make()
            other.setup()
            assert isinstance(other, SqlStorage)
            with database.engine.begin() as elsewhere:
                elsewhere.execute(
                    sa.insert(other.ledger_table).values(
                        participant="bank",
                        tx_id="tx-1",
                        step=0,
                        status="applied",
                        mode="parallel",
                        n_steps=1,
                        deadline_ms=0,
                        effect=True,
                        rollback_pending=False,
                        successor_compensated=False,
                        updated_ms=0,
                    )
                )
            ledger.write(entry)
            with pytest.raises(TransientError, match="another worker recorded a step of this"):
                ledger.flush()


class TestConfiguration:
    def test_missing_target_table(self, database: Database) -> None:
        storage = SqlStorage("bank", database.url, ["accounts", "ghosts"], schema=database.schema)
        with pytest.raises(ConfigurationError, match=r"target table (\S+\.)?ghosts does not exist"):
            storage.setup()
        storage.close()

    def test_target_needs_a_single_column_primary_key(self, database: Database) -> None:
        metadata = sa.MetaData(schema=database.schema)
        sa.Table(
            "pairs",
            metadata,
            sa.Column("a", sa.Integer, primary_key=True),
            sa.Column("b", sa.Integer, primary_key=True),
        )
        sa.Table("heap", metadata, sa.Column("a", sa.Integer))
        metadata.create_all(database.engine)
        for name, has in (("pairs", "2 columns: a, b"), ("heap", "none")):
            storage = SqlStorage("bank", database.url, [name], schema=database.schema)
            with pytest.raises(
                ConfigurationError, match=f"single-column primary key \\(it has {has}\\)"
            ):
                storage.setup()
            storage.close()

    def test_ledger_cannot_be_a_target(self, database: Database) -> None:
        with pytest.raises(ConfigurationError, match="cannot also be a target"):
            SqlStorage("bank", database.url, ["saga_ledger"], schema=database.schema)

    @pytest.mark.parametrize("name", ["accounts; DROP TABLE x", 'a"b', "x\n"])
    def test_target_names_are_checked_up_front(self, database: Database, name: str) -> None:
        with pytest.raises(ConfigurationError, match="is not a plain name"):
            SqlStorage("bank", database.url, [name], schema=database.schema)

    def test_missing_schema(self, postgres_db: Database) -> None:
        storage = SqlStorage("bank", postgres_db.url, ["accounts"], schema="no_such_schema")
        with pytest.raises(ConfigurationError, match="schema 'no_such_schema' does not exist"):
            storage.setup()
        storage.close()

    def test_setup_is_idempotent_and_the_ledger_is_portable(self, database: Database) -> None:
        for _ in range(2):
            storage = SqlStorage("bank", database.url, ["accounts"], schema=database.schema)
            storage.setup()
            storage.close()
        columns = {
            c["name"]
            for c in sa.inspect(database.engine).get_columns("saga_ledger", schema=database.schema)
        }
        assert {"participant", "tx_id", "step", "before", "updated_ms"} <= columns
        indexes = sa.inspect(database.engine).get_indexes("saga_ledger", schema=database.schema)
        assert any(ix["column_names"] == ["participant", "status"] for ix in indexes)

    def test_bad_url(self) -> None:
        with pytest.raises(ConfigurationError, match="is not a database URL"):
            SqlStorage("bank", "not a url", ["accounts"])

    def test_confirm_rejection_leaves_the_step_applied(self, database: Database) -> None:
        with sql_harness(database) as harness:

            def refuse(session: SqlSession, args: Mapping[str, Any]) -> None:
                orders = session.table("orders")
                session.execute(sa.update(orders).values(qty=42))
                raise BusinessRejection("no")

            storage = harness.make(
                name="shop",
                handlers={"reserve": Handler(reserve, release, confirm=refuse)},
            )
            storage.setup()
            storage.execute([requested("tx-1", "reserve", {"order": "o-1"})])
            assert storage.execute([commit("tx-1")]) == []
            [entry] = storage.ledger("tx-1")
            assert entry.status is LedgerStatus.APPLIED
            assert harness.record("orders", "o-1") == {
                "item": "book",
                "qty": 0,
                "price": Decimal("9.99"),
            }
