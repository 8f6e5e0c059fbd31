"""Commits of ``read_committed`` increments settled in PostgreSQL (participants.sql._escrow).

Each test checks both what the store ends with and which path settled the commit (a
spy on :meth:`EscrowCommits.send` records the transactions it was handed), so a test
that expects the database to settle a commit fails when the per-step path did it, and
the other way round.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa

from saga.participants._barrier import LedgerStatus
from saga.participants.sql import _escrow
from saga.participants.sql._adapter import SqlStorage
from saga.streams import Isolation, StepStatus
from tests.integration.test_sql_isolation import bump, holds
from tests.integration.test_sql_storage import (
    DEADLINE,
    NOW,
    SqlHarness,
    commit,
    only_status,
    postgres_database,
    requested,
    sql_harness,
)

pytestmark = pytest.mark.integration

APPLIED, COMMITTED = StepStatus.APPLIED, StepStatus.COMMITTED


@pytest.fixture
def harness() -> Iterator[SqlHarness]:
    with postgres_database() as db, sql_harness(db) as made:
        made.seed("accounts", 3, {"owner": "xavier", "balance": 0, "credit": "1.50"})
        made.seed("accounts", 5, {"owner": "kim", "balance": 5})
        yield made


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> list[set[str]]:
    """The transactions each batch settled in the database."""
    calls: list[set[str]] = []
    send = _escrow.EscrowCommits.send

    def spy(self: _escrow.EscrowCommits, *args: Any) -> Any:
        calls.append(set(self._steps))
        return send(self, *args)

    monkeypatch.setattr(_escrow.EscrowCommits, "send", spy)
    return calls


def row(harness: SqlHarness, target: str, key: Any) -> dict[str, Any]:
    found = harness.record(target, key)
    assert found is not None
    return found


def statuses(storage: SqlStorage, tx_id: str) -> list[LedgerStatus]:
    return [entry.status for entry in storage.ledger(tx_id)]


def test_commits_of_one_hot_record_add_their_sum_once(
    harness: SqlHarness, settled: list[set[str]]
) -> None:
    storage = harness.storage
    assert isinstance(storage, SqlStorage)
    applied = storage.execute(
        [
            requested("T1", "increment", bump(3, 100), n_steps=2),
            requested("T2", "increment", bump(3, -0), n_steps=1),
            requested("T3", "increment", bump(5, -5, min=0)),
            requested("T3", "increment", bump(3, 7), step=1, n_steps=2),
            requested("T4", "increment", {**bump("o-1", -3), "target": "orders", "field": "qty"}),
            requested("T5", "increment", bump(3, 0.25) | {"field": "credit"}),
        ]
    )
    assert {s for *_, s in only_status(applied)} == {APPLIED}
    assert row(harness, "accounts", 3)["balance"] == 0  # nothing committed yet
    assert settled == []

    done = storage.execute([commit("T1"), commit("T2"), commit("T3"), commit("T4"), commit("T5")])

    assert settled == [{"T1", "T2", "T3", "T4", "T5"}]
    assert sorted(only_status(done)) == sorted(
        [
            ("T1", 0, COMMITTED),
            ("T2", 0, COMMITTED),
            ("T3", 0, COMMITTED),
            ("T3", 1, COMMITTED),
            ("T4", 0, COMMITTED),
            ("T5", 0, COMMITTED),
        ]
    )
    assert row(harness, "accounts", 3)["balance"] == 107
    assert row(harness, "accounts", 3)["credit"] == Decimal("1.75")
    assert row(harness, "accounts", 5)["balance"] == 0
    assert row(harness, "orders", "o-1")["qty"] == -2  # 1 - 3: no bound asked
    assert holds(harness.db) == []
    for tx_id in ("T1", "T2", "T4", "T5"):
        assert statuses(storage, tx_id) == [LedgerStatus.COMMITTED]
    assert statuses(storage, "T3") == [LedgerStatus.COMMITTED] * 2
    ledger = f"{harness.db.schema}.saga_ledger"
    with harness.db.engine.connect() as connection:
        written = connection.execute(
            sa.text(f"SELECT status, updated_ms, finished_ms FROM {ledger} WHERE tx_id = 'T3'")
        ).all()
    # as the per-step path writes them: finished at the later of the deadline and now
    assert written == [("committed", NOW + 1_000, max(DEADLINE, NOW + 1_000))] * 2

    # A replayed decision finds its steps committed: reported again, nothing added.
    again = storage.execute([commit("T1")])
    assert only_status(again) == [("T1", 0, COMMITTED)]
    assert row(harness, "accounts", 3)["balance"] == 107
    assert len(settled) == 1


def test_a_commit_beside_another_item_on_its_record_takes_the_per_step_path(
    harness: SqlHarness, settled: list[set[str]]
) -> None:
    """T2's debit in the same batch reads accounts/3 after T1's commit (items in order):
    the batch's copy of the row must not be read before the addition, so T1's commit runs
    through the copy; T3's, on another record, is settled in the database."""
    storage = harness.storage
    storage.execute(
        [requested("T1", "increment", bump(3, 100)), requested("T3", "increment", bump(5, 1))]
    )
    done = storage.execute(
        [commit("T1"), requested("T2", "increment", bump(3, -100, min=0)), commit("T3")]
    )
    assert only_status(done) == [("T1", 0, COMMITTED), ("T2", 0, APPLIED), ("T3", 0, COMMITTED)]
    assert settled == [{"T3"}]
    assert row(harness, "accounts", 3)["balance"] == 100
    assert row(harness, "accounts", 5)["balance"] == 6
    storage.execute([commit("T2")])
    assert row(harness, "accounts", 3)["balance"] == 0


def test_a_transaction_with_another_item_in_the_batch_takes_the_per_step_path(
    harness: SqlHarness, settled: list[set[str]]
) -> None:
    storage = harness.storage
    storage.execute([requested("T1", "increment", bump(3, 10), n_steps=2)])
    done = storage.execute(
        [requested("T1", "increment", bump(5, 1), step=1, n_steps=2), commit("T1")]
    )
    assert only_status(done) == [("T1", 1, APPLIED), ("T1", 0, COMMITTED), ("T1", 1, COMMITTED)]
    assert settled == []
    assert row(harness, "accounts", 3)["balance"] == 10
    assert row(harness, "accounts", 5)["balance"] == 6


def test_a_commit_of_a_held_record_or_a_none_step_takes_the_per_step_path(
    harness: SqlHarness, settled: list[set[str]]
) -> None:
    storage = harness.storage
    held = {"target": "accounts", "key": 3, "set": {"owner": "al"}}
    storage.execute(
        [
            requested("T1", "update", held),
            requested("T2", "increment", bump(5, 1), isolation=Isolation.NONE),
        ]
    )
    assert row(harness, "accounts", 5)["balance"] == 6  # none: at once
    done = storage.execute([commit("T1"), commit("T2")])
    assert only_status(done) == [("T1", 0, COMMITTED)]  # a none step has nothing to confirm
    assert settled == []
    assert row(harness, "accounts", 3)["owner"] == "al"
    assert row(harness, "accounts", 5)["balance"] == 6


def test_a_row_deleted_while_reserved_gets_nothing_and_the_log_says_so(
    harness: SqlHarness, settled: list[set[str]], caplog: pytest.LogCaptureFixture
) -> None:
    storage = harness.storage
    storage.execute(
        [
            requested("T1", "increment", bump(5, 2)),
            requested("T2", "increment", bump(3, 1) | {"field": "credit"}),
        ]
    )
    db = harness.db
    accounts = db.tables["accounts"]
    with db.engine.begin() as connection:  # behind the product's back
        connection.execute(sa.delete(accounts).where(accounts.c.id == 5))
        connection.execute(sa.update(accounts).where(accounts.c.id == 3).values(credit=None))
    with caplog.at_level(logging.WARNING, logger="saga.participant"):
        done = storage.execute([commit("T1"), commit("T2")])
    assert settled == [{"T1", "T2"}]
    assert only_status(done) == [("T1", 0, COMMITTED), ("T2", 0, COMMITTED)]
    assert harness.record("accounts", 5) is None
    assert row(harness, "accounts", 3)["credit"] is None
    warned = [r.getMessage() for r in caplog.records if "found nothing to write" in r.getMessage()]
    assert len(warned) == 2
    assert any("accounts/5" in w and "T1" in w for w in warned)
    assert holds(db) == []
    assert statuses(storage, "T1") == [LedgerStatus.COMMITTED]


def test_a_reservation_gone_already_adds_nothing(
    harness: SqlHarness, settled: list[set[str]]
) -> None:
    """The per-step path's rule: a reservation already removed means committed already. The
    statement adds nothing then, and the batch runs again carefully (the per-step path)."""
    storage = harness.storage
    storage.execute([requested("T1", "increment", bump(3, 40))])
    table = sa.Table(
        "saga_ledger_holds", sa.MetaData(schema=harness.db.schema), autoload_with=harness.db.engine
    )
    with harness.db.engine.begin() as connection:
        connection.execute(sa.delete(table).where(table.c.tx_id == "T1"))
    done = storage.execute([commit("T1")])
    assert settled == [{"T1"}]
    assert only_status(done) == [("T1", 0, COMMITTED)]
    assert row(harness, "accounts", 3)["balance"] == 0
