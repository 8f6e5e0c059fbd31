"""The SQL storage's batch path: built-in increments read and written once per batch.

What :mod:`participants._sql_rows` promises, against real databases (PostgreSQL and
SQLite): steps of one batch on one row see each other in batch order, a rejected
step changes nothing and fails alone, a value the database refuses in the final
write fails only its step (the batch runs again with savepoints), other actions
in the same batch see the increments before them, and the number of statements a
batch sends does not grow with its size.

These steps run at level ``none`` (they write at once, so each test reads what a
batch left); the same batch path under ``read_committed`` (reservations and holds,
written at commit) is tested in ``test_sql_isolation.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from saga.participants._barrier import Requested
from saga.participants._storage import WorkItem
from saga.participants.sql._adapter import SqlStorage
from saga.streams import Isolation, StepStatus, TransientError
from tests.integration.test_sql_storage import (
    Database,
    postgres_database,
    rollback,
    sql_harness,
    sqlite_database,
)
from tests.integration.test_sql_storage import requested as requested_at

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


def requested(tx_id: str, action: str, args: dict[str, Any]) -> Requested:
    """A request at level ``none`` (see the module doc)."""
    return requested_at(tx_id, action, args, isolation=Isolation.NONE)


def bump(key: Any, by: Any, field: str = "balance", **bounds: Any) -> dict[str, Any]:
    return {"target": "accounts", "key": key, "field": field, "by": by, **bounds}


def statuses(reports: list[Any]) -> list[tuple[str, StepStatus]]:
    return [(r.tx_id, r.status) for r in reports]


def test_steps_on_one_row_see_each_other_in_batch_order(database: Database) -> None:
    """alice has 100: -60 applies, the next -60 would go below 0 and fails alone, +30
    applies, and the -60 after it fits again; bob's row and the key spelt as text too."""
    with sql_harness(database) as harness:
        got = harness.storage.execute(
            [
                requested("tx-1", "increment", bump(1, -60, min=0)),
                requested("tx-2", "increment", bump(1, -60, min=0)),
                requested("tx-3", "increment", bump("1", 30, min=0)),
                requested("tx-4", "increment", bump(2, 5)),
                requested("tx-5", "increment", bump(1, -60, min=0)),
                requested("tx-6", "increment", bump(9, 1)),
            ]
        )
        assert statuses(got) == [
            ("tx-1", StepStatus.APPLIED),
            ("tx-2", StepStatus.FAILED),
            ("tx-3", StepStatus.APPLIED),
            ("tx-4", StepStatus.APPLIED),
            ("tx-5", StepStatus.APPLIED),
            ("tx-6", StepStatus.FAILED),
        ]
        assert got[1].reason == "accounts/1 balance would be -20, below the minimum 0"
        assert got[5].reason == "accounts/9 does not exist"
        assert harness.record("accounts", 1) == {
            "owner": "alice",
            "balance": 10,
            "credit": Decimal("10.50"),
        }
        assert harness.record("accounts", 2) == {"owner": "bob", "balance": 55, "credit": None}

        # Their compensations, in one batch with a new step on the same row.
        back = harness.storage.execute(
            [rollback("tx-1"), requested("tx-7", "increment", bump(1, 1)), rollback("tx-5")]
        )
        assert statuses(back) == [
            ("tx-1", StepStatus.COMPENSATED),
            ("tx-7", StepStatus.APPLIED),
            ("tx-5", StepStatus.COMPENSATED),
        ]
        assert harness.record("accounts", 1) == {
            "owner": "alice",
            "balance": 131,
            "credit": Decimal("10.50"),
        }


def test_a_text_key_and_a_null_value(database: Database) -> None:
    """Rows addressed by a text key (``orders``) and a counter that is NULL (bob's credit)."""
    with sql_harness(database) as harness:
        more = {"target": "orders", "key": "o-1", "field": "qty", "by": 2}
        got = harness.storage.execute(
            [
                requested("tx-1", "increment", more),
                requested("tx-2", "increment", more),
                requested("tx-3", "increment", bump(2, 1, field="credit")),
            ]
        )
        assert statuses(got) == [
            ("tx-1", StepStatus.APPLIED),
            ("tx-2", StepStatus.APPLIED),
            ("tx-3", StepStatus.FAILED),
        ]
        assert got[2].reason == "accounts/2 has no value in credit"
        assert harness.record("orders", "o-1") == {
            "item": "book",
            "qty": 5,
            "price": Decimal("9.99"),
        }


def test_other_actions_see_the_increments_before_them(database: Database) -> None:
    """An update between two increments of one row: each sees the one before."""
    with sql_harness(database) as harness:
        got = harness.storage.execute(
            [
                requested("tx-1", "increment", bump(1, 5)),
                requested(
                    "tx-2", "update", {"target": "accounts", "key": 1, "set": {"owner": "al"}}
                ),
                requested("tx-3", "increment", bump(1, 5)),
                requested("tx-4", "delete", {"target": "accounts", "key": 2}),
                requested("tx-5", "increment", bump(2, 5)),
            ]
        )
        assert statuses(got) == [
            ("tx-1", StepStatus.APPLIED),
            ("tx-2", StepStatus.APPLIED),
            ("tx-3", StepStatus.APPLIED),
            ("tx-4", StepStatus.APPLIED),
            ("tx-5", StepStatus.FAILED),
        ]
        assert harness.record("accounts", 1) == {
            "owner": "al",
            "balance": 110,
            "credit": Decimal("10.50"),
        }
        [update] = harness.storage.ledger("tx-2")
        assert update.before == {"owner": "alice"}
        assert harness.record("accounts", 2) is None


def test_a_value_the_database_refuses_fails_only_its_step(postgres_db: Database) -> None:
    """``integer`` overflows only in the batch's final write: the batch runs again with
    savepoints, where that step alone is refused."""
    with sql_harness(postgres_db) as harness:
        got = harness.storage.execute(
            [
                requested("tx-1", "increment", bump(1, 5)),
                requested("tx-2", "increment", bump(2, 2**31)),
                requested("tx-3", "increment", bump(2, 5)),
            ]
        )
        assert statuses(got) == [
            ("tx-1", StepStatus.APPLIED),
            ("tx-2", StepStatus.FAILED),
            ("tx-3", StepStatus.APPLIED),
        ]
        assert got[1].reason and "refused the increment of accounts/2: " in got[1].reason
        assert harness.record("accounts", 2) == {"owner": "bob", "balance": 55, "credit": None}
        assert harness.record("accounts", 1) == {
            "owner": "alice",
            "balance": 105,
            "credit": Decimal("10.50"),
        }


def test_numeric_rounds_at_every_step_as_the_column_does(postgres_db: Database) -> None:
    """``numeric(12, 2)``: 10.50 + 0.005 is stored as 10.51, and the next + 0.005 starts
    from that (10.515 -> 10.52), as two statements would have left it."""
    with sql_harness(postgres_db) as harness:
        half_cent = bump(1, 0.005, field="credit", max=10.515)
        got = harness.storage.execute(
            [requested("tx-1", "increment", half_cent), requested("tx-2", "increment", half_cent)]
        )
        assert statuses(got) == [("tx-1", StepStatus.APPLIED), ("tx-2", StepStatus.APPLIED)]
        assert harness.record("accounts", 1) == {
            "owner": "alice",
            "balance": 100,
            "credit": Decimal("10.52"),
        }


def test_a_batch_costs_the_same_statements_whatever_its_size(database: Database) -> None:
    """Five increments or fifty on a handful of rows: the same number of statements."""
    with sql_harness(database) as harness:
        storage = harness.storage
        assert isinstance(storage, SqlStorage)
        for key in range(10, 20):
            harness.seed("accounts", key, {"owner": f"o{key}", "balance": 0})
        storage.setup()
        sent: list[str] = []

        def count(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
            sent.append(statement)

        sa.event.listen(storage._engine, "before_cursor_execute", count)

        def run(prefix: str, n: int) -> int:
            sent.clear()
            items: list[WorkItem] = [
                requested(f"{prefix}-{i}", "increment", bump(10 + i % 10, 1)) for i in range(n)
            ]
            assert {r.status for r in storage.execute(items)} == {StepStatus.APPLIED}
            return len(sent)

        small, large = run("small", 5), run("large", 50)
        assert small == large, f"{small} statements for 5 steps, {large} for 50"
        assert harness.record("accounts", 10) == {"owner": "o10", "balance": 6, "credit": None}


def test_keys_the_database_matches_but_python_does_not(postgres_db: Database) -> None:
    """A ``char(4)`` key comes back padded: such a row is not held in the batch's copy but
    changed by its own statement, and still sees the increments before it."""
    from saga.participants.sql._rows import NOT_CACHED, BatchRows

    metadata = sa.MetaData(schema=postgres_db.schema)
    codes = sa.Table(
        "codes",
        metadata,
        sa.Column("code", sa.CHAR(4), primary_key=True),
        sa.Column("n", sa.BigInteger),
    )
    metadata.create_all(postgres_db.engine)
    with postgres_db.engine.begin() as connection:
        connection.execute(sa.insert(codes).values(code="ab", n=1))
    reflected = sa.Table(
        "codes", sa.MetaData(schema=postgres_db.schema), autoload_with=postgres_db.engine
    )
    with postgres_db.engine.begin() as connection:
        rows = BatchRows(connection, {"codes": reflected}, postgresql=True)
        rows.preload({"codes": {"ab"}})
        assert rows.row(reflected, "ab") is NOT_CACHED
    with sql_harness(postgres_db) as harness:
        storage = harness.make(targets=("codes",))
        more = {"target": "codes", "key": "ab", "field": "n", "by": 2}
        got = storage.execute(
            [requested("tx-1", "increment", more), requested("tx-2", "increment", more)]
        )
        assert statuses(got) == [("tx-1", StepStatus.APPLIED), ("tx-2", StepStatus.APPLIED)]
    with postgres_db.engine.connect() as connection:
        assert connection.execute(sa.select(codes.c.n)).scalar_one() == 5


def test_the_ledger_lookup_is_planned_on_each_batch(postgres_db: Database) -> None:
    """psycopg prepares a statement on its fifth run, and PostgreSQL may then keep a
    generic plan chosen while the new ledger was empty: an index on ``participant``
    alone, every entry of the participant read per key (the bench's open loop: a
    lookup 22 ms on average, 1.2 s at worst). A batch forbids generic plans for its
    own transaction: the participant's connection shows the lookup prepared and
    planned afresh on every batch, never from a generic plan, and the setting ends
    with the batch."""
    with sql_harness(postgres_db) as harness:
        storage = harness.storage
        assert isinstance(storage, SqlStorage)
        for batch in range(12):
            items: list[WorkItem] = [
                requested(f"b{batch}-{i}", "increment", bump(1 + i % 2, 1)) for i in range(10)
            ]
            assert {r.status for r in storage.execute(items)} == {StepStatus.APPLIED}
        with storage._engine.connect() as connection:
            plans = connection.execute(
                sa.text(
                    "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                    "WHERE statement LIKE '%CROSS JOIN LATERAL%FOR UPDATE%'"
                )
            ).all()
            mode = connection.execute(sa.text("SHOW plan_cache_mode")).scalar_one()
        assert len(plans) == 1, f"the lookup is not prepared on this connection: {plans}"
        generic, custom = plans[0]
        assert generic == 0, f"{generic} lookups ran a generic plan"
        assert custom >= 5
        assert mode == "auto"


def test_a_connection_lost_in_the_final_write_is_a_transient_error(postgres_db: Database) -> None:
    """On PostgreSQL the batch's writes and its commit go out in one pipeline; the server
    process dying before they reach it leaves nothing applied, the error is transient,
    and the pool's next connection runs the retried batch."""
    with sql_harness(postgres_db) as harness:
        storage = harness.storage
        assert isinstance(storage, SqlStorage)
        assert storage._pipeline, "psycopg's pipeline mode should be in use on PostgreSQL"
        step = requested("tx-1", "increment", bump(2, 1))
        killed: list[int] = []

        def kill(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
            if statement.startswith("UPDATE") and not killed:
                pid = conn.connection.driver_connection.info.backend_pid
                killed.append(pid)
                with sa.create_engine(sa.make_url(postgres_db.url)).connect() as other:
                    other.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid})

        sa.event.listen(storage._engine, "before_cursor_execute", kill)
        with pytest.raises(TransientError, match="could not run a batch") as info:
            storage.execute([step])
        assert info.value.retryable
        assert killed
        assert harness.record("accounts", 2) == {"owner": "bob", "balance": 50, "credit": None}
        assert storage.ledger() == []
        assert statuses(storage.execute([step])) == [("tx-1", StepStatus.APPLIED)]
        assert harness.record("accounts", 2) == {"owner": "bob", "balance": 51, "credit": None}


def _scans(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from _scans(child)


def test_ledger_and_holds_rows_are_found_by_key_whatever_the_statistics(
    postgres_db: Database,
) -> None:
    """The statements a batch sends to the ledger and holds tables reach each row through
    the primary key (or its ``ctid``, found that way), even when PostgreSQL last
    analysed the tables while they were empty: the commit's ledger update once scanned
    the ``(participant, finished_ms)`` index, every entry of the participant per batch,
    and the holds' lookup and delete scanned the whole holds table, whose ``bounds``
    rows stay for good (the bench saw 37,000 index entries read per batch)."""
    from saga.participants.sql._holds import _KEYS, HOLDS_LOOKUP
    from saga.participants.sql._ledger import ADDED_COLUMNS, LEDGER_COLUMNS
    from saga.participants.sql._rows import bulk_delete, bulk_rows, bulk_statement

    with sql_harness(postgres_db) as harness:
        storage = harness.storage
        assert isinstance(storage, SqlStorage)
        ledger, holds = storage.ledger_table, storage.holds_table
        dialect = storage._engine.dialect
        quoted = dialect.identifier_preparer.format_table
        entries = [
            {
                "participant": "bank",
                "tx_id": f"tx-{i}",
                "step": 0,
                "status": "applied",
                "action": "increment",
                "args": {"by": 1},
                "mode": "parallel",
                "n_steps": 1,
                "deadline_ms": 1,
                "effect": True,
                "before": None,
                "reason": None,
                "rollback_pending": False,
                "successor_compensated": False,
                "updated_ms": 1,
                "fingerprint": None,
                "finished_ms": None,
            }
            for i in range(5000)
        ]
        bounds = [
            {
                "target": "accounts",
                "record": str(i),
                "field": "balance",
                "tx_id": "",
                "step": -1,
                "kind": "bounds",
                "action": "increment",
                "value": {"min": 0, "max": None},
            }
            for i in range(3000)
        ]
        with storage._engine.begin() as connection:
            connection.execute(sa.text(f"ANALYZE {quoted(ledger)}, {quoted(holds)}"))
        with storage._engine.begin() as connection:
            connection.execute(sa.insert(ledger), entries)
            connection.execute(sa.insert(holds), bounds)
        keys = LEDGER_COLUMNS[:3]
        update = bulk_statement(
            dialect, ledger, keys, (*LEDGER_COLUMNS[3:], *ADDED_COLUMNS), by_row_id=True
        )
        delete = bulk_delete(dialect, holds, _KEYS)
        assert update is not None and delete is not None
        committed = [{**e, "status": "committed", "finished_ms": 2} for e in entries[:40:2]]
        lookup = HOLDS_LOOKUP.format(table=quoted(holds), targets=":targets", records=":records")
        statements = {
            "the ledger's update": (update.text, bulk_rows(committed)),
            "the holds' delete": (delete.text, bulk_rows(bounds[:40:2])),
            "the holds' lookup": (
                lookup,
                {"targets": ["accounts"] * 20, "records": [str(i) for i in range(0, 40, 2)]},
            ),
        }
        with storage._engine.begin() as connection:
            for what, (sql, params) in statements.items():
                plan = connection.execute(
                    sa.text(f"EXPLAIN (FORMAT JSON) {sql}"), params
                ).scalar_one()
                tables = {ledger.name, holds.name}
                scans = [
                    n
                    for n in _scans(plan[0]["Plan"])
                    if n.get("Relation Name") in tables and n["Node Type"] != "ModifyTable"
                ]
                assert scans, f"{what}: no scan of the tables in {plan}"
                for node in scans:
                    kind = node["Node Type"]
                    assert kind in ("Index Scan", "Tid Scan"), f"{what}: {kind} in {plan}"
                    if kind == "Index Scan":
                        assert node["Index Name"].endswith("_pkey"), f"{what}: {node}"
