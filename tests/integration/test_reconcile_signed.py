"""Signed records in ``saga reconcile``: with a key folder, forged records are not audited.

A log on the real Kafka with valid signed records (a committed saga, a stuck one)
and forged ones: an unsigned request, one signed by the wrong principal, one
whose value was changed after signing, one signed with a key the folder does not
know, a rollback decision signed by the client and a ``failed`` step event signed
by the client for the committed saga. The forged ones are ``invalid`` (never a
transaction, never counted as a decision or a step, never stuck, never
replayed); the valid ones audit clean; the stuck saga's request is replayed with
its original signature, still valid. Dead letters: one the coordinator signed,
of the unsigned request, is rightly rejected; one nobody signed, naming the stuck
saga's request, leaves that request audited; the coordinator's letter of a status
record the client signed is rightly rejected too.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest

from saga.streams import decode
from saga.streams._signing import Keyring, create_key
from saga.streams.kafka import (
    Consumer,
    KafkaSettings,
    Message,
    Producer,
    partition_for,
    send_to_dlq,
)
from saga.streams.reconcile import ReconcileConfig, run
from saga.streams.reconcile._dlq import DeadLetter, TxFacts, judge, rejected_at
from saga.streams.reconcile._replay import Resend, replay_headers, replayable
from saga.streams.reconcile._signatures import Verifier
from tests._infra import Services
from tests._system import fresh_topics

if TYPE_CHECKING:
    from saga.streams.log import LogProducer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

NOW = 1_800_000_000_000
GRACE = 60_000
OLD = NOW - 600_000
PRINCIPALS = ("coordinator", "client", "operator", "participant-bank")


def dump(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def request(tx: str) -> bytes:
    return dump(
        {
            "v": 1,
            "type": "saga.request",
            "tx_id": tx,
            "saga": "test",
            "steps": [{"participant": "bank", "action": "insert", "args": {"key": tx}}],
            "deadline_ms": OLD + 30_000,
            "created_ms": OLD,
        }
    )


def event(tx: str, status: str, at: int) -> bytes:
    return dump(
        {
            "v": 1,
            "type": "saga.step",
            "tx_id": tx,
            "step": 0,
            "participant": "bank",
            "status": status,
            "at_ms": at,
        }
    )


def decision(tx: str, outcome: str) -> bytes:
    reason = "all steps applied" if outcome == "commit" else "forged"
    return dump(
        {
            "v": 1,
            "type": "saga.decision",
            "tx_id": tx,
            "outcome": outcome,
            "reason": reason,
            "at_ms": OLD + 2_000,
        }
    )


def status(tx: str) -> bytes:
    return dump(
        {
            "v": 1,
            "type": "saga.status",
            "tx_id": tx,
            "saga": "test",
            "state": "rolled_back",
            "steps": [],
            "reason": "forged",
            "created_ms": OLD,
            "updated_ms": OLD + 2_000,
            "deadline_ms": OLD + 30_000,
        }
    )


@pytest.fixture
def settings(services: Services) -> Iterator[KafkaSettings]:
    yield from fresh_topics(services, "rs", 3)


def read_all(settings: KafkaSettings, topic: str) -> list[Message]:
    reader = Consumer(settings, group_id=None, client_id="test.reconcile.signed")
    try:
        parts = reader.list_partitions(topic)
        ends = {p: reader.watermarks(topic, p)[1] for p in range(parts)}
        reader.assign([(topic, p, 0) for p in range(parts)])
        out: list[Message] = []
        deadline = time.monotonic() + 30
        while len(out) < sum(ends.values()) and time.monotonic() < deadline:
            out += reader.poll_batch(500, 0.5)
        return out
    finally:
        reader.close()


def test_forged_records_are_invalid_and_valid_ones_audit_clean(
    spark: Any, settings: KafkaSettings, tmp_path: Path
) -> None:
    t = settings.topics
    keys_dir = tmp_path / "keys"
    for principal in PRINCIPALS:
        create_key(keys_dir, principal)
    stranger_dir = tmp_path / "stranger"
    create_key(stranger_dir, "client")  # a client key the folder does not know
    ring = {p: Keyring.load(keys_dir, p) for p in PRINCIPALS}
    stranger = Keyring.load(stranger_dir, "client")

    def signed(by: Keyring, topic: str, key: str, value: bytes) -> tuple[Any, ...]:
        return (topic, key, value, by.sign(topic, key, value))

    tampered = signed(ring["client"], t.requests, "f-tampered", request("f-tampered"))
    records = {
        # valid
        "ok.request": signed(ring["client"], t.requests, "ok-1", request("ok-1")),
        "ok.applied": signed(
            ring["participant-bank"], t.events, "ok-1", event("ok-1", "applied", OLD + 1_000)
        ),
        "ok.decision": signed(ring["coordinator"], t.decisions, "ok-1", decision("ok-1", "commit")),
        "ok.committed": signed(
            ring["participant-bank"], t.events, "ok-1", event("ok-1", "committed", OLD + 3_000)
        ),
        "stuck.request": signed(ring["operator"], t.requests, "stuck-1", request("stuck-1")),
        # forged
        "f-unsigned": (t.requests, "f-unsigned", request("f-unsigned"), []),
        "f-wrong": signed(ring["participant-bank"], t.requests, "f-wrong", request("f-wrong")),
        "f-tampered": (
            tampered[0],
            tampered[1],
            tampered[2].replace(b'"saga":"test"', b'"saga":"evil"'),
            tampered[3],
        ),
        "f-unknown-key": signed(stranger, t.requests, "f-unknown-key", request("f-unknown-key")),
        "f-decision": signed(
            ring["client"], t.decisions, "stuck-1", decision("stuck-1", "rollback")
        ),
        "f-event": signed(ring["client"], t.events, "ok-1", event("ok-1", "failed", OLD + 1_500)),
        "f-status": signed(ring["client"], t.status, "stuck-1", status("stuck-1")),
    }
    delivered: dict[str, Message] = {}

    def remember(name: str) -> Any:
        def on_delivery(error: Exception | None, message: Message) -> None:
            assert error is None, error
            delivered[name] = message

        return on_delivery

    with Producer(settings) as producer:
        for name, (topic, key, value, headers) in records.items():
            producer.produce(topic, key, value, headers=headers, on_delivery=remember(name))
        producer.flush(30)
        # The coordinator's dead letter of the unsigned request, signed by it: justified.
        letter = delivered["f-unsigned"]
        send_to_dlq(
            cast("LogProducer", _Signing(producer, ring["coordinator"])),
            t,
            letter,
            "record is not signed: expected a signature by client or operator",
            component="coordinator",
        )
        # The coordinator's dead letter of the forged status record: justified.
        send_to_dlq(
            cast("LogProducer", _Signing(producer, ring["coordinator"])),
            t,
            delivered["f-status"],
            "record is signed by client, not by coordinator",
            component="coordinator",
        )
        # A dead letter nobody signed, naming a valid request: not believed.
        send_to_dlq(producer, t, delivered["stuck.request"], "forged", component="coordinator")
        producer.flush(30)

    config = ReconcileConfig(
        settings=settings,
        out=tmp_path / "out",
        grace_ms=GRACE,
        now_ms=NOW,
        write_all=True,
        show=100,
        keys_dir=keys_dir,
        replay=True,
    )
    result = run(config, spark=spark, say=lambda _: None)
    summary = result.summary
    rows = {
        r["tx_id"]: r.asDict(recursive=True)
        for r in spark.read.parquet(str(tmp_path / "out" / "findings")).collect()
    }

    assert {tx: r["class"] for tx, r in rows.items()} == {
        "ok-1": "ok",
        "stuck-1": "stuck_no_decision",
    }
    assert rows["ok-1"]["events"] == 2  # the forged "failed" is not counted
    assert rows["ok-1"]["invariants"] == []
    assert rows["stuck-1"]["decisions"] == 0  # the client's rollback is no decision
    assert summary["invalid_records"] == {"requests": 4, "events": 1, "decisions": 1}
    assert summary["signatures"]["forged_records"] == summary["invalid_records"]
    assert summary["signatures"]["dlq_forged"] == 1
    assert summary["signatures"]["dlq_unauthenticated"] == 2
    assert summary["dlq"]["records"] == 3
    assert summary["dlq"]["justified"] == 2
    assert summary["dlq"]["violations"] == 0
    assert summary["invariants"] == {"I1": 0, "I2": 0, "I3": 0, "I4": 0, "I6": 0, "I7": 0}
    assert summary["classes"]["violation"] == 0

    # Only the stuck saga's request is replayed, with its original signature.
    assert [(r.tx_id, r.kind, sent) for r, sent in result.resends] == [("stuck-1", "request", True)]
    original = delivered["stuck.request"]
    copies = [
        m
        for m in read_all(settings, t.requests)
        if m.key == b"stuck-1" and m.offset != original.offset
    ]
    assert len(copies) == 1
    copy = copies[0]
    assert copy.value == original.value
    assert copy.header("saga.replayed.by") == b"reconcile"
    sent_with = dict(records["stuck.request"][3])  # (a delivery report has no headers)
    assert copy.header("saga.sig") == sent_with["saga.sig"]
    assert copy.header("saga.kid") == sent_with["saga.kid"]
    check = Keyring.load(keys_dir).check(
        t.requests, copy.key, copy.value, copy.headers, frozenset({"client", "operator"})
    )
    assert check is None


class _Signing:
    """A producer that signs what it writes (as the coordinator's signed log does)."""

    def __init__(self, inner: Producer, keys: Keyring) -> None:
        self._inner = inner
        self._keys = keys

    def produce(
        self,
        topic: str,
        key: str | bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes]] | None = None,
        **rest: Any,
    ) -> None:
        self._inner.produce(topic, key, value, headers=self._keys.sign(topic, key, value, headers))


# ---------------------------------------------------------------- the pure parts, no services

T = KafkaSettings(bootstrap="unused:9092", prefix="p").topics


def _keys(tmp_path: Path) -> tuple[Path, dict[str, Keyring]]:
    folder = tmp_path / "keys"
    for principal in PRINCIPALS:
        create_key(folder, principal)
    return folder, {p: Keyring.load(folder, p) for p in PRINCIPALS}


def _dead_letter(
    keys: Keyring | None, original: tuple[str, int, int], key: bytes, value: bytes, error: str
) -> DeadLetter:
    headers = [
        ("saga.error", error.encode()),
        ("saga.source.topic", original[0].encode()),
        ("saga.source.partition", str(original[1]).encode()),
        ("saga.source.offset", str(original[2]).encode()),
        ("saga.component", b"coordinator"),
    ]
    if keys is not None:
        headers = keys.sign(T.dlq, key, value, headers)
    return DeadLetter(0, original[2], key, value, dict(headers), tuple(headers))


def test_dead_letters_with_a_key_folder(tmp_path: Path) -> None:
    """Only the coordinator's signed letters count; a letter of a record not signed by
    its writer was rightly rejected, one of a signed record was not."""
    folder, ring = _keys(tmp_path)
    verifier = Verifier(folder)
    request_value = request("t1")
    signed = ring["client"].sign(T.requests, b"t1", request_value)
    store = {
        (T.requests, 0, 1): (b"t1", request_value, []),  # unsigned
        (T.requests, 0, 2): (b"t1", request_value, signed),  # signed by the client
    }
    letters = [
        _dead_letter(ring["coordinator"], (T.requests, 0, 1), b"t1", request_value, "x"),
        _dead_letter(ring["coordinator"], (T.requests, 0, 2), b"t1", request_value, "x"),
        _dead_letter(None, (T.requests, 0, 2), b"t1", request_value, "x"),  # nobody signed
        _dead_letter(ring["client"], (T.requests, 0, 2), b"t1", request_value, "x"),
        # gone from the log: the coordinator's reason stands
        _dead_letter(
            ring["coordinator"],
            (T.requests, 0, 3),
            b"t1",
            request_value,
            "record is not signed: expected a signature by client or operator",
        ),
    ]

    def facts(txs: set[str]) -> dict[str, TxFacts]:
        return dict.fromkeys(txs, TxFacts(False, None, None))

    def originals(wanted: set[tuple[str, int, int]]) -> dict[tuple[str, int, int], Any]:
        return {w: store[w] for w in wanted if w in store}

    verdict = judge(letters, T, facts, verifier=verifier, originals=originals)
    assert (verdict.records, verdict.forged, verdict.unauthenticated) == (5, 2, 2)
    assert verdict.justified == 2
    assert verdict.violations == 1  # the signed request was wrongly rejected
    assert rejected_at(letters, T, verifier) == {T.requests: {(0, 1), (0, 2), (0, 3)}}
    assert rejected_at(letters, T) == {T.requests: {(0, 1), (0, 2), (0, 3)}}
    assert len(rejected_at(letters[2:3], T)) == 1 and rejected_at(letters[2:3], T, verifier) == {}


def test_a_replayed_record_keeps_its_signature(tmp_path: Path) -> None:
    folder, ring = _keys(tmp_path)
    verifier = Verifier(folder)
    tx = "t-replay"
    value = request(tx)
    home = partition_for(tx, 4)
    signed = ring["client"].sign(T.requests, tx, value)
    again = replay_headers([*signed, ("saga.replayed.by", b"an earlier replay")])
    assert again == [*signed, ("saga.replayed.by", b"reconcile")]
    assert verifier.record_ok(T.requests, tx.encode(), value, again, decode(value))

    resend = Resend(tx, "request", T.requests, home, 5, "stuck_no_decision")
    assert replayable(resend, tx.encode(), value, 4, headers=signed, verifier=verifier)
    assert replayable(resend, tx.encode(), value, 4)  # no key folder: no signature rule
    wrong = ring["participant-bank"].sign(T.requests, tx, value)
    assert not replayable(resend, tx.encode(), value, 4, headers=wrong, verifier=verifier)
    assert not replayable(resend, tx.encode(), value, 4, headers=[], verifier=verifier)
