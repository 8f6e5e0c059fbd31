"""Isolation on the MongoDB storage (DESIGN §9), against the real MongoDB-wire server
(FerretDB locally: no multi-document transactions, read-then-write updates).

The storage is driven through its real API (``execute`` of work items); business
documents are read with plain pymongo, as any reader of the store would.
``read_committed``: no dirty read, no dirty spend, no lost update, holds fail fast
naming the holder, reservations of different sagas never conflict, decisions are
idempotent, concurrent workers never pass an escrow check beyond the bound. ``none``:
a compensation that would lose an update or break a bound ends ``compensation_failed``.
"""

from __future__ import annotations

import threading
from typing import Any

import pymongo
import pymongo.monitoring
import pytest

from saga.participants._barrier import LedgerStatus, PredecessorApplied, Requested
from saga.participants._storage import Report
from saga.participants.mongo import MongoStorage
from saga.participants.mongo._batch import BatchWrites
from saga.participants.mongo._unit import _MongoUnit
from saga.streams import Mode, StepStatus
from tests.integration._mongo_store import (
    APPLIED,
    COMMITTED,
    COMPENSATED,
    NONE,
    RC,
    Store,
    commit,
    inc,
    one,
    rollback,
    status,
    step,
    store,
    update,
)
from tests.integration.test_sql_storage import DEADLINE, NOW

pytestmark = pytest.mark.integration

__all__ = ["store"]  # the fixture


def held(where: str, tx_id: str, at: int = 0) -> str:
    return f"{where} is held by saga {tx_id} (step {at}) until its decision; retry after it"


# ---------------------------------------------------------------- read_committed


def test_no_dirty_read_of_an_increment_or_an_insert(store: Store) -> None:
    got = one(store.run(inc("t1", "x", 100)))
    assert (got.status, got.confirm) == (APPLIED, True)
    new = {"target": "accounts", "key": "n", "value": {"balance": 7}}
    assert status(store.run(step("t2", "insert", new))) == [("t2", 0, APPLIED)]
    # Any reader of the store: the committed values only, no pending insert.
    assert store.db["accounts"].find_one({"_id": "x"})["balance"] == 0
    assert store.db["accounts"].find_one({"_id": "n"}) is None
    assert sorted(d["_id"] for d in store.db["accounts"].find({})) == ["x", "y"]
    assert store.run(commit("t1"), commit("t2")) == [
        Report("t1", 0, COMMITTED),
        Report("t2", 0, COMMITTED),
    ]
    assert store.find("accounts", "x") == {"_id": "x", "balance": 100}
    assert store.find("accounts", "n") == {"_id": "n", "balance": 7}
    assert list(store.db["saga_ledger_holds"].find({})) == []
    statuses = {e.tx_id: e.status for e in store.storage.ledger()}
    assert statuses == {"t1": LedgerStatus.COMMITTED, "t2": LedgerStatus.COMMITTED}


def test_no_dirty_spend_and_no_broken_bound(store: Store) -> None:
    assert one(store.run(inc("t1", "x", 100))).status is APPLIED
    spend = one(store.run(inc("t2", "x", -100, min=0)))
    assert spend.status is StepStatus.FAILED
    assert spend.reason == "accounts/x balance would be -100, below the minimum 0"
    assert status(store.run(rollback("t2"), rollback("t1"))) == [
        ("t2", 0, COMPENSATED),
        ("t1", 0, COMPENSATED),
    ]
    assert store.find("accounts", "x") == {"_id": "x", "balance": 0}
    assert not store.reserved("x")  # no reservation


def test_escrow_counts_open_debits_of_other_sagas(store: Store) -> None:
    assert one(store.run(inc("t1", "y", -30, min=0))).status is APPLIED
    assert one(store.run(inc("t2", "y", -20, min=0))).status is APPLIED
    third = one(store.run(inc("t3", "y", -1, min=0)))
    assert third.reason == (
        "accounts/y balance would be -1 once the open reservations of other sagas (-50) "
        "commit, below the minimum 0"
    )
    assert status(store.run(commit("t1"), rollback("t2"))) == [
        ("t1", 0, COMMITTED),
        ("t2", 0, COMPENSATED),
    ]
    assert store.balance("y") == 20


def test_no_lost_update(store: Store) -> None:
    assert one(store.run(update("t3", "k", 7))).status is APPLIED
    assert store.qty() == 5
    late = one(store.run(update("t4", "k", 9)))
    assert (late.status, late.reason) == (StepStatus.FAILED, held("orders/k", "t3"))
    also = one(store.run(update("t5", "k", 9, level=NONE)))  # `none` respects holds too
    assert (also.status, also.reason) == (StepStatus.FAILED, held("orders/k", "t3"))
    assert status(store.run(rollback("t4"), rollback("t5"), rollback("t3"))) == [
        ("t4", 0, COMPENSATED),
        ("t5", 0, COMPENSATED),
        ("t3", 0, COMPENSATED),
    ]
    assert store.find("orders", "k") == {"_id": "k", "item": "book", "qty": 5}
    # Free again: the next saga's update goes through.
    assert one(store.run(update("t6", "k", 9))).status is APPLIED
    assert one(store.run(commit("t6"))).status is COMMITTED
    assert store.qty() == 9


def test_insert_put_and_delete_hold_the_record(store: Store) -> None:
    new = {"target": "accounts", "key": "n", "value": {"balance": 1}}
    assert one(store.run(step("t1", "insert", new))).status is APPLIED
    for tx_id, action, level in [("t2", "insert", RC), ("t3", "put", RC), ("t4", "put", NONE)]:
        got = one(store.run(step(tx_id, action, new, level=level)))
        assert (got.status, got.reason) == (StepStatus.FAILED, held("accounts/n", "t1"))
    assert one(store.run(commit("t1"))).status is COMMITTED
    assert store.find("accounts", "n") == {"_id": "n", "balance": 1}

    gone = {"target": "accounts", "key": "n"}
    assert one(store.run(step("t5", "delete", gone))).status is APPLIED
    assert store.find("accounts", "n") == {"_id": "n", "balance": 1}  # until commit
    bump = one(store.run(inc("t6", "n", 1)))
    assert (bump.status, bump.reason) == (StepStatus.FAILED, held("accounts/n", "t5"))
    assert one(store.run(commit("t5"))).status is COMMITTED
    assert store.find("accounts", "n") is None

    put = {"target": "accounts", "key": "y", "value": {"balance": 1, "owner": "z"}}
    assert one(store.run(step("t7", "put", put))).status is APPLIED
    other = one(store.run(inc("t8", "y", 1)))
    assert (other.status, other.reason) == (StepStatus.FAILED, held("accounts/y", "t7"))
    assert one(store.run(rollback("t7"))).status is COMPENSATED
    assert store.find("accounts", "y") == {"_id": "y", "balance": 50}


def test_a_hold_waits_for_no_one_and_open_reservations_refuse_it(store: Store) -> None:
    assert one(store.run(inc("t1", "y", 5))).status is APPLIED
    got = one(store.run(step("t2", "delete", {"target": "accounts", "key": "y"})))
    assert got.reason == (
        "accounts/y has an open reservation of saga t1 (step 0) until its decision; retry after it"
    )
    assert one(store.run(commit("t1"))).status is COMMITTED
    assert store.balance("y") == 55


def test_holds_and_reservations_within_one_batch(store: Store) -> None:
    """Steps of several sagas in one batch (whose new transactions go in together) see
    each other's holds and reservations as if they came one by one."""
    new = {"target": "accounts", "key": "n", "value": {"balance": 1}}
    got = store.run(
        step("t1", "insert", new),
        step("t2", "insert", new),
        step("t3", "put", new, level=NONE),
        inc("t4", "x", 5),
        inc("t5", "x", -5, min=0),
    )
    assert [(r.tx_id, r.status) for r in got] == [
        ("t1", APPLIED),
        ("t2", StepStatus.FAILED),
        ("t3", StepStatus.FAILED),
        ("t4", APPLIED),
        ("t5", StepStatus.FAILED),
    ]
    assert got[1].reason == got[2].reason == held("accounts/n", "t1")
    assert got[4].reason == "accounts/x balance would be -5, below the minimum 0"
    assert (store.find("accounts", "n"), store.balance("x")) == (None, 0)
    assert [r.status for r in store.run(commit("t1"), commit("t4"))] == [COMMITTED] * 2
    assert (store.find("accounts", "n"), store.balance("x")) == ({"_id": "n", "balance": 1}, 5)


def test_a_sequential_step_holds_once_its_predecessor_applied(store: Store) -> None:
    second = Requested(
        "t1", 1, "update", {"target": "orders", "key": "k", "set": {"qty": 1}},
        Mode.SEQUENTIAL, 2, DEADLINE, NOW,
    )  # fmt: skip
    first = Requested(
        "t1", 0, "increment", {"target": "accounts", "key": "x", "field": "balance", "by": 3},
        Mode.SEQUENTIAL, 2, DEADLINE, NOW,
    )  # fmt: skip
    assert store.run(second) == []  # waits for its predecessor
    assert status(store.run(first)) == [("t1", 0, APPLIED)]
    assert status(store.run(PredecessorApplied("t1", 1, NOW))) == [("t1", 1, APPLIED)]
    late = one(store.run(update("t2", "k", 9)))
    assert late.reason == held("orders/k", "t1", 1)
    assert (store.balance("x"), store.qty()) == (0, 5)
    assert status(store.run(commit("t1"))) == [("t1", 0, COMMITTED), ("t1", 1, COMMITTED)]
    assert (store.balance("x"), store.qty()) == (3, 1)


def test_steps_of_one_saga_on_one_record_are_compatible(store: Store) -> None:
    qty = {"target": "orders", "key": "k", "field": "qty"}
    actions = [
        ("increment", {**qty, "by": 2}),
        ("update", {"target": "orders", "key": "k", "set": {"item": "pen"}}),
        ("increment", {**qty, "by": 3}),
        ("insert", {"target": "accounts", "key": "n", "value": {"balance": 1}}),
        ("increment", {"target": "accounts", "key": "n", "field": "balance", "by": 4}),
    ]
    steps = [step("t1", a, args, step=i, n_steps=5) for i, (a, args) in enumerate(actions)]
    assert [r.status for r in store.run(*steps)] == [APPLIED] * 5
    assert store.find("orders", "k") == {"_id": "k", "item": "book", "qty": 5}
    assert store.find("accounts", "n") is None
    assert [r.status for r in store.run(commit("t1"))] == [COMMITTED] * 5
    assert store.find("orders", "k") == {"_id": "k", "item": "pen", "qty": 10}
    assert store.find("accounts", "n") == {"_id": "n", "balance": 5}


def test_reservations_of_many_sagas_on_one_hot_record_all_go_through(store: Store) -> None:
    credits = [inc(f"t{i}", "x", 10, max=1_000) for i in range(8)]
    assert [r.status for r in store.run(*credits)] == [APPLIED] * 8
    decisions = [commit(f"t{i}") if i % 2 else rollback(f"t{i}") for i in range(8)]
    assert [r.status for r in store.run(*decisions)] == [COMPENSATED, COMMITTED] * 4
    assert store.balance("x") == 40
    assert not store.reserved("x")  # no reservation


def test_repeated_decisions_take_effect_once(store: Store) -> None:
    assert one(store.run(inc("t1", "x", 100))).status is APPLIED
    assert one(store.run(update("t2", "k", 7))).status is APPLIED
    first = store.run(commit("t1"), commit("t1"), rollback("t2"), rollback("t2"))
    assert status(first) == [
        ("t1", 0, COMMITTED),
        ("t1", 0, COMMITTED),
        ("t2", 0, COMPENSATED),
        ("t2", 0, COMPENSATED),
    ]
    again = store.make(shared=type(store.storage.shared)())  # a restarted process
    assert status(again.execute([commit("t1"), rollback("t2")])) == status(first[::2])
    assert (store.balance("x"), store.qty()) == (100, 5)


def test_a_crash_between_a_commit_and_its_record_commits_once(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    new = {"target": "accounts", "key": "n", "value": {"balance": 3}}
    assert status(store.run(inc("t1", "x", 100), step("t2", "insert", new))) == [
        ("t1", 0, APPLIED),
        ("t2", 0, APPLIED),
    ]

    def crash(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the process dies after the write, before its record")

    # t1's commit writes idempotently (no intent) and is recorded at the batch's end;
    # t2's creates accounts/n from its shadow document, through an intent.
    with monkeypatch.context() as patch:
        patch.setattr(BatchWrites, "flush_decisions", crash)
        with pytest.raises(RuntimeError):
            store.run(commit("t1"))
    with monkeypatch.context() as patch:
        patch.setattr(_MongoUnit, "_finalise", crash)
        with pytest.raises(RuntimeError):
            store.run(commit("t2"))
    assert [e.status for e in store.storage.ledger()] == [LedgerStatus.APPLIED] * 2
    assert store.balance("x") == 100
    restarted = store.make(intent_lease_ms=0, shared=type(store.storage.shared)())
    assert status(restarted.execute([commit("t1"), commit("t2")])) == [
        ("t1", 0, COMMITTED),
        ("t2", 0, COMMITTED),
    ]
    assert store.find("accounts", "x") == {"_id": "x", "balance": 100}
    assert store.find("accounts", "n") == {"_id": "n", "balance": 3}
    assert list(store.db["saga_ledger_holds"].find({})) == []


def test_none_compensations_refuse_to_overwrite_a_held_or_changed_record(store: Store) -> None:
    gone = {"target": "accounts", "key": "y"}
    assert one(store.run(step("t1", "delete", gone, level=NONE))).status is APPLIED
    made = {"target": "accounts", "key": "y", "value": {"balance": 1}}
    assert one(store.run(step("t2", "insert", made))).status is APPLIED  # held, pending
    undo = one(store.run(rollback("t1")))
    assert undo.status is StepStatus.COMPENSATION_FAILED
    assert undo.reason == (
        "compensation failed: accounts/y is held by saga t2 (step 0) until its decision; "
        "not restored (a replayed rollback tries again)"
    )
    assert one(store.run(rollback("t2"))).status is COMPENSATED
    assert one(store.run(rollback("t1"))).status is COMPENSATED  # replayed: free again
    assert store.find("accounts", "y") == {"_id": "y", "balance": 50}

    new = {"target": "orders", "key": "o", "value": {"qty": 1}}
    assert one(store.run(step("t3", "insert", new, level=NONE))).status is APPLIED
    store.db["orders"].update_one({"_id": "o"}, {"$set": {"qty": 2}})  # someone else
    undo = one(store.run(rollback("t3")))
    assert undo.reason is not None and "orders/o changed since this step wrote it" in undo.reason
    assert store.find("orders", "o") == {"_id": "o", "qty": 2}


def test_a_crash_inside_an_unread_reservation_that_does_not_fit_undoes_it(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reservation written without a read is checked on the document as it was and put
    back when it does not fit; a process dying before the put-back leaves the write done,
    and the next reader undoes it instead of recording it (the bound holds)."""
    assert status(store.run(inc("t0", "x", 5), commit("t0"))) == [
        ("t0", 0, APPLIED),
        ("t0", 0, COMMITTED),
    ]
    real = pymongo.collection.Collection.replace_one

    def dies(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the process dies before putting the document back")

    debit = inc("t1", "x", -10, min=0)
    with monkeypatch.context() as patch:
        patch.setattr(pymongo.collection.Collection, "replace_one", dies)
        with pytest.raises(RuntimeError):
            store.run(debit)
    assert "t1" in str(store.db["accounts"].find_one({"_id": "x"}).get("_saga_res"))
    assert pymongo.collection.Collection.replace_one is real
    restarted = store.make(intent_lease_ms=0, shared=type(store.storage.shared)())
    got = one(restarted.execute([debit]))
    assert (got.status, got.reason) == (
        StepStatus.FAILED,
        "accounts/x balance would be -5, below the minimum 0",
    )
    assert not store.reserved("x")
    assert store.balance("x") == 5


def test_an_open_hold_is_never_pruned(store: Store) -> None:
    assert one(store.run(update("t1", "k", 7))).status is APPLIED
    assert store.storage.prune(DEADLINE + 10**9, 100) == 0
    assert one(store.run(commit("t1"))).status is COMMITTED
    assert store.storage.prune(DEADLINE + 10**9, 100) == 1
    assert store.qty() == 7


def test_concurrent_workers_never_both_pass_an_escrow_check(store: Store) -> None:
    """Two storages (workers) on the same collection, debiting one record from threads."""
    store.db["accounts"].update_one({"_id": "x"}, {"$set": {"balance": 100}})
    workers = [store.storage, store.make()]
    applied: list[str] = []
    mutex = threading.Lock()

    def debit(worker: MongoStorage, n: int) -> None:
        for i in range(12):
            tx_id = f"w{n}-{i}"
            got = one(worker.execute([inc(tx_id, "x", -10, min=0)]))
            if got.status is APPLIED:
                with mutex:
                    applied.append(tx_id)

    threads = [threading.Thread(target=debit, args=(w, n)) for n, w in enumerate(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(applied) == 10  # exactly what the bound allows, never more
    assert [r.status for r in store.run(*map(commit, applied))] == [COMMITTED] * 10
    assert store.balance("x") == 0


# ---------------------------------------------------------------- none


def test_none_lost_update_ends_compensation_failed(store: Store) -> None:
    assert one(store.run(update("t3", "k", 7, level=NONE))).status is APPLIED
    assert store.qty() == 7  # `none` writes at once
    assert one(store.run(update("t4", "k", 9, level=NONE))).status is APPLIED
    assert store.run(commit("t4")) == []
    got = one(store.run(rollback("t3")))
    assert got.status is StepStatus.COMPENSATION_FAILED
    assert got.reason == (
        "compensation failed: orders/k changed since this step wrote it (qty is 9, the step "
        "wrote 7); not restored (a replayed rollback tries again)"
    )
    assert store.qty() == 9


def test_none_broken_bound_ends_compensation_failed(store: Store) -> None:
    assert one(store.run(inc("t1", "x", 100, level=NONE))).status is APPLIED
    assert one(store.run(inc("t2", "x", -100, min=0, level=NONE))).status is APPLIED
    assert store.run(commit("t2")) == []
    got = one(store.run(rollback("t1")))
    assert got.status is StepStatus.COMPENSATION_FAILED
    assert got.reason is not None and got.reason.startswith(
        "compensation failed: accounts/x balance would be -100, below the minimum 0"
    )
    assert store.balance("x") == 0
    [entry] = store.storage.ledger("t1")
    assert entry.status is LedgerStatus.COMPENSATION_FAILED


def test_none_compensation_of_untouched_work_still_restores(store: Store) -> None:
    assert one(store.run(update("t1", "k", 7, level=NONE))).status is APPLIED
    assert one(store.run(inc("t2", "x", -5, min=-10, level=NONE))).status is APPLIED
    assert status(store.run(rollback("t1"), rollback("t2"))) == [
        ("t1", 0, COMPENSATED),
        ("t2", 0, COMPENSATED),
    ]
    assert (store.qty(), store.balance("x")) == (5, 0)
