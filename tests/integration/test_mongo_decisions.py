"""Decision documents on the real MongoDB-wire server (FerretDB locally): a decision whose
write was idempotent is recorded by a small document inserted with the batch's others,
beside its step document, and every reader of the ledger applies it (the storage after
a restart, its ledger audit, pruning and the reconcile job's reader)."""

from __future__ import annotations

import pytest

from saga.participants._barrier import LedgerStatus
from saga.streams.reconcile._sources import _mongo_ledger_rows
from tests.integration._mongo_store import (
    APPLIED,
    COMMITTED,
    COMPENSATED,
    Store,
    commit,
    inc,
    rollback,
    status,
    store,
)
from tests.integration.test_sql_storage import DEADLINE

pytestmark = pytest.mark.integration

__all__ = ["store"]  # the fixture


def ledger_status(store: Store, doc_id: str) -> str | None:
    doc = store.db["saga_ledger"].find_one({"_id": doc_id})
    return None if doc is None else doc.get("status", doc.get("set", {}).get("status"))


def test_every_reader_applies_a_decision_document(store: Store) -> None:
    assert status(store.run(inc("t1", "x", 5), inc("t2", "y", -5, min=0))) == [
        ("t1", 0, APPLIED),
        ("t2", 0, APPLIED),
    ]
    assert status(store.run(commit("t1"), rollback("t2"))) == [
        ("t1", 0, COMMITTED),
        ("t2", 0, COMPENSATED),
    ]
    # The step documents as the apply wrote them, each decision in a document of its own.
    assert [ledger_status(store, f"bank:{tx}:0") for tx in ("t1", "t2")] == ["applied"] * 2
    assert [ledger_status(store, f"bank:{tx}:0/d") for tx in ("t1", "t2")] == [
        "committed",
        "compensated",
    ]

    restarted = store.make(shared=type(store.storage.shared)())
    decided = [(e.tx_id, e.status) for e in restarted.ledger()]
    assert decided == [("t1", LedgerStatus.COMMITTED), ("t2", LedgerStatus.COMPENSATED)]
    assert [e.status for e in restarted.ledger("t2")] == [LedgerStatus.COMPENSATED]
    # Redelivered after the restart, the decisions find their steps decided: nothing moves.
    assert status(restarted.execute([commit("t1"), rollback("t2")])) == [
        ("t1", 0, COMMITTED),
        ("t2", 0, COMPENSATED),
    ]
    assert (store.balance("x"), store.balance("y")) == (5, 50)
    assert not store.reserved("x") and not store.reserved("y")

    rows = _mongo_ledger_rows(store.url, store.db.name, "saga_ledger", "mongo")
    assert sorted((row[2], row[4], row[5]) for row in rows) == [
        ("t1", "committed", True),
        ("t2", "compensated", True),
    ]

    assert restarted.prune(DEADLINE + 10**9, 100) == 2
    assert list(store.db["saga_ledger"].find({})) == []
    assert list(store.db["saga_ledger_tx"].find({})) == []


def test_an_undecided_step_keeps_its_transaction_and_the_decisions_beside_it(
    store: Store,
) -> None:
    assert status(store.run(inc("t1", "x", 5), inc("t2", "x", 7))) == [
        ("t1", 0, APPLIED),
        ("t2", 0, APPLIED),
    ]
    assert status(store.run(commit("t1"))) == [("t1", 0, COMMITTED)]
    # t2 still reserves: pruning keeps it whatever the horizon, and removes t1 with its
    # decision document.
    assert store.storage.prune(DEADLINE + 10**9, 100) == 1
    ids = sorted(doc["_id"] for doc in store.db["saga_ledger"].find({}))
    assert ids == ["bank:t2:0"]
    assert status(store.run(commit("t2"))) == [("t2", 0, COMMITTED)]
    assert store.balance("x") == 12
    assert store.storage.prune(DEADLINE + 10**9, 100) == 1
    assert list(store.db["saga_ledger"].find({})) == []
