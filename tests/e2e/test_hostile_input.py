"""Hostile records on the real services: none stops a process, each lands in the DLQ once.

Each test reproduces a record that once stopped the system for good (the
coordinator or a participant exited on it, and again on every restart): it is
written raw to its topic, as an attacker or a careless producer in any language
could, next to a system of three stores (PostgreSQL, the MongoDB wire server,
Redis). Afterwards every process is still up, the record is in the dead-letter
topic exactly once with a reason a person can read, no store changed because of
it, and a valid saga sent after it commits.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from saga.streams import (
    MAX_RECORD_BYTES,
    Decision,
    Outcome,
    SagaAbort,
    SagaState,
    Step,
    StepEvent,
    StepStatus,
    encode,
)
from saga.streams.kafka import KafkaSettings, Message, Producer, partition_for
from tests._infra import Services, eventually
from tests._system import SagaSystem
from tests.e2e.test_three_stores import Stores, order, start

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PARTITIONS = 4


@dataclass
class Sent:
    label: str
    topic: str
    key: bytes | None
    value: bytes
    expect: str
    partition: int = -1
    offset: int = -1

    @property
    def source(self) -> tuple[str, int, int]:
        return (self.topic, self.partition, self.offset)


class Rig:
    """A running three-store system and a raw producer that may send up to 2 MB."""

    def __init__(self, system: SagaSystem, stores: Stores) -> None:
        self.system = system
        self.stores = stores
        self.topics = system.settings.topics
        big = KafkaSettings(
            bootstrap=system.settings.bootstrap,
            prefix=system.prefix,
            extra={"message.max.bytes": "2000000"},
        )
        self.producer = Producer(big, client_id="hostile")
        self.sent: list[Sent] = []
        self._lock = threading.Lock()

    def send(
        self,
        label: str,
        topic: str,
        key: str,
        value: bytes,
        expect: str,
        partition: int | None = None,
    ) -> Sent:
        record = Sent(label, topic, key.encode(), value, expect)

        def delivered(error: object, message: Message) -> None:
            assert error is None, f"{label}: {error}"
            with self._lock:
                record.partition, record.offset = message.partition, message.offset

        self.producer.produce(topic, key, value, on_delivery=delivered, partition=partition)
        self.producer.flush(30)
        assert record.offset >= 0, f"{label} was not delivered"
        self.sent.append(record)
        return record

    def a_valid_saga_commits(self, account: str = "carol") -> None:
        before = self.stores.balances()[account]
        with self.system.client() as client:
            tx = client.submit(order(account, "pen", 1, 3), saga="order", timeout=60)
            final = client.result(tx, timeout=90)
        assert final.state is SagaState.COMMITTED, final
        assert self.stores.balances()[account] == before - 3

    def check(self) -> dict[str, Message]:
        """Every process is up; each record sent is in the DLQ exactly once; returns them."""
        assert all(p.alive for p in self.system.procs), [
            (p.name, p.log()[-3000:]) for p in self.system.procs if not p.alive
        ]
        wanted = {s.source for s in self.sent}

        def letters() -> dict[tuple[str, int, int], list[Message]] | None:
            found: dict[tuple[str, int, int], list[Message]] = {}
            for m in self.system.read_messages(self.topics.dlq):
                source = (
                    (m.header("saga.source.topic") or b"").decode(),
                    int(m.header("saga.source.partition") or b"-1"),
                    int(m.header("saga.source.offset") or b"-1"),
                )
                found.setdefault(source, []).append(m)
            return found if wanted <= set(found) else None

        found = eventually(letters, timeout=60, interval=0.5, message="not all in the DLQ")
        assert found is not None
        assert sum(len(v) for v in found.values()) == len(self.sent), found
        by_label: dict[str, Message] = {}
        for s in self.sent:
            (letter,) = found[s.source]
            reason = (letter.header("saga.error") or b"").decode()
            assert s.expect in reason, (s.label, reason)
            assert "\n" not in reason and "Traceback" not in reason and len(reason) <= 500
            if len(s.value) + len(s.key or b"") > MAX_RECORD_BYTES:
                assert letter.header("saga.truncated") == b"1", s.label
                assert letter.value == s.value[:4096]
                assert letter.header("saga.source.value.length") == str(len(s.value)).encode()
                digest = hashlib.sha256(s.value).hexdigest().encode()
                assert letter.header("saga.source.sha256") == digest
            else:
                assert (letter.key, letter.value) == (s.key, s.value), s.label
            by_label[s.label] = letter
        assert all(p.alive for p in self.system.procs)
        return by_label


@pytest.fixture
def rig(
    services: Services, pg_schema: tuple[str, str], mongo_db: Any, tmp_path: Path
) -> Iterator[Rig]:
    import redis

    _, schema = pg_schema
    stores = Stores(services, schema, mongo_db, services.redis_url)
    system = SagaSystem(services, tmp_path, schema, partitions=PARTITIONS)
    system.create_topics()
    system.coordinator()
    for name in ("ledger", "inventory", "loyalty"):
        start(system, stores, name)
    r = Rig(system, stores)
    try:
        yield r
    finally:
        r.producer.close()
        system.stop_all()
        system.delete_topics()
        client = redis.Redis.from_url(services.redis_url)
        keys = list(client.scan_iter(match=f"{stores.prefix}:*", count=500))
        if keys:
            client.delete(*keys)
        client.close()


def after_one_valid_saga(
    before: tuple[dict[str, int], dict[str, int], dict[str, int]],
) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """The stores as :meth:`Rig.a_valid_saga_commits` alone leaves them."""
    balances, stock, points = before
    return (
        {**balances, "carol": balances["carol"] - 3},
        {**stock, "pen": stock["pen"] - 1},
        {**points, "carol": points["carol"] + 3},
    )


def raw_request(system: SagaSystem, tx_id: str, steps: list[dict[str, Any]]) -> dict[str, Any]:
    with system.client() as client:
        valid = client.build(order("alice", "book", 1, 5), saga="order", tx_id=tx_id, timeout=60)
    data: dict[str, Any] = orjson.loads(encode(valid))
    data["steps"] = steps
    return data


def nested_list(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


# ------------------------------------------------------------------ 1. deep nesting


def test_deeply_nested_args_and_meta_stop_nothing(rig: Rig) -> None:
    before = rig.stores.snapshot()
    for levels in (300, 500):
        tx = f"deep-{levels}"
        base = raw_request(
            rig.system,
            tx,
            [
                {
                    "participant": name,
                    "action": "increment",
                    "args": {"target": t, "key": k, "field": f, "by": 1, "x": "@"},
                }
                for name, t, k, f in (
                    ("ledger", "accounts", "alice", "balance"),
                    ("inventory", "stock", "book", "qty"),
                    ("loyalty", "points", "alice", "points"),
                )
            ],
        )
        value = orjson.dumps(base).replace(b'"@"', nested_list(levels))
        rig.send(f"args nested {levels}", rig.topics.requests, tx, value, "nests more than")
    meta = orjson.dumps(raw_request(rig.system, "deep-meta", [])).replace(
        b'"steps":[]',
        b'"steps":[{"participant":"ledger","action":"increment","args":{}}],"meta":{"m":'
        + nested_list(300)
        + b"}",
    )
    rig.send("meta nested 300", rig.topics.requests, "deep-meta", meta, "meta nests more than")
    rig.a_valid_saga_commits()
    rig.check()
    assert rig.stores.snapshot() == after_one_valid_saga(before)


# ------------------------------------------------------------------ 2. records near 1 MB


def test_records_near_one_megabyte_stop_nothing(rig: Rig) -> None:
    with rig.system.client() as client:
        pending = client.submit(
            order("bob", "book", 1, 7), saga="order", timeout=600, wait_delivery=True
        )
    rig.send("1 MB of x", rig.topics.requests, "big-x", b"x" * 1_040_000, "more than the")
    rig.send("1 MB of {", rig.topics.decisions, "big-brace", b"{" * 1_040_000, "more than the")
    huge_abort = encode_unchecked(SagaAbort(pending, "r" * 1_030_000, 1))
    rig.send(
        "valid-shaped abort, 1 MB reason", rig.topics.requests, pending, huge_abort, "more than the"
    )
    huge_failed = encode_unchecked(
        StepEvent(pending, 0, "ledger", StepStatus.FAILED, 1, "f" * 1_030_000)
    )
    rig.send("failed event, 1 MB reason", rig.topics.events, pending, huge_failed, "more than the")
    long_failed = encode_unchecked(
        StepEvent(pending, 0, "ledger", StepStatus.FAILED, 1, "f" * 5_000)
    )
    rig.send(
        "failed event, 5,000-char reason",
        rig.topics.events,
        pending,
        long_failed,
        "1000 characters",
    )
    rig.a_valid_saga_commits()
    rig.check()
    with rig.system.client() as client:
        final = client.result(pending, timeout=60)
    # None of the oversized records decided it: it committed like any other saga.
    assert final.state is SagaState.COMMITTED, final


def test_a_valid_abort_with_the_longest_reason_rolls_back(rig: Rig) -> None:
    with rig.system.client() as client:
        tx = client.build(order("bob", "book", 1, 7), saga="order", timeout=600)
        abort = SagaAbort(tx.tx_id, "r" * 1000, 1)
        # The abort first: it decides the rollback, and the request finds it.
        rig.producer.produce(rig.topics.requests, tx.tx_id, encode(abort))
        rig.producer.flush(30)
        client.send(tx)
        final = client.result(tx.tx_id, timeout=90)
    assert final.state is SagaState.ROLLED_BACK, final
    assert final.reason is not None and final.reason.startswith("aborted by operator: rrr")
    assert len(final.reason) <= 1000
    (decision,) = rig.system.decisions(tx.tx_id)
    assert decision.outcome is Outcome.ROLLBACK and len(decision.reason) <= 1000
    rig.a_valid_saga_commits()
    assert all(p.alive for p in rig.system.procs)


# ------------------------------------------------------------------ 4. wrong partition


def test_a_request_on_the_wrong_partition_is_rejected_and_changes_nothing(rig: Rig) -> None:
    before = rig.stores.snapshot()
    tx = "wrong-partition"
    home = partition_for(tx, PARTITIONS)
    data = raw_request(
        rig.system,
        tx,
        [
            {
                "participant": "ledger",
                "action": "increment",
                "args": {"target": "accounts", "key": "alice", "field": "balance", "by": -100},
            },
            {
                "participant": "loyalty",
                "action": "increment",
                "args": {"target": "points", "key": "alice", "field": "points", "by": 100},
            },
        ],
    )
    rig.send(
        "request on another partition",
        rig.topics.requests,
        tx,
        orjson.dumps(data),
        f"its key belongs on {home}",
        partition=(home + 1) % PARTITIONS,
    )
    rig.a_valid_saga_commits()
    rig.check()
    assert rig.stores.snapshot() == after_one_valid_saga(before)
    with rig.system.client() as client:
        assert client.status(tx) is None  # never a transaction: no status, no decision
    assert rig.system.decisions(tx) == []


# ------------------------------------------------------------------ 6. large integers


def test_integers_beyond_64_bits_are_rejected_not_rounded(rig: Rig) -> None:
    before = rig.stores.snapshot()
    for label, name, target, key, field in (
        ("huge by for Redis", "loyalty", "points", "alice", "points"),
        ("huge by for Mongo", "inventory", "stock", "book", "qty"),
    ):
        tx = f"big-int-{name}"
        data = raw_request(
            rig.system,
            tx,
            [
                {
                    "participant": name,
                    "action": "increment",
                    "args": {"target": target, "key": key, "field": field, "by": 7},
                }
            ],
        )
        value = orjson.dumps(data).replace(b'"by":7', b'"by":1180591620717411303425')
        rig.send(label, rig.topics.requests, tx, value, "outside the signed 64-bit range")
    rig.a_valid_saga_commits()
    rig.check()
    assert rig.stores.snapshot() == after_one_valid_saga(before)


def encode_unchecked(record: SagaAbort | StepEvent | Decision) -> bytes:
    """The wire form of a record that breaks the contract (the codec refuses to write it)."""
    from saga.streams import to_dict

    return orjson.dumps(to_dict(record), option=orjson.OPT_SORT_KEYS)


# ------------------------------------------------------------------ a step no storage can handle


def test_a_step_the_storage_fails_on_fails_alone_and_the_participant_goes_on(
    services: Services, pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    """A valid record whose step makes the storage raise (here a custom handler's bug)
    fails that step, so its saga rolls back; the participant stays up, and the other
    sagas of the same batch commit."""
    from tests._workload import seed

    _, schema = pg_schema
    system = SagaSystem(services, tmp_path, schema, partitions=1)
    seed(system)
    system.create_topics()
    try:
        system.coordinator()
        system.start(
            "participant-bank",
            [
                "participant", "run", "--name", "bank", "--storage", "sql",
                "--url", services.postgres_url, "--schema", schema, "--targets", "accounts",
                "--handlers", "tests.e2e.exploding_handlers",
            ],
        )  # fmt: skip
        debit = {"target": "accounts", "key": "acc0", "field": "balance", "by": -1}
        with system.client() as client:
            good = [client.build([Step("bank", "increment", debit)], timeout=60) for _ in range(5)]
            bad = client.build(
                [Step("bank", "increment", debit), Step("bank", "explode", {"boom": True})],
                timeout=60,
            )
            for request in [*good[:2], bad, *good[2:]]:  # one batch, most likely
                client.send(request, wait_delivery=False)
            client.flush()
            finals = {r.tx_id: client.result(r.tx_id, timeout=90) for r in [*good, bad]}
        assert all(finals[r.tx_id].state is SagaState.COMMITTED for r in good), finals
        failed = finals[bad.tx_id]
        assert failed.state is SagaState.ROLLED_BACK, failed
        assert failed.reason is not None
        assert "step 1 failed: could not be handled: RuntimeError" in failed.reason
        assert all(p.alive for p in system.procs), [p.log()[-2000:] for p in system.procs]
    finally:
        system.stop_all()
        system.delete_topics()
