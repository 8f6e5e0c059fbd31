"""Isolation on the Redis participant (DESIGN.md §9), against a real Redis.

Every case runs on two storages over one Redis (two key prefixes): the script path
(:mod:`participants.redis._batch`) and the per-step WATCH/MULTI/EXEC path
(``scripts=False``); each batch must give both the same reports, records, side hashes
and ledgers (:meth:`Twin.run`). Records are read with a plain ``HGETALL``, as any reader
of the store would. Most cases run their items one batch at a time and again as one
batch of several items (``batched``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, cast

import pytest
import redis

from saga.participants._barrier import LedgerStatus, Requested
from saga.participants._storage import DecisionArrived, Report, WorkItem
from saga.participants.redis._adapter import RedisStorage
from saga.streams import Isolation, Mode, Outcome, StepStatus
from tests._infra import Services

pytestmark = pytest.mark.integration

NOW = 1_700_000_000_000
DEADLINE = NOW + 60_000
RC = Isolation.READ_COMMITTED
NONE = Isolation.NONE
TARGETS = ("accounts",)


def req(
    tx_id: str,
    action: str,
    args: dict[str, Any],
    isolation: Isolation = RC,
    *,
    step: int = 0,
    n_steps: int = 2,
) -> Requested:
    """A parallel step; ``n_steps`` 2 by default: the saga has a step elsewhere too, so it
    stays open here until its decision comes."""
    return Requested(
        tx_id,
        step,
        action,
        args,
        Mode.PARALLEL,
        n_steps,
        DEADLINE,
        NOW,
        fingerprint=f"fp-{tx_id}",
        isolation=isolation,
    )


def bump(key: str, by: int | float, **bounds: Any) -> dict[str, Any]:
    return {"target": "accounts", "key": key, "field": "balance", "by": by, **bounds}


def update(key: str, **fields: Any) -> dict[str, Any]:
    return {"target": "accounts", "key": key, "set": fields}


def commit(tx_id: str, at: int = 1_000) -> DecisionArrived:
    return DecisionArrived(tx_id, Outcome.COMMIT, NOW + at)


def rollback(tx_id: str, at: int = 1_000) -> DecisionArrived:
    return DecisionArrived(tx_id, Outcome.ROLLBACK, NOW + at)


def statuses(reports: Sequence[Report]) -> list[tuple[str, StepStatus]]:
    return [(r.tx_id, r.status) for r in reports]


class Twin:
    """The script path and the per-step path, each on its own prefix of one Redis."""

    def __init__(self, url: str, prefix: str) -> None:
        self.client: redis.Redis = redis.Redis.from_url(url, decode_responses=True)
        self.fast = RedisStorage("bank", url, TARGETS, prefix=f"{prefix}f")
        self.slow = RedisStorage("bank", url, TARGETS, prefix=f"{prefix}s", scripts=False)
        self.calls = 0
        inner = self.fast.batch_script
        assert inner is not None
        original = inner._call

        def counted(chunk: Any) -> Any:
            self.calls += 1
            return original(chunk)

        inner._call = counted  # type: ignore[method-assign]

    def seed(self, key: str, **fields: Any) -> None:
        for storage in (self.fast, self.slow):
            mapping = {name: str(value) for name, value in fields.items()}
            self.client.hset(storage.record_key("accounts", key), mapping=cast(Any, mapping))

    def record(self, key: str) -> dict[str, str]:
        """What any reader of the store sees (``HGETALL``); the same on both paths."""
        found = [
            cast(dict[str, str], self.client.hgetall(s.record_key("accounts", key)))
            for s in (self.fast, self.slow)
        ]
        assert found[0] == found[1]
        return found[0]

    def balance(self, key: str) -> str | None:
        return self.record(key).get("balance")

    def side(self, storage: RedisStorage, key: str) -> dict[str, str]:
        name = f"{storage.prefix}:ledger:+isolation:accounts:{key}"
        return cast(dict[str, str], self.client.hgetall(name))

    def state(self, storage: RedisStorage) -> tuple[Any, ...]:
        head = len(storage.prefix)
        keys = sorted(
            name
            for pattern in (f"{storage.prefix}:accounts:*", f"{storage.prefix}:ledger:+*")
            for name in self.client.scan_iter(match=pattern)
        )
        data = {name[head:]: self.client.hgetall(name) for name in keys}
        return data, storage.ledger(), storage.in_flight_sequential()

    def run(self, *items: WorkItem) -> list[Report]:
        """One batch on both paths: the same reports and the same state."""
        got = self.fast.execute(list(items))
        assert got == self.slow.execute(list(items))
        assert self.state(self.fast) == self.state(self.slow)
        return got

    def each(self, *items: WorkItem, batched: bool) -> list[Report]:
        """``items`` as one batch (``batched``) or one batch each."""
        if batched:
            return self.run(*items)
        return [report for item in items for report in self.run(item)]

    def close(self) -> None:
        self.fast.close()
        self.slow.close()
        self.client.close()


@pytest.fixture
def twin(services: Services, redis_prefix: str) -> Iterator[Twin]:
    made = Twin(services.redis_url, redis_prefix.rstrip(":"))
    try:
        yield made
    finally:
        made.close()


BATCHED = pytest.mark.parametrize("batched", [False, True], ids=["one-by-one", "batched"])


# ---------------------------------------------------------------- read_committed


@BATCHED
def test_no_dirty_read_an_open_increment_shows_at_its_commit(twin: Twin, batched: bool) -> None:
    twin.seed("x", owner="x", balance=0)
    twin.seed("y", owner="y", balance=10)
    got = twin.each(
        req("t1", "increment", bump("x", 100)),
        req("t2", "increment", bump("y", -3)),
        batched=batched,
    )
    assert [(r.status, r.confirm) for r in got] == [(StepStatus.APPLIED, True)] * 2
    assert (twin.balance("x"), twin.balance("y")) == ("0", "10")  # T1 and T2 are open
    got = twin.each(commit("t1"), commit("t2"), batched=batched)
    assert statuses(got) == [("t1", StepStatus.COMMITTED), ("t2", StepStatus.COMMITTED)]
    assert (twin.balance("x"), twin.balance("y")) == ("100", "7")
    assert twin.side(twin.fast, "x") == {} and twin.side(twin.slow, "y") == {}


@BATCHED
def test_no_dirty_read_of_held_writes(twin: Twin, batched: bool) -> None:
    twin.seed("k", owner="k", v=5)
    twin.seed("gone", owner="g")
    twin.seed("put", owner="p", v=1)
    steps: list[WorkItem] = [
        req("t1", "update", update("k", v=7, owner=None)),
        req("t2", "insert", {"target": "accounts", "key": "new", "value": {"owner": "n"}}),
        req("t3", "delete", {"target": "accounts", "key": "gone"}),
        req("t4", "put", {"target": "accounts", "key": "put", "value": {"v": 2, "w": True}}),
    ]
    assert statuses(twin.each(*steps, batched=batched)) == [
        (f"t{n}", StepStatus.APPLIED) for n in range(1, 5)
    ]
    assert twin.record("k") == {"owner": "k", "v": "5"}
    assert twin.record("new") == {}
    assert twin.record("gone") == {"owner": "g"}
    assert twin.record("put") == {"owner": "p", "v": "1"}
    got = twin.each(*(commit(f"t{n}") for n in range(1, 5)), batched=batched)
    assert [r.status for r in got] == [StepStatus.COMMITTED] * 4
    assert twin.record("k") == {"v": "7"}
    assert twin.record("new") == {"owner": "n"}
    assert twin.record("gone") == {}
    assert twin.record("put") == {"owner": "p", "v": "2", "w": "true"}
    assert all(twin.side(twin.slow, key) == {} for key in ("k", "new", "gone", "put"))


@BATCHED
def test_no_dirty_spend_and_no_broken_bound(twin: Twin, batched: bool) -> None:
    twin.seed("x", owner="x", balance=0)
    got = twin.each(
        req("t1", "increment", bump("x", 100)),
        req("t2", "increment", bump("x", -100, min=0)),
        batched=batched,
    )
    assert statuses(got) == [("t1", StepStatus.APPLIED), ("t2", StepStatus.FAILED)]
    assert got[1].reason == "accounts/x balance would be -100, below the minimum 0"
    got = twin.each(rollback("t1"), rollback("t2"), batched=batched)
    assert statuses(got) == [("t1", StepStatus.COMPENSATED), ("t2", StepStatus.COMPENSATED)]
    assert twin.balance("x") == "0"
    assert twin.side(twin.fast, "x") == {}


@BATCHED
def test_escrow_counts_open_reservations_in_the_unfavourable_direction(
    twin: Twin, batched: bool
) -> None:
    twin.seed("x", owner="x", balance=100)
    got = twin.each(
        req("t1", "increment", bump("x", -60, min=0)),
        req("t2", "increment", bump("x", 500)),  # a credit does not help a debit's bound
        req("t3", "increment", bump("x", -60, min=0)),
        req("t4", "increment", bump("x", 1, max=600)),
        req("t5", "increment", bump("x", 1, max=602)),
        batched=batched,
    )
    assert [r.status for r in got] == [
        StepStatus.APPLIED,
        StepStatus.APPLIED,
        StepStatus.FAILED,
        StepStatus.FAILED,
        StepStatus.APPLIED,
    ]
    counted = " (counting open reservations)"
    assert got[2].reason == f"accounts/x balance would be -20{counted}, below the minimum 0"
    assert got[3].reason == f"accounts/x balance would be 601{counted}, above the maximum 600"
    side = twin.side(twin.fast, "x")
    assert side["neg:balance"] == "-60" and side["pos:balance"] == "501"
    assert (side["min:balance"], side["max:balance"]) == ("0", "602")
    got = twin.each(commit("t1"), rollback("t2"), rollback("t3"), commit("t5"), batched=batched)
    assert twin.balance("x") == "41"
    assert twin.side(twin.slow, "x") == {"min:balance": "0", "max:balance": "602"}


@BATCHED
def test_no_lost_update_a_held_record_fails_another_saga_naming_the_holder(
    twin: Twin, batched: bool
) -> None:
    twin.seed("k", owner="k", v=5)
    got = twin.each(
        req("t3", "update", update("k", v=7)),
        req("t4", "update", update("k", v=9)),
        batched=batched,
    )
    assert statuses(got) == [("t3", StepStatus.APPLIED), ("t4", StepStatus.FAILED)]
    assert got[1].reason == (
        "accounts/k is held by saga t3 (step 0) until its decision; retry after it"
    )
    got = twin.each(rollback("t3"), rollback("t4"), batched=batched)
    assert twin.record("k") == {"owner": "k", "v": "5"}
    got = twin.each(
        req("t4-again", "update", update("k", v=9)), commit("t4-again"), batched=batched
    )
    assert statuses(got) == [("t4-again", StepStatus.APPLIED), ("t4-again", StepStatus.COMMITTED)]
    assert twin.record("k") == {"owner": "k", "v": "9"}


@pytest.mark.parametrize(
    ("action", "args"),
    [
        ("insert", {"target": "accounts", "key": "k", "value": {"v": 1}}),
        ("put", {"target": "accounts", "key": "k", "value": {"v": 1}}),
        ("update", update("k", v=1)),
        ("delete", {"target": "accounts", "key": "k"}),
        ("increment", bump("k", 1)),
    ],
)
@pytest.mark.parametrize("isolation", list(Isolation))
@pytest.mark.parametrize(
    "first",
    [
        ("insert", {"target": "accounts", "key": "k", "value": {"balance": 1}}),
        ("put", {"target": "accounts", "key": "k", "value": {"balance": 1}}),
        ("delete", {"target": "accounts", "key": "k"}),
    ],
    ids=["insert", "put", "delete"],
)
def test_insert_put_and_delete_hold_against_every_action_at_either_level(
    twin: Twin,
    first: tuple[str, dict[str, Any]],
    action: str,
    args: dict[str, Any],
    isolation: Isolation,
) -> None:
    if first[0] != "insert":
        twin.seed("k", balance=0)
    before = twin.record("k")
    got = twin.run(req("t1", *first), req("t2", action, args, isolation))
    assert statuses(got) == [("t1", StepStatus.APPLIED), ("t2", StepStatus.FAILED)]
    assert got[1].reason == (
        "accounts/k is held by saga t1 (step 0) until its decision; retry after it"
    )
    assert twin.record("k") == before
    twin.run(rollback("t1"), rollback("t2"))
    assert twin.record("k") == before and twin.side(twin.fast, "k") == {}


@pytest.mark.parametrize("isolation", list(Isolation))
def test_a_hold_on_a_reserved_record_fails_naming_the_reservation(
    twin: Twin, isolation: Isolation
) -> None:
    twin.seed("x", owner="x", balance=10)
    got = twin.run(
        req("t1", "increment", bump("x", 5)),
        req("t2", "update", update("x", owner="y"), isolation),
        req("t3", "delete", {"target": "accounts", "key": "x"}, isolation),
    )
    assert [r.status for r in got] == [StepStatus.APPLIED, StepStatus.FAILED, StepStatus.FAILED]
    assert got[1].reason == (
        "accounts/x has an open reservation of saga t1 (step 0) until its decision; retry after it"
    )
    twin.run(commit("t1"))
    assert twin.record("x") == {"owner": "x", "balance": "15"}


@BATCHED
def test_steps_of_one_saga_on_one_record_are_compatible(twin: Twin, batched: bool) -> None:
    twin.seed("k", owner="k", v=5, balance=10)
    steps = [
        req("t1", "update", update("k", v=7), step=0, n_steps=5),
        req("t1", "increment", bump("k", 5, min=0), step=1, n_steps=5),
        req(
            "t1",
            "insert",
            {"target": "accounts", "key": "n", "value": {"balance": 1}},
            step=2,
            n_steps=5,
        ),
        req("t1", "increment", bump("n", 2, max=3), step=3, n_steps=5),
        req("t1", "update", update("k", w="x"), step=4, n_steps=5),
    ]
    got = twin.each(*steps, batched=batched)
    assert [r.status for r in got] == [StepStatus.APPLIED] * 5
    other = twin.run(req("t2", "increment", bump("k", 1)))
    assert other[0].reason == (
        "accounts/k is held by saga t1 (step 0) until its decision; retry after it"
    )
    assert twin.record("k") == {"owner": "k", "v": "5", "balance": "10"}
    assert twin.record("n") == {}
    got = twin.run(commit("t1"))
    assert [r.status for r in got] == [StepStatus.COMMITTED] * 5
    assert twin.record("k") == {"owner": "k", "v": "7", "balance": "15", "w": "x"}
    assert twin.record("n") == {"balance": "3"}
    assert twin.side(twin.fast, "k") == {"min:balance": "0"}


@pytest.mark.parametrize("sagas", [2, 40])
def test_sagas_reserving_on_one_hot_record_all_succeed_and_commit(twin: Twin, sagas: int) -> None:
    twin.seed("hot", owner="hot", balance=0)
    got = twin.run(
        *(req(f"t{n}", "increment", bump("hot", n + 1, min=0, max=10_000)) for n in range(sagas))
    )
    assert [r.status for r in got] == [StepStatus.APPLIED] * sagas
    assert twin.calls == 1  # one script call reserved them all
    assert twin.balance("hot") == "0"
    twin.calls = 0
    got = twin.run(*(commit(f"t{n}") for n in range(sagas)))
    assert [r.status for r in got] == [StepStatus.COMMITTED] * sagas
    assert twin.calls == 1
    assert twin.balance("hot") == str(sagas * (sagas + 1) // 2)
    assert twin.side(twin.fast, "hot") == {"min:balance": "0", "max:balance": "10000"}


@BATCHED
def test_repeated_decisions_are_idempotent(twin: Twin, batched: bool) -> None:
    twin.seed("x", owner="x", balance=10)
    twin.seed("k", owner="k", v=1)
    twin.run(
        req("t1", "increment", bump("x", 5)),
        req("t2", "increment", bump("x", 7)),
        req("t3", "update", update("k", v=2)),
        req("t4", "update", {"target": "accounts", "key": "x", "set": {"owner": "z"}}),
    )
    decisions = [commit("t1"), rollback("t2"), commit("t3"), rollback("t4")]
    first = twin.each(*decisions, batched=batched)
    again = twin.each(*decisions, *decisions, batched=batched)
    assert statuses(first) == [
        ("t1", StepStatus.COMMITTED),
        ("t2", StepStatus.COMPENSATED),
        ("t3", StepStatus.COMMITTED),
        ("t4", StepStatus.COMPENSATED),  # failed at apply (t1 and t2 had reservations)
    ]
    assert statuses(again) == statuses(first) * 2
    assert twin.record("x") == {"owner": "x", "balance": "15"}
    assert twin.record("k") == {"owner": "k", "v": "2"}
    assert twin.side(twin.fast, "x") == {} and twin.side(twin.slow, "k") == {}
    late = twin.run(rollback("t1", 5_000))  # a rollback after the commit changes nothing
    assert late == [] and twin.balance("x") == "15"


def test_an_open_hold_is_never_pruned_and_a_decided_one_is(twin: Twin) -> None:
    twin.seed("x", owner="x", balance=10)
    twin.run(req("t1", "increment", bump("x", 5)), req("t2", "update", update("k", v=1)))
    for storage in (twin.fast, twin.slow):
        assert storage.prune(DEADLINE + 10**9, 100) == 1  # t2 failed (no k): finished
        [entry] = storage.ledger()
        assert entry.tx_id == "t1" and entry.status is LedgerStatus.APPLIED
    twin.run(commit("t1"))
    assert twin.balance("x") == "15"
    for storage in (twin.fast, twin.slow):
        assert storage.prune(DEADLINE + 10**9, 100) == 1
        assert storage.ledger() == []


# ---------------------------------------------------------------- none


@pytest.mark.parametrize("later", list(Isolation))
def test_none_lost_update_ends_compensation_failed_naming_the_record(
    twin: Twin, later: Isolation
) -> None:
    twin.seed("k", owner="k", v=5)
    got = twin.run(req("t3", "update", update("k", v=7), NONE))
    assert statuses(got) == [("t3", StepStatus.APPLIED)]
    assert twin.record("k")["v"] == "7"  # level none: written at once
    twin.run(req("t4", "update", update("k", v=9), later, n_steps=1), commit("t4"))
    assert twin.record("k")["v"] == "9"
    [got_back] = twin.run(rollback("t3"))
    assert got_back.status is StepStatus.COMPENSATION_FAILED
    assert got_back.reason == (
        "compensation failed: accounts/k changed since this step wrote it: v is '9', not '7'; "
        "not restored"
    )
    assert twin.record("k") == {"owner": "k", "v": "9"}


@pytest.mark.parametrize("later", list(Isolation))
@BATCHED
def test_none_broken_bound_ends_compensation_failed(
    twin: Twin, later: Isolation, batched: bool
) -> None:
    twin.seed("x", owner="x", balance=0)
    got = twin.each(
        req("t1", "increment", bump("x", 100), NONE),
        req("t2", "increment", bump("x", -100, min=0), later, n_steps=1),
        commit("t2"),
        batched=batched,
    )
    assert [r.status for r in got][:2] == [StepStatus.APPLIED] * 2
    assert twin.balance("x") == "0"
    [back] = twin.run(rollback("t1"))
    assert back.status is StepStatus.COMPENSATION_FAILED
    assert back.reason == (
        "compensation failed: accounts/x balance would be -100, below the minimum 0 that a "
        "bounded increment relied on; not restored"
    )
    assert twin.balance("x") == "0"


def test_a_none_compensation_counts_open_reservations(twin: Twin) -> None:
    twin.seed("x", owner="x", balance=0)
    twin.run(req("t1", "increment", bump("x", 100), NONE))
    twin.run(req("t2", "increment", bump("x", -80, min=0)))  # 100 - 80: reserved, open
    [back] = twin.run(rollback("t1"))
    assert back.reason == (
        "compensation failed: accounts/x balance would be -80 (counting open reservations), "
        "below the minimum 0 that a bounded increment relied on; not restored"
    )
    twin.run(rollback("t2"))
    [back] = twin.run(rollback("t1", 9_000))  # a replayed rollback retries: now it fits
    assert back.status is StepStatus.COMPENSATED and twin.balance("x") == "0"


def test_none_steps_do_not_overwrite_held_records(twin: Twin) -> None:
    twin.seed("x", owner="x", balance=10)
    twin.run(req("t1", "update", update("x", owner="y")))
    got = twin.run(
        req("t2", "increment", bump("x", 1), NONE), req("t3", "update", update("x", v=1), NONE)
    )
    assert [r.reason for r in got] == [
        "accounts/x is held by saga t1 (step 0) until its decision; retry after it"
    ] * 2
    assert twin.record("x") == {"owner": "x", "balance": "10"}
