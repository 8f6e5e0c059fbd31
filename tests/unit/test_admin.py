"""The admin library (coordinator._admin) on the in-memory log: history, list, dead letters.

Records are written as the services would write them; no coordinator runs.
"""

from __future__ import annotations

import pytest

from saga.coordinator import _admin
from saga.streams import (
    ConfigurationError,
    Decision,
    KafkaSettings,
    Mode,
    Outcome,
    SagaRequest,
    SagaState,
    SagaStatus,
    Step,
    StepEvent,
    StepProgress,
    StepsCommitted,
    StepStatus,
    encode,
    to_dict,
)
from saga.streams.kafka import Message, send_to_dlq
from saga.streams.testing import InMemoryLog, ManualClock, key_on

pytestmark = pytest.mark.unit

SETTINGS = KafkaSettings(bootstrap="memory:9092", prefix="adm")
TOPICS = SETTINGS.topics


@pytest.fixture
def log() -> InMemoryLog:
    made = InMemoryLog(SETTINGS, clock=ManualClock())
    made.create_topics(3)
    return made


def _status(tx_id: str, state: SagaState, created_ms: int, saga: str = "transfer") -> SagaStatus:
    return SagaStatus(
        tx_id=tx_id,
        saga=saga,
        state=state,
        steps=(
            StepProgress("bank", StepStatus.PENDING),
            StepProgress("shop", StepStatus.PENDING),
        ),
        reason=None,
        created_ms=created_ms,
        updated_ms=created_ms,
        deadline_ms=created_ms + 30_000,
        fingerprint="f" * 32,
    )


def _write(log: InMemoryLog, topic: str, key: str, value: bytes | None, ts: int) -> None:
    with log.producer() as producer:
        producer.produce(topic, key, value, timestamp_ms=ts)
        producer.flush()


def test_history_orders_every_record_of_the_transaction(log: InMemoryLog) -> None:
    request = SagaRequest(
        "tx-1", "transfer", Mode.PARALLEL, (Step("bank", "insert", {"target": "t"}),), 9_000, 1_000
    )
    _write(log, TOPICS.requests, "tx-1", encode(request), 1_000)
    _write(log, TOPICS.requests, "tx-2", encode(request), 1_001)  # another transaction
    _write(
        log,
        TOPICS.events,
        "tx-1",
        encode(StepEvent("tx-1", 0, "bank", StepStatus.APPLIED, 1_100)),
        1_100,
    )
    _write(
        log,
        TOPICS.decisions,
        "tx-1",
        encode(Decision("tx-1", Outcome.COMMIT, "all steps applied", 1_200)),
        1_200,
    )
    _write(log, TOPICS.status, "tx-1", encode(_status("tx-1", SagaState.COMMITTING, 1_000)), 1_200)
    _write(log, TOPICS.requests, "tx-1", b"{not json", 1_300)

    entries = _admin.history(log, "tx-1", timeout=2)

    assert [e.kind for e in entries] == [
        "saga.request",
        "saga.step",
        "saga.decision",
        "saga.status",
        "invalid",
    ]
    assert entries[2].summary == "commit: all steps applied"
    assert entries[4].record is None and "does not decode" in entries[4].summary
    assert all(e.partition == entries[0].partition for e in entries)


def test_history_shows_dead_letters_and_redrives(log: InMemoryLog) -> None:
    _write(log, TOPICS.requests, "tx-9", b'{"v": 1, "type": "saga.request"}', 1_000)
    bad = log.records(TOPICS.requests)[0]
    with log.producer() as producer:
        send_to_dlq(
            producer, TOPICS, bad, "missing field tx_id", component="coordinator", at_ms=1_001
        )
        producer.flush()
    (letter,) = _admin.dead_letters(log, source_topic="requests")
    assert letter.reason == "missing field tx_id" and letter.source_offset == bad.offset
    assert _admin.dead_letter(log, letter.partition, letter.offset) == letter
    assert _admin.dead_letter(log, letter.partition, letter.offset + 5) is None

    topic, _, _ = _admin.redrive(log, letter, by="ann@host")

    assert topic == TOPICS.requests
    entries = _admin.history(log, "tx-9", timeout=2)
    assert sorted(e.kind for e in entries) == ["dlq", "invalid", "redrive"]
    (again,) = (e for e in entries if e.kind == "redrive")
    assert "does not decode" in again.summary and "ann@host" in again.summary
    copy = log.records(TOPICS.requests)[-1]
    assert copy.header(_admin.REDRIVEN_FROM) == letter.where.encode()
    assert copy.header(_admin.REDRIVEN_BY) == b"ann@host"


def test_redrive_refuses_a_truncated_dead_letter(log: InMemoryLog) -> None:
    big = Message(TOPICS.requests, 0, 7, b"tx", b"x" * 2_000_000)
    with log.producer() as producer:
        send_to_dlq(producer, TOPICS, big, "too large", component="coordinator")
        producer.flush()
    (letter,) = _admin.dead_letters(log)
    assert letter.truncated
    with pytest.raises(ConfigurationError, match="cannot be redriven"):
        _admin.redrive(log, letter, by="ann")


def test_list_sagas_filters_by_state_age_saga_and_participant(log: InMemoryLog) -> None:
    _write(log, TOPICS.status, "old", encode(_status("old", SagaState.PENDING, 1_000)), 1)
    _write(log, TOPICS.status, "new", encode(_status("new", SagaState.PENDING, 90_000)), 2)
    _write(
        log, TOPICS.status, "done", encode(_status("done", SagaState.PENDING, 1_000, "other")), 3
    )
    _write(
        log, TOPICS.status, "done", encode(_status("done", SagaState.COMMITTED, 1_000, "other")), 4
    )
    _write(log, TOPICS.status, "gone", encode(_status("gone", SagaState.PENDING, 1_000)), 5)
    _write(log, TOPICS.status, "gone", None, 6)
    _write(log, TOPICS.status, "junk", b"\xff", 7)

    every = {r.tx_id for r in _admin.list_sagas(log)}
    assert every == {"old", "new", "done"}
    pending = _admin.list_sagas(log, states=["pending"])
    assert {r.tx_id for r in pending} == {"old", "new"}
    stuck = _admin.list_sagas(log, states=["pending"], older_than_ms=60_000, now_ms=100_000)
    assert [r.tx_id for r in stuck] == ["old"]
    assert [r.tx_id for r in _admin.list_sagas(log, saga="other")] == ["done"]
    assert _admin.list_sagas(log, participant="nobody") == []
    assert len(_admin.list_sagas(log, participant="shop", limit=2)) == 2
    with pytest.raises(ConfigurationError, match="unknown saga state"):
        _admin.list_sagas(log, states=["stuck"])
    standing = _admin.standing(log, "done", timeout=2)
    assert standing is not None and standing.state is SagaState.COMMITTED
    assert _admin.standing(log, "gone", timeout=2) is None


def test_history_shows_a_saga_committed_under_another_transactions_key(log: InMemoryLog) -> None:
    # the commits of `tx` acknowledged in a record keyed by `first`, on the same partition
    first, tx, other = key_on(1, 3), key_on(1, 3, 1), key_on(1, 3, 2)
    ack = StepsCommitted("bank", 1_250, ((first, 0), (tx, 0), (tx, 1)))
    _write(log, TOPICS.events, first, encode(ack), 1_250)
    _write(log, TOPICS.events, other, encode(StepsCommitted("bank", 1_260, ((other, 0),))), 1_260)

    entries = _admin.history(log, tx, timeout=2)

    assert [e.kind for e in entries] == ["saga.committed"]
    assert "steps 0, 1 bank committed" in entries[0].summary
    assert tx not in _admin.summarize(to_dict(ack), first)
    assert _admin.summarize(to_dict(ack)) == f"bank committed 3 steps: {first}:0, {tx}:0, {tx}:1"
