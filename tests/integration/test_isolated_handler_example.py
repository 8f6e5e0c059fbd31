"""``examples/isolated_handler.py``: a custom action that keeps read_committed isolation
itself, loaded as ``--handlers examples.isolated_handler`` loads it, run by a real SQL
storage (PostgreSQL and SQLite) through the barrier.

Two sagas on one account: while the first holds it, every reader sees the committed
balance (no dirty read) and the second fails at once naming the holder (no lost
update); the first's commit writes its value, a rollback leaves the record as it was,
and no hold outlives its saga's decision.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from saga.participants import DecisionArrived, Report, Requested, load_handlers
from saga.participants.sql._adapter import SqlStorage
from saga.streams import Isolation, Mode, Outcome, StepStatus

pytestmark = pytest.mark.integration

POSTGRES_URL = os.environ.get(
    "SAGA_POSTGRES_URL", "postgresql://saga:saga@127.0.0.1:15432/saga"
).replace("postgresql://", "postgresql+psycopg://", 1)
NOW = 1_700_000_000_000
HANDLERS = "examples.isolated_handler"


@dataclass
class Bank:
    storage: SqlStorage
    engine: sa.Engine
    schema: str | None

    def balance(self, key: str) -> int:
        """What any reader of the table sees."""
        accounts = f'"{self.schema}".accounts' if self.schema else "accounts"
        with self.engine.connect() as conn:
            found = conn.execute(
                sa.text(f"SELECT balance FROM {accounts} WHERE id = :k"), {"k": key}
            ).scalar_one()
        return int(found)

    def holds(self) -> list[tuple[Any, ...]]:
        from examples.isolated_handler import HOLDS

        holds = f'"{self.schema}".{HOLDS}' if self.schema else HOLDS
        with self.engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(f"SELECT key, tx_id FROM {holds}"))]

    def run(self, item: Requested | DecisionArrived) -> Report:
        (report,) = self.storage.execute([item])
        return report


def _bank(url: str, schema: str | None) -> Iterator[Bank]:
    from examples.isolated_handler import create_holds_table

    engine = sa.create_engine(url)
    if schema is not None:
        with engine.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    accounts = f'"{schema}".accounts' if schema else "accounts"
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {accounts} (id text PRIMARY KEY, balance bigint)"))
        conn.execute(sa.text(f"INSERT INTO {accounts} VALUES ('x', 100), ('y', 5)"))
    create_holds_table(engine, schema)
    storage = SqlStorage(
        "wallet", url, ["accounts"], schema=schema, handlers=load_handlers(HANDLERS)
    )
    try:
        storage.setup()
        yield Bank(storage, engine, schema)
    finally:
        storage.close()
        if schema is not None:
            with engine.begin() as conn:
                conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        engine.dispose()


@pytest.fixture(params=["postgresql", "sqlite"])
def bank(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Bank]:
    if request.param == "postgresql":
        yield from _bank(POSTGRES_URL, f"t_{uuid.uuid4().hex[:12]}")
    else:
        yield from _bank(f"sqlite:///{tmp_path / 'bank.db'}", None)


def set_balance(tx_id: str, key: str, balance: int) -> Requested:
    return Requested(
        tx_id=tx_id,
        step=0,
        action="set_balance",
        args={"key": key, "balance": balance},
        mode=Mode.PARALLEL,
        n_steps=1,
        deadline_ms=NOW + 60_000,
        now_ms=NOW,
        isolation=Isolation.READ_COMMITTED,
    )


def decided(tx_id: str, outcome: Outcome) -> DecisionArrived:
    return DecisionArrived(tx_id, outcome, NOW + 1_000)


def test_two_sagas_on_one_key(bank: Bank) -> None:
    # T1 holds x: readers still see 100, and its applied event promises a confirmation.
    applied = bank.run(set_balance("t1", "x", 500))
    assert (applied.status, applied.confirm) == (StepStatus.APPLIED, True), applied
    assert bank.balance("x") == 100, "dirty read: T1 has not committed"
    assert bank.holds() == [("x", "t1")]

    # T2 on the same record fails at once, naming the holder; another record is free.
    refused = bank.run(set_balance("t2", "x", 7))
    assert refused.status is StepStatus.FAILED
    assert refused.reason == (
        "accounts/x is held by saga t1 (step 0) until its decision; retry after it"
    )
    assert bank.run(set_balance("t3", "y", 6)).status is StepStatus.APPLIED
    assert bank.balance("x") == 100

    # T1's commit writes what it held; readers see it as soon as it is reported committed.
    assert bank.run(decided("t1", Outcome.COMMIT)).status is StepStatus.COMMITTED
    assert bank.balance("x") == 500
    # A repeated commit writes nothing again.
    assert bank.storage.execute([decided("t1", Outcome.COMMIT)])[0].status is (StepStatus.COMMITTED)
    assert bank.balance("x") == 500

    # T2 rolls back (nothing to undo); a retry holds x now, and its rollback leaves x alone.
    assert bank.run(decided("t2", Outcome.ROLLBACK)).status is StepStatus.COMPENSATED
    assert bank.run(set_balance("t4", "x", 9)).status is StepStatus.APPLIED
    assert bank.balance("x") == 500
    assert bank.run(decided("t4", Outcome.ROLLBACK)).status is StepStatus.COMPENSATED
    assert bank.balance("x") == 500
    assert bank.run(decided("t3", Outcome.ROLLBACK)).status is StepStatus.COMPENSATED
    assert bank.balance("y") == 5
    assert bank.holds() == [], "a hold outlived its saga's decision"


def test_a_missing_record_is_refused(bank: Bank) -> None:
    refused = bank.run(set_balance("t1", "nobody", 1))
    assert (refused.status, refused.reason) == (StepStatus.FAILED, "accounts/nobody does not exist")
    assert bank.holds() == []


def test_the_step_is_known_only_inside_a_handler() -> None:
    from saga.participants import current_step

    with pytest.raises(RuntimeError, match="only known inside a handler"):
        current_step()
