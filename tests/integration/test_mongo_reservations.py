"""How the MongoDB storage writes reservations under ``read_committed``, against the real
MongoDB-wire server (FerretDB locally): the commands of the hot path, a reservation's
shape in the document (and the earlier one, still read), and writes made without a
read meeting a document another process changed."""

from __future__ import annotations

from typing import Any

import pymongo
import pytest

from saga.participants.mongo import MongoStorage
from saga.participants.mongo import _adapter as mongo_adapter
from saga.streams import StepStatus
from tests.integration._mongo_commands import Commands
from tests.integration._mongo_store import (
    APPLIED,
    COMMITTED,
    COMPENSATED,
    Store,
    commit,
    inc,
    one,
    rollback,
    status,
    store,
)

pytestmark = pytest.mark.integration

__all__ = ["store"]  # the fixture


def listened(store: Store, monkeypatch: pytest.MonkeyPatch) -> tuple[Commands, MongoStorage]:
    """A storage of ``store`` whose commands are recorded (see :class:`Commands`)."""
    commands = Commands()
    real = mongo_adapter.MongoClient
    monkeypatch.setattr(
        mongo_adapter,
        "MongoClient",
        lambda *args, **kwargs: real(*args, event_listeners=[commands], **kwargs),
    )
    return commands, store.make()


def test_the_hot_path_of_an_increment(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once this process has written a document, a reservation is one update of it (no
    read); the batch's commits are one bulk of conditional updates (the server looks each
    up by _id), then their decision records one insert."""
    commands, storage = listened(store, monkeypatch)
    first = [inc("t0", "x", 1), inc("t1", "y", 1)]
    assert [r.status for r in storage.execute(first)] == [APPLIED] * 2
    assert [r.status for r in storage.execute([commit("t0"), commit("t1")])] == [COMMITTED] * 2
    commands.seen.clear()
    assert [r.status for r in storage.execute([inc("t2", "x", 5), inc("t3", "y", -5, min=0)])] == [
        APPLIED
    ] * 2
    assert commands.seen == [
        ("insert", "saga_ledger_tx", ["bank:t2", "bank:t3"]),
        ("findAndModify", "accounts", ["x"]),
        ("findAndModify", "accounts", ["y"]),
        ("insert", "saga_ledger", ["bank:t2:0", "bank:t3:0"]),
    ]
    commands.seen.clear()
    assert [r.status for r in storage.execute([commit("t2"), commit("t3")])] == [COMMITTED] * 2
    assert commands.seen == [
        # the batch's commits, one bulk of updates by _id, each conditional (the server
        # checks before it writes: _batch.flush_writes)
        ("update", "accounts", ["x", "y"]),
        # then their decision records, one insert (_batch.flush_decisions)
        ("insert", "saga_ledger", ["bank:t2:0/d", "bank:t3:0/d"]),
    ]
    assert (store.balance("x"), store.balance("y")) == (6, 46)
    assert commands.scans == []


def test_a_commit_known_wrong_never_shows_its_amount_twice(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit of a reservation another process committed since: no reader ever sees the
    amount added twice by a write put back after (the chaos tier saw 641, 700, 641)."""
    assert status(store.run(inc("t1", "x", 1)) + store.run(commit("t1")))[-1][2] is COMMITTED
    assert one(store.run(inc("t2", "x", 59))).status is APPLIED  # this process knows x
    other = store.make(shared=type(store.storage.shared)())  # another process
    assert one(other.execute([commit("t2")])).status is COMMITTED
    seen: list[Any] = []
    for name in ("find_one_and_update", "update_one", "bulk_write"):
        real = getattr(pymongo.collection.Collection, name)

        def spy(self: Any, *args: Any, real: Any = real, **kwargs: Any) -> Any:
            found = real(self, *args, **kwargs)
            seen.append(store.balance("x"))  # what a reader sees right after each write
            return found

        monkeypatch.setattr(pymongo.collection.Collection, name, spy)
    # Its memory of t2's ledger is stale too: it finds nothing left to write and records
    # the same entry as the other process did.
    assert one(store.run(commit("t2"))).status is COMMITTED
    assert store.balance("x") == 60 and seen and set(seen) <= {60}


def test_a_reservation_is_one_number_grouped_by_field(store: Store) -> None:
    """A hot record carries one number per open reservation (FerretDB's cost per command
    grows with the document), and the last one settled leaves no reservation behind."""
    assert status(store.run(inc("t1", "x", 5), inc("t2", "x", -3, min=-10))) == [
        ("t1", 0, APPLIED),
        ("t2", 0, APPLIED),
    ]
    doc = store.db["accounts"].find_one({"_id": "x"})
    assert doc["_saga_res"] == {"balance": {"bank:t1:0": 5, "bank:t2:0": -3}}
    assert status(store.run(commit("t1"), rollback("t2"))) == [
        ("t1", 0, COMMITTED),
        ("t2", 0, COMPENSATED),
    ]
    assert store.balance("x") == 5 and not store.reserved("x")


def test_reservations_in_the_earlier_shape_count_and_settle(store: Store) -> None:
    """A document written by an earlier version (``_saga_res.<step id>: {step, tx, field,
    by}``) while its sagas were open: the escrow check counts its reservations, and their
    decisions commit or release them where they are."""
    store.db["accounts"].update_one({"_id": "y"}, {"$set": {"balance": 100}})
    assert status(store.run(inc("t1", "y", -60, min=0), inc("t2", "y", -30, min=0))) == [
        ("t1", 0, APPLIED),
        ("t2", 0, APPLIED),
    ]
    earlier = {
        step_id.replace(".", "%2E"): {
            "step": step_id,
            "tx": step_id.split(":")[1],
            "field": "balance",
            "by": by,
        }
        for step_id, by in (("bank:t1:0", -60), ("bank:t2:0", -30))
    }
    store.db["accounts"].update_one({"_id": "y"}, {"$set": {"_saga_res": earlier}})
    later = store.make(shared=type(store.storage.shared)())  # a process after the upgrade
    refused = one(later.execute([inc("t3", "y", -20, min=0)]))
    assert (refused.status, refused.reason) == (
        StepStatus.FAILED,
        "accounts/y balance would be -10 once the open reservations of other sagas (-90) "
        "commit, below the minimum 0",
    )
    assert status(later.execute([commit("t1"), rollback("t2")])) == [
        ("t1", 0, COMMITTED),
        ("t2", 0, COMPENSATED),
    ]
    assert store.balance("y") == 40 and not store.reserved("y")


def test_a_document_changed_by_another_process_is_read_again(store: Store) -> None:
    """An update made without reading (this process knew the document's marker) finds the
    document written by another process since: it is put back, and the step runs again,
    reading; fractions are added in decimal, after a read."""
    store.db["accounts"].insert_one({"_id": "z", "balance": 10.5})
    assert one(store.run(inc("t1", "z", 1))).status is APPLIED
    assert one(store.run(commit("t1"))).status is COMMITTED  # this process knows z now
    other = store.make(shared=type(store.storage.shared)())  # another process
    assert one(other.execute([inc("t2", "z", 2)])).status is APPLIED
    assert one(store.run(inc("t3", "z", 0.1))).status is APPLIED
    assert status(other.execute([commit("t2")]) + store.run(commit("t3"))) == [
        ("t2", 0, COMMITTED),
        ("t3", 0, COMMITTED),
    ]
    assert store.balance("z") == 13.6
    assert not store.reserved("z")


def test_a_server_that_scans_such_filters_has_the_commit_read_first(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stock FerretDB decodes the whole collection for a filter naming more than _id:
    there a commit reads the document, then writes it by _id alone, checked client-side."""
    commands, storage = listened(store, monkeypatch)
    storage.setup()
    if not storage.ferretdb:
        pytest.skip("a MongoDB server checks every filter itself")
    storage.narrows_by_id = False  # as a stock FerretDB v1 answers explain
    assert [r.status for r in storage.execute([inc("t1", "x", 2)])] == [APPLIED]
    commands.seen.clear()
    assert [r.status for r in storage.execute([commit("t1")])] == [COMMITTED]
    assert commands.seen == [
        ("find", "accounts", ["x"]),
        ("findAndModify", "accounts", ["x"]),
        ("insert", "saga_ledger", ["bank:t1:0/d"]),
    ]
    assert commands.scans == [] and store.balance("x") == 2


def test_a_bulk_of_commits_with_one_known_wrong_runs_the_batch_again(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two commits in one bulk, one of a reservation another process committed since: the
    other commit takes effect once, the stale one writes nothing, and the batch's second
    attempt (item by item, reading) records both; no reader sees an amount twice."""
    assert status(store.run(inc("t1", "x", 1), inc("t2", "y", 1))) == [
        ("t1", 0, APPLIED),
        ("t2", 0, APPLIED),
    ]
    assert status(store.run(commit("t1"), commit("t2"))) == [
        ("t1", 0, COMMITTED),
        ("t2", 0, COMMITTED),
    ]
    assert status(store.run(inc("t3", "x", 59), inc("t4", "y", 9))) == [
        ("t3", 0, APPLIED),
        ("t4", 0, APPLIED),
    ]
    other = store.make(shared=type(store.storage.shared)())  # another process
    assert one(other.execute([commit("t3")])).status is COMMITTED
    seen: list[Any] = []
    real = pymongo.collection.Collection.bulk_write

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        found = real(self, *args, **kwargs)
        seen.append((store.balance("x"), store.balance("y")))
        return found

    monkeypatch.setattr(pymongo.collection.Collection, "bulk_write", spy)
    assert status(store.run(commit("t3"), commit("t4"))) == [
        ("t3", 0, COMMITTED),
        ("t4", 0, COMMITTED),
    ]
    assert seen == [(60, 60)]  # the one bulk: t4's commit took effect, t3's wrote nothing
    assert (store.balance("x"), store.balance("y")) == (60, 60)
    assert not store.reserved("x") and not store.reserved("y")


def test_commits_go_in_bulks_of_at_most_32(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """FerretDB v1 holds a connection per statement until its command ends (its pool has
    100): a batch's commits go in bulks of at most WRITES_PER_BULK updates."""
    commands, storage = listened(store, monkeypatch)
    storage.setup()
    keys = [f"k{i:02d}" for i in range(40)]
    store.db["accounts"].insert_many([{"_id": key, "balance": 0} for key in keys])
    first = [inc(f"a{i}", key, 1) for i, key in enumerate(keys)]
    assert {r.status for r in storage.execute(first)} == {APPLIED}
    assert {r.status for r in storage.execute([commit(f"a{i}") for i in range(40)])} == {COMMITTED}
    again = [inc(f"b{i}", key, 2) for i, key in enumerate(keys)]
    assert {r.status for r in storage.execute(again)} == {APPLIED}
    commands.seen.clear()
    assert {r.status for r in storage.execute([commit(f"b{i}") for i in range(40)])} == {COMMITTED}
    bulks = [ids for name, target, ids in commands.seen if (name, target) == ("update", "accounts")]
    if storage.ferretdb:
        assert [len(ids) for ids in bulks] == [32, 8]
    assert [store.balance(key) for key in keys] == [3] * 40
