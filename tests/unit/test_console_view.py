"""The console's materialised view of the status topic, on the in-memory log and SQLite.

Status records become rows, a tombstone deletes its row, an undecodable record
and (with keys) a forged one change nothing, dead letters are listed, and a view
started again on the same database resumes from the offsets stored with its rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from saga.coordinator._console import StatusTable, ViewStore
from saga.streams import (
    KafkaSettings,
    SagaState,
    SagaStatus,
    StepProgress,
    StepStatus,
    encode,
)
from saga.streams._signed_log import SignedLog
from saga.streams._signing import COORDINATOR, Keyring, create_key
from saga.streams.testing import InMemoryLog

pytestmark = pytest.mark.unit

SETTINGS = KafkaSettings(bootstrap="memory:9092", prefix="view")


def status(
    tx_id: str,
    state: SagaState = SagaState.PENDING,
    *,
    saga: str = "transfer",
    updated_ms: int = 2_000,
    steps: tuple[tuple[str, StepStatus], ...] = (("ledger", StepStatus.APPLIED),),
    reason: str | None = None,
) -> SagaStatus:
    return SagaStatus(
        tx_id=tx_id,
        saga=saga,
        state=state,
        steps=tuple(StepProgress(p, s) for p, s in steps),
        reason=reason,
        created_ms=1_000,
        updated_ms=updated_ms,
        deadline_ms=60_000,
    )


@pytest.fixture
def log() -> InMemoryLog:
    made = InMemoryLog(SETTINGS)
    made.create_topics(partitions=2)
    return made


def write(log: InMemoryLog, *records: tuple[str, bytes | None]) -> None:
    with log.producer() as producer:
        for key, value in records:
            producer.produce(SETTINGS.topics.status, key, value)


def drain(table: StatusTable) -> None:
    """Read until a poll returns nothing (the in-memory log hands out what it has)."""
    for _ in range(50):
        if table.step(timeout=0.01) == 0:
            return
    raise AssertionError("the view kept reading")


def test_status_records_become_rows_and_a_tombstone_deletes_its_row(log: InMemoryLog) -> None:
    store = ViewStore(":memory:")
    table = StatusTable(log, store)
    write(
        log,
        ("tx-1", encode(status("tx-1"))),
        ("tx-2", encode(status("tx-2", saga="order", steps=(("shop", StepStatus.PENDING),)))),
        ("tx-1", encode(status("tx-1", SagaState.COMMITTED, updated_ms=3_000, reason="done"))),
    )
    drain(table)
    assert table.wait_caught_up(0)
    row = store.saga("tx-1")
    assert row is not None
    assert (row["state"], row["reason"], row["updated_ms"]) == ("committed", "done", 3_000)
    assert row["steps"] == [{"participant": "ledger", "status": "applied"}]
    assert [r["tx_id"] for r in store.sagas()] == ["tx-1", "tx-2"]  # newest first
    assert [r["tx_id"] for r in store.sagas(q="tx-2")] == ["tx-2"]
    assert [r["tx_id"] for r in store.sagas(q="ord")] == ["tx-2"]  # a saga name's prefix
    assert [r["tx_id"] for r in store.sagas(state="pending")] == ["tx-2"]
    assert [r["tx_id"] for r in store.sagas(participant="shop")] == ["tx-2"]
    assert store.sagas(q="%") == []  # a LIKE wildcard is searched for, not expanded

    write(log, ("tx-1", None))
    drain(table)
    assert store.saga("tx-1") is None
    assert store.metrics(now_ms=3_000)["counts"]["pending"] == 1


def test_an_undecodable_or_mismatched_record_changes_nothing(log: InMemoryLog) -> None:
    store = ViewStore(":memory:")
    table = StatusTable(log, store)
    write(log, ("tx-1", encode(status("tx-1"))))
    drain(table)
    write(
        log,
        ("tx-1", b"\xff not json"),
        ("tx-1", b'{"v": 1, "type": "saga.status"}'),
        ("tx-1", encode(status("tx-other", SagaState.COMMITTED))),  # key and tx_id disagree
        ("tx-\x00", None),  # a tombstone whose key is no transaction id
    )
    drain(table)
    row = store.saga("tx-1")
    assert row is not None and row["state"] == "pending"
    assert store.saga("tx-other") is None


def test_with_keys_a_forged_status_record_is_skipped(log: InMemoryLog, tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    create_key(folder, COORDINATOR)
    create_key(folder, "client")
    coordinator = Keyring.load(folder, COORDINATOR)
    stranger = Keyring.load(folder, "client")
    store = ViewStore(":memory:")
    table = StatusTable(log, store, keys=Keyring.load(folder))
    for signer, record in (
        (coordinator, status("tx-1")),
        (stranger, status("tx-1", SagaState.COMMITTED, updated_ms=5_000)),
    ):
        with SignedLog(log, signer).producer() as producer:
            producer.produce(SETTINGS.topics.status, record.tx_id, encode(record))
    write(log, ("tx-2", encode(status("tx-2"))))  # not signed at all
    drain(table)
    row = store.saga("tx-1")
    assert row is not None and row["state"] == "pending"
    assert store.saga("tx-2") is None
    assert table.forged == 2


def test_a_view_started_again_resumes_from_its_stored_offsets(
    log: InMemoryLog, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'console.db'}"
    first = ViewStore(url)
    table = StatusTable(log, first)
    write(log, ("tx-1", encode(status("tx-1"))))
    drain(table)
    table.stop()
    first.close()

    write(log, ("tx-2", encode(status("tx-2"))))
    again = ViewStore(url)
    offsets = again.offsets([SETTINGS.topics.status])
    assert sum(offsets.values()) == 1  # tx-1's record was applied, and only it
    # Had it read from the start, a row deleted by hand would come back.
    with again._transaction() as cur:
        cur.execute("DELETE FROM sagas WHERE tx_id = ?", ("tx-1",))
    table = StatusTable(log, again)
    drain(table)
    assert [r["tx_id"] for r in again.sagas()] == ["tx-2"]


def test_stored_offsets_past_the_topics_end_rebuild_the_view(
    log: InMemoryLog, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'console.db'}"
    store = ViewStore(url)
    store.apply([status("old")], [], [], {(SETTINGS.topics.status, 0): 99})
    write(log, ("tx-1", encode(status("tx-1"))))
    drain(StatusTable(log, store))
    assert [r["tx_id"] for r in store.sagas()] == ["tx-1"]


def test_dead_letters_are_listed_with_their_headers(log: InMemoryLog) -> None:
    store = ViewStore(":memory:")
    table = StatusTable(log, store)
    with log.producer() as producer:
        producer.produce(
            SETTINGS.topics.dlq,
            "tx-9",
            b"\x00garbage",
            headers=[
                ("saga.error", b"not JSON"),
                ("saga.source.topic", SETTINGS.topics.requests.encode()),
                ("saga.source.partition", b"1"),
                ("saga.source.offset", b"not a number"),
            ],
        )
    drain(table)
    [letter] = store.dead_letters()
    assert letter["tx_id"] == "tx-9"
    assert letter["error"] == "not JSON"
    assert (letter["source_topic"], letter["source_partition"]) == (SETTINGS.topics.requests, 1)
    assert letter["source_offset"] is None
    assert letter["size"] == 8
    assert letter["excerpt"] == "\ufffdgarbage"  # PostgreSQL text holds no NUL
    assert store.metrics(now_ms=0)["dlq"] == 1
