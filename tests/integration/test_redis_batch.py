"""The Redis batch path (:mod:`participants._redis_batch`) against a real Redis.

The strongest check is parity: the same batches run through a storage with the script
path and one with ``scripts=False`` (every step on the per-step WATCH/MULTI/EXEC path)
must give the same reports, records, ledger entries, in-flight set and finished scores.
The other tests pin what only the script path has: one call per run of steps, chunks,
``NOSCRIPT``, the hand-back to the per-step path, and hostile values staying values.
Requests here are at level ``none`` unless a test says otherwise (the record changes at
apply); ``read_committed`` is compared in the random batches and in
``test_redis_isolation.py``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, cast

import pytest
import redis
from test_sql_storage import DEADLINE, NOW, commit, rollback
from test_sql_storage import requested as requested_at_default

from saga.participants._barrier import Requested
from saga.participants._storage import RequestSeen, WorkItem
from saga.participants.redis import _batch as _redis_batch
from saga.participants.redis._adapter import RedisStorage
from saga.streams import ConfigurationError, Isolation, Mode, StepStatus
from tests._infra import Services

TARGETS = ("accounts", "orders")


def requested(*args: Any, isolation: Isolation = Isolation.NONE, **options: Any) -> Requested:
    return replace(requested_at_default(*args, **options), isolation=isolation)


class Pair:
    """Two storages on two prefixes of one Redis: the script path and the per-step path."""

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

    def seed(self, key: Any, fields: dict[str, str]) -> None:
        for storage in (self.fast, self.slow):
            self.client.hset(storage.record_key("accounts", key), mapping=cast(Any, fields))

    def record(self, storage: RedisStorage, key: Any) -> dict[str, str]:
        return cast(dict[str, str], self.client.hgetall(storage.record_key("accounts", key)))

    def state(self, storage: RedisStorage) -> tuple[Any, ...]:
        records = {
            name[len(storage.prefix) :]: self.client.hgetall(name)
            for pattern in (f"{storage.prefix}:accounts:*", f"{storage.prefix}:ledger:+*")
            for name in self.client.scan_iter(match=pattern)
        }
        finished = dict(cast(Any, self.client.zrange(storage.finished_key, 0, -1, withscores=True)))
        return records, storage.ledger(), storage.in_flight_sequential(), finished

    def both(self, items: list[WorkItem]) -> list[Any]:
        got = self.fast.execute(items)
        assert got == self.slow.execute(items)
        assert self.state(self.fast) == self.state(self.slow)
        return got

    def close(self) -> None:
        self.fast.close()
        self.slow.close()
        self.client.close()


@pytest.fixture
def pair(services: Services, redis_prefix: str) -> Iterator[Pair]:
    made = Pair(services.redis_url, redis_prefix.rstrip(":"))
    try:
        yield made
    finally:
        made.close()


def bump(key: Any, by: float, **extra: Any) -> dict[str, Any]:
    return {"target": "accounts", "key": key, "field": "balance", "by": by, **extra}


def test_a_run_of_new_steps_is_one_call_and_later_steps_see_earlier_ones(pair: Pair) -> None:
    pair.seed(1, {"owner": "alice", "balance": "100"})
    items: list[WorkItem] = [
        requested("tx-1", "increment", bump(1, -60, min=0)),
        requested("tx-2", "increment", bump(1, -60, min=0)),  # 40 - 60 < 0: fails alone
        requested("tx-3", "increment", bump(1, 5, max=45)),
        requested("tx-4", "increment", bump(1, 1, max=45)),  # 46 > 45
        requested("tx-5", "increment", bump(9, 1)),  # no such record
        requested("tx-6", "increment", {**bump(1, 1), "field": "missing"}),
    ]
    got = pair.both(items)
    assert [r.status for r in got] == [
        StepStatus.APPLIED,
        StepStatus.FAILED,
        StepStatus.APPLIED,
        StepStatus.FAILED,
        StepStatus.FAILED,
        StepStatus.FAILED,
    ]
    assert got[1].reason == "accounts/1 balance would be -20, below the minimum 0"
    assert got[3].reason == "accounts/1 balance would be 46, above the maximum 45"
    assert pair.record(pair.fast, 1) == {"owner": "alice", "balance": "45"}
    assert pair.calls == 1
    [entry] = pair.fast.ledger("tx-1")
    assert entry.before == {"balance": "100"}


def test_what_the_script_leaves_runs_per_step_in_order(pair: Pair) -> None:
    pair.seed(1, {"owner": "alice", "balance": "10.50", "credit": "007", "big": str(2**63 - 1)})
    pair.seed(2, {"owner": "bob", "balance": "50", "note": "n/a"})
    items: list[WorkItem] = [
        requested("tx-1", "increment", bump(2, 1)),
        requested("tx-2", "increment", bump(1, 1)),  # decimal text: per step
        requested("tx-3", "increment", bump(2, 1)),
        requested("tx-4", "increment", {**bump(1, 1), "field": "credit"}),  # "007"
        requested("tx-5", "increment", {**bump(1, 1), "field": "big"}),  # past 64 bits
        requested("tx-6", "increment", {**bump(2, 1), "field": "note"}),  # not a number
        requested("tx-7", "increment", bump(2, 0.5)),  # a decimal by: per step
        requested("tx-8", "increment", bump(2, 1)),
    ]
    got = pair.both(items)
    assert [r.status for r in got] == [StepStatus.APPLIED] * 5 + [
        StepStatus.FAILED,
        StepStatus.APPLIED,
        StepStatus.APPLIED,
    ]
    assert pair.record(pair.fast, 1)["big"] == str(2**63)
    assert pair.record(pair.fast, 2)["balance"] == "53.5"
    assert pair.calls >= 4


def test_repeats_decisions_and_markers_match_the_per_step_path(pair: Pair) -> None:
    pair.seed(1, {"owner": "alice", "balance": "100"})
    first: list[WorkItem] = [
        requested("tx-1", "increment", bump(1, 10)),
        requested("tx-2", "increment", bump(1, 10), step=1, mode=Mode.SEQUENTIAL, n_steps=2),
        requested("tx-3", "increment", bump(1, 10), deadline_ms=NOW - 1),
        requested("tx-4", "increment", {"target": "secrets", "key": 1, "field": "x", "by": 1}),
        requested("tx-5", "increment", bump("a b", 1)),
        RequestSeen("tx-6", "fp", DEADLINE, NOW),
        requested("tx-7", "increment", bump(1, 1)),
        requested("tx-7", "increment", bump(1, 2), step=1, n_steps=2),
    ]
    pair.both(first)
    pair.both(first)  # every one a repeat now
    pair.both([rollback("tx-1"), rollback("tx-8"), requested("tx-8", "increment", bump(1, 1))])
    pair.both([requested("tx-6", "increment", bump(1, 1))])


@pytest.mark.parametrize("isolation", [*Isolation, None], ids=[*Isolation, "mixed"])
def test_random_batches_match_the_per_step_path(pair: Pair, isolation: Isolation | None) -> None:
    rng = random.Random(14)
    for key in range(4):
        pair.seed(key, {"owner": f"o{key}", "balance": str(rng.randint(-5, 50))})
    for batch in range(12):
        items: list[WorkItem] = []
        for n in range(rng.randint(1, 40)):
            tx = f"tx-{rng.randint(0, 60)}"
            roll = rng.random()
            if roll < 0.15:
                items.append(rollback(tx, NOW + batch))
                continue
            if roll < 0.25:
                items.append(commit(tx, NOW + batch))
                continue
            args = bump(rng.randint(0, 4), rng.randint(-20, 20))
            if rng.random() < 0.3:
                args["min"] = 0
            if rng.random() < 0.2:
                args["max"] = 60
            items.append(
                Requested(
                    tx,
                    rng.randint(0, 1),
                    "increment",
                    args,
                    Mode.PARALLEL,
                    2,
                    DEADLINE,
                    NOW + batch,
                    fingerprint=f"fp-{tx}-{n % 2}",
                    isolation=isolation or rng.choice(list(Isolation)),
                )
            )
        pair.both(items)


def test_a_thousand_steps_go_in_chunks(pair: Pair) -> None:
    pair.seed(1, {"owner": "alice", "balance": "0"})
    items: list[WorkItem] = [requested(f"tx-{n}", "increment", bump(1, 1)) for n in range(1000)]
    got = pair.fast.execute(items)
    assert all(r.status is StepStatus.APPLIED for r in got) and len(got) == 1000
    assert pair.record(pair.fast, 1)["balance"] == "1000"
    assert pair.calls == 1000 // _redis_batch.CHUNK


def test_a_flushed_script_cache_is_loaded_again(pair: Pair) -> None:
    pair.seed(1, {"owner": "alice", "balance": "0"})
    pair.fast.execute([requested("tx-1", "increment", bump(1, 1))])
    pair.client.script_flush()
    pair.fast.execute([requested("tx-2", "increment", bump(1, 1))])
    assert pair.record(pair.fast, 1)["balance"] == "2"


def test_lua_looking_values_stay_values(pair: Pair) -> None:
    evil = "x')_redis.call('FLUSHALL')_--"
    pair.seed(evil, {"owner": "eve", "balance": "1"})
    items: list[WorkItem] = [
        requested("tx-1", "increment", bump(evil, 1)),
        Requested(
            "tx-2",
            0,
            "increment",
            bump(evil, 1),
            Mode.PARALLEL,
            1,
            DEADLINE,
            NOW,
            fingerprint=evil + _redis_batch._SPLICE,
            isolation=Isolation.NONE,
        ),
    ]
    marker = _redis_batch._SPLICE  # the splice marker as a key: the per-step path takes it
    pair.seed(marker, {"owner": "eve", "balance": "1"})
    items += [
        requested("tx-3", "increment", bump(marker, 1)),
        requested("tx-4", "increment", bump(marker, 1, max=2)),
        rollback("tx-3"),
    ]
    got = pair.both(items)
    assert [r.status for r in got] == [StepStatus.APPLIED] * 3 + [
        StepStatus.FAILED,
        StepStatus.COMPENSATED,
    ]
    assert pair.record(pair.fast, evil)["balance"] == "3"
    assert pair.record(pair.fast, marker)["balance"] == "1"


def test_a_ledger_key_of_another_type_stops_before_any_write(pair: Pair) -> None:
    pair.seed(1, {"owner": "alice", "balance": "0"})
    pair.client.set(pair.fast.in_flight_key, "oops")
    with pytest.raises(ConfigurationError, match="rejected a command"):
        pair.fast.execute([requested("tx-1", "increment", bump(1, 1))])
    assert pair.record(pair.fast, 1)["balance"] == "0"
    assert pair.fast.ledger() == []


def test_a_run_of_rollbacks_is_one_read_and_one_call(pair: Pair) -> None:
    pair.seed(1, {"owner": "alice", "balance": "100"})
    txs = [f"tx-{n}" for n in range(20)]
    pair.both([requested(tx, "increment", bump(1, 5, max=180)) for tx in txs])
    pair.calls = 0
    got = pair.both([rollback(tx) for tx in txs])
    assert [r.status for r in got] == [StepStatus.COMPENSATED] * 20  # 4 failed: null ones
    assert pair.calls == 1
    assert pair.record(pair.fast, 1)["balance"] == "100"


def test_a_failed_compensation_and_its_retry_match_the_per_step_path(pair: Pair) -> None:
    pair.seed(1, {"owner": "alice", "balance": "100"})
    pair.both([requested("tx-1", "increment", bump(1, 5))])
    for storage in (pair.fast, pair.slow):
        pair.client.delete(storage.record_key("accounts", 1))
    [got] = pair.both([rollback("tx-1")])
    assert got.status is StepStatus.COMPENSATION_FAILED
    assert got.reason == (
        "compensation failed: accounts/1 no longer exists, so its increment of balance "
        "cannot be undone"
    )
    pair.seed(1, {"owner": "alice", "balance": "105"})
    [got] = pair.both([rollback("tx-1", NOW + 2_000)])
    assert got.status is StepStatus.COMPENSATED
    assert pair.record(pair.fast, 1)["balance"] == "100"


def test_sequential_rollbacks_match_the_per_step_path(pair: Pair) -> None:
    pair.seed(1, {"owner": "alice", "balance": "100"})
    first = requested("tx-1", "increment", bump(1, 5), mode=Mode.SEQUENTIAL, n_steps=2)
    pair.both([first, rollback("tx-2")])
    pair.both([rollback("tx-1")])  # waits for its successor's compensation
    assert pair.fast.in_flight_sequential() == {"tx-1"}
    later = requested("tx-2", "increment", bump(1, 1), step=1, mode=Mode.SEQUENTIAL, n_steps=2)
    pair.both([later, rollback("tx-1", NOW + 5_000)])


def test_a_ledger_changed_after_the_read_leaves_the_rollback_to_the_per_step_path(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair.seed(1, {"owner": "alice", "balance": "100"})
    pair.fast.execute([requested("tx-1", "increment", bump(1, 5))])
    script = pair.fast.batch_script
    assert script is not None
    planned = script._plan

    def meddle(items: Any) -> Any:
        steps = planned(items)
        pair.client.hset(pair.fast.ledger_key("tx-1"), "seen", '{"meddled": true}')
        pair.client.hdel(pair.fast.ledger_key("tx-1"), "seen")
        pair.client.hset(pair.fast.record_key("accounts", 1), "balance", "205")
        return steps

    monkeypatch.setattr(script, "_plan", meddle)
    slow: list[object] = []
    per_step = pair.fast.run_one

    def counted(batch: Any, item: Any) -> Any:
        slow.append(item)
        return per_step(batch, item)

    monkeypatch.setattr(pair.fast, "run_one", counted)
    [got] = pair.fast.execute([rollback("tx-1")])
    assert got.status is StepStatus.COMPENSATED
    assert pair.record(pair.fast, 1)["balance"] == "200"
    assert slow == []  # the hash is the same again: the planned rollback still holds
    monkeypatch.setattr(script, "_plan", planned)
    pair.fast.execute([requested("tx-2", "increment", bump(1, 5))])

    def change(items: Any) -> Any:
        steps = planned(items)
        entry = pair.client.hget(pair.fast.ledger_key("tx-2"), "0")
        assert isinstance(entry, str)
        pair.client.hset(
            pair.fast.ledger_key("tx-2"), "0", entry.replace('"n_steps":1', '"n_steps":1 ')
        )
        return steps

    monkeypatch.setattr(script, "_plan", change)
    [got] = pair.fast.execute([rollback("tx-2")])
    assert got.status is StepStatus.COMPENSATED
    assert len(slow) == 1  # the entry's text changed since the read: per step
    assert pair.record(pair.fast, 1)["balance"] == "200"
