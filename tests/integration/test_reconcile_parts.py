"""The reconciliation job's pure parts, without services: option parsing, the DLQ's
verdicts, the replay plan, the JDBC address, the benchmark's mix.

(They live beside the job's integration tests; they start nothing, hence ``unit``.)
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from saga.streams import (
    ConfigurationError,
    Decision,
    Mode,
    Outcome,
    SagaAbort,
    SagaRequest,
    Step,
    StepEvent,
    StepStatus,
    Topics,
    encode,
)
from saga.streams._limits import DLQ_EXCERPT_BYTES, MAX_RECORD_BYTES
from saga.streams.kafka import partition_for
from saga.streams.reconcile import parse_check, parse_duration_ms, parse_ledger, parse_table
from saga.streams.reconcile._config import parse_offsets, parse_since
from saga.streams.reconcile._dlq import DeadLetter, TxFacts, judge, rejected_at
from saga.streams.reconcile._replay import plan_resends
from saga.streams.reconcile._sources import jdbc_address
from saga.streams.reconcile._spark import SMALL_LOG, class_archive_options, shuffle_partitions_for
from saga.streams.reconcile.bench import expected_classes

pytestmark = pytest.mark.unit

T = Topics("p")


@pytest.mark.parametrize(
    ("text", "ms"),
    [("90", 90_000), ("1500ms", 1500), ("0.5s", 500), ("5m", 300_000), ("2h", 7_200_000)],
)
def test_durations(text: str, ms: int) -> None:
    assert parse_duration_ms(text, "--grace") == ms


def test_bad_duration() -> None:
    with pytest.raises(ConfigurationError, match="is not a duration"):
        parse_duration_ms("soon", "--grace")


def test_since() -> None:
    now = 1_800_000_000_000
    assert parse_since("30m", now) == now - 1_800_000
    assert parse_since("1700000000000", now) == 1_700_000_000_000
    assert parse_since("2023-11-14T22:13:20Z", now) == 1_700_000_000_000
    assert parse_since("2023-11-14T22:13:20", now) == 1_700_000_000_000  # UTC when naive
    with pytest.raises(ConfigurationError, match="--since"):
        parse_since("yesterday-ish", now)


def test_offsets() -> None:
    assert parse_offsets('{"p.events": {"0": 5, "2": 7}}', "x") == {"p.events": {0: 5, 2: 7}}
    with pytest.raises(ConfigurationError, match="must be integers"):
        parse_offsets('{"p.events": {"a": 5}}', "x")


def test_store_specs() -> None:
    ledger = parse_ledger("sql:postgresql://u:pw@h:5432/db#schema=bank&participants=a,b")
    assert ledger.store.kind == "sql"
    assert ledger.store.url == "postgresql://u:pw@h:5432/db"
    assert ledger.participants == ("a", "b")
    assert "pw" not in ledger.label
    table = parse_table("points=redis:redis://h:6379/0#prefix=saga")
    assert table.store.options["target"] == "points"  # a Redis table is one target
    assert parse_ledger("mongo:mongodb://h:27017/#database=shop").participants is None


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("sql:postgresql://u:secret@h/db#schema=x;drop", "not a plain name"),
        ("sql:postgresql://u:secret@h/db#colour=red", "unknown option"),
        ("mongo:postgresql://u:secret@h/db", "needs a mongodb://"),
    ],
)
def test_bad_store_specs_never_show_the_password(text: str, says: str) -> None:
    with pytest.raises(ConfigurationError, match=says) as caught:
        parse_ledger(text)
    assert "secret" not in str(caught.value)


def test_check_from_a_file(tmp_path: Path) -> None:
    sql = tmp_path / "money.sql"
    sql.write_text("SELECT 1 AS ok;\n")
    assert parse_check(f"money=@{sql}").sql == "SELECT 1 AS ok"
    with pytest.raises(ConfigurationError, match="cannot read"):
        parse_check(f"money=@{tmp_path / 'absent.sql'}")


def test_jdbc_address() -> None:
    assert jdbc_address("postgresql://saga:p%40ss@127.0.0.1:15432/saga?sslmode=require") == (
        "jdbc:postgresql://127.0.0.1:15432/saga?sslmode=require",
        {"driver": "org.postgresql.Driver", "user": "saga", "password": "p@ss"},
    )


def test_replay_plan_sends_decisions_first() -> None:
    rows = [
        {"tx_id": "a", "class": "stuck_no_decision", "replay": "request",
         "request_at": {"part": 1, "off": 10}, "decision_at": {"part": None, "off": None}},
        {"tx_id": "b", "class": "stuck_unfinished", "replay": "decision+request",
         "request_at": {"part": 2, "off": 3}, "decision_at": {"part": 2, "off": 4}},
        {"tx_id": "c", "class": "stuck_unfinished", "replay": "decision",
         "request_at": {"part": 0, "off": 1}, "decision_at": {"part": 0, "off": 9}},
        {"tx_id": "d", "class": "ok", "replay": None,
         "request_at": {"part": 0, "off": 2}, "decision_at": {"part": 0, "off": 5}},
    ]  # fmt: skip
    plan = plan_resends(rows, requests_topic=T.requests, decisions_topic=T.decisions)
    assert [(r.tx_id, r.kind, r.topic, r.partition, r.offset) for r in plan] == [
        ("b", "decision", T.decisions, 2, 4),
        ("c", "decision", T.decisions, 0, 9),
        ("a", "request", T.requests, 1, 10),
        ("b", "request", T.requests, 2, 3),
    ]


def _letter(source: str, key: str, value: bytes, offset: int = 0) -> DeadLetter:
    headers = {
        "saga.source.topic": source.encode(),
        "saga.source.offset": str(offset).encode(),
        "saga.component": b"coordinator",
    }
    return DeadLetter(0, offset, key.encode(), value, headers)


def test_dead_letters() -> None:
    first = SagaRequest("t1", "s", Mode.PARALLEL, (Step("a", "x"),), 10, 0)
    other = SagaRequest("t1", "s", Mode.PARALLEL, (Step("b", "y"),), 10, 0)
    event = StepEvent("t2", 0, "a", StepStatus.APPLIED, 5)
    letters = [
        _letter(T.requests, "junk", b"{"),  # invalid
        _letter(T.events, "t2", encode(Decision("t2", Outcome.COMMIT, "r", 1))),  # wrong type
        _letter(T.events, "elsewhere", encode(event)),  # keyed by another transaction
        _letter(T.requests, "t1", encode(other), offset=7),  # a conflicting resubmission
        _letter(T.requests, "t1", encode(SagaAbort("t1", "late", 9))),  # after the decision
        _letter(T.events, "t2", encode(event)),  # valid: wrongly rejected
        _letter(T.requests, "t3", encode(SagaAbort("t3", "early", 9))),  # t3 undecided
        _letter(T.requests, "t1", encode(first), offset=3),  # the accepted request itself
    ]
    asked: list[set[str]] = []

    def facts(txs: set[str]) -> dict[str, TxFacts]:
        asked.append(txs)
        return {
            "t1": TxFacts(decided=True, first_request=first, first_request_offset=3),
            "t2": TxFacts(decided=True, first_request=None, first_request_offset=None),
            "t3": TxFacts(decided=False, first_request=None, first_request_offset=None),
        }

    verdict = judge(letters, T, facts)
    assert asked == [{"t1", "t2", "t3"}]
    assert (verdict.records, verdict.invalid, verdict.justified) == (8, 2, 3)
    assert sorted(verdict.findings) == ["t1", "t2", "t3"]
    assert "valid saga.request" in verdict.findings["t1"][0]
    assert "valid saga.step" in verdict.findings["t2"][0]
    assert "valid saga.abort" in verdict.findings["t3"][0]
    assert verdict.violations == 3


def test_a_dead_letter_over_the_size_limit_was_rightly_rejected() -> None:
    """The excerpt of a record over the limit may decode as a valid record (a valid
    object, then blanks): the original was over the limit, so it was rightly rejected."""
    request = SagaRequest("t1", "s", Mode.PARALLEL, (Step("a", "x"),), 10, 0)
    excerpt = (encode(request) + b" " * DLQ_EXCERPT_BYTES)[:DLQ_EXCERPT_BYTES]
    truncated = _letter(T.requests, "t1", excerpt, offset=1)
    truncated.headers.update(
        {
            "saga.truncated": b"1",
            "saga.source.key.length": b"2",
            "saga.source.value.length": str(MAX_RECORD_BYTES).encode(),
        }
    )
    by_lengths = _letter(T.requests, "t1", excerpt, offset=2)  # no saga.truncated header
    by_lengths.headers["saga.source.value.length"] = str(MAX_RECORD_BYTES + 1).encode()
    whole = _letter(T.requests, "t1", encode(request) + b" " * MAX_RECORD_BYTES, offset=3)
    within = _letter(T.requests, "t1", excerpt, offset=4)  # the same bytes, not cut: valid

    def facts(txs: set[str]) -> dict[str, TxFacts]:
        return {"t1": TxFacts(decided=False, first_request=None, first_request_offset=None)}

    verdict = judge([truncated, by_lengths, whole], T, facts)
    assert (verdict.records, verdict.invalid, verdict.violations) == (3, 3, 0)
    assert judge([within], T, facts).violations == 1


def test_a_misplaced_or_expired_request_was_rightly_rejected() -> None:
    """A valid request on another partition than its key's, or one rejected as expired
    after its deadline, was rightly rejected; the same request otherwise was not."""
    tx = "t-misplaced"
    request = SagaRequest(tx, "s", Mode.PARALLEL, (Step("a", "x"),), 10, 0)
    home = partition_for(tx, 4)

    def placed(partition: int) -> DeadLetter:
        letter = _letter(T.requests, tx, encode(request))
        letter.headers["saga.source.partition"] = str(partition).encode()
        return letter

    def rejected(reason: bytes, at_ms: int) -> DeadLetter:
        letter = placed(home)
        letter.headers.update({"saga.error": reason, "saga.rejected.at_ms": str(at_ms).encode()})
        return letter

    def facts(txs: set[str]) -> dict[str, TxFacts]:
        return {tx: TxFacts(decided=False, first_request=None, first_request_offset=None)}

    wrong, right = placed((home + 1) % 4), placed(home)
    assert judge([wrong], T, facts, partitions=4).violations == 0
    assert judge([right], T, facts, partitions=4).violations == 1
    assert judge([wrong], T, facts).violations == 1  # no partition count: no such rule
    expired = rejected(b"request expired: its deadline passed", 11)
    assert judge([expired], T, facts, partitions=4).violations == 0
    assert judge([rejected(b"request expired: ...", 10)], T, facts).violations == 1
    assert judge([rejected(b"something else", 11)], T, facts).violations == 1


def test_only_records_the_coordinator_accepts_are_replayed() -> None:
    """A hostile request the coordinator has not read yet may look stuck to the audit;
    re-published, one on another partition than its key's would become a real saga."""
    from saga.streams.reconcile._replay import Resend, replayable

    tx = "t-replay"
    request = encode(SagaRequest(tx, "s", Mode.PARALLEL, (Step("a", "x"),), 10, 0))
    home = partition_for(tx, 4)

    def resend(kind: str, partition: int) -> Resend:
        topic = T.requests if kind == "request" else T.decisions
        return Resend(tx, kind, topic, partition, 5, "stuck_no_decision")  # type: ignore[arg-type]

    assert replayable(resend("request", home), tx.encode(), request, 4)
    assert not replayable(resend("request", (home + 1) % 4), tx.encode(), request, 4)
    assert not replayable(resend("request", home), b"other", request, 4)
    deep = request.replace(b'"args":{}', b'"args":{"x":' + b"[" * 40 + b"]" * 40 + b"}")
    assert deep != request and not replayable(resend("request", home), tx.encode(), deep, 4)
    decision = encode(Decision(tx, Outcome.ROLLBACK, "deadline passed", 11))
    assert replayable(resend("decision", home), tx.encode(), decision, 4)
    assert not replayable(resend("decision", home), tx.encode(), request, 4)


def test_where_the_coordinator_rejected_records() -> None:
    """Only the coordinator's letters, only for the audited topics, only with coordinates."""

    def letter(source: str, partition: str, offset: str, component: bytes) -> DeadLetter:
        headers = {
            "saga.source.topic": source.encode(),
            "saga.source.partition": partition.encode(),
            "saga.source.offset": offset.encode(),
            "saga.component": component,
        }
        return DeadLetter(0, 0, b"k", b"v", headers)

    letters = [
        letter(T.requests, "2", "7", b"coordinator"),
        letter(T.requests, "2", "7", b"coordinator"),  # the same record twice
        letter(T.events, "0", "1", b"coordinator"),
        letter(T.decisions, "1", "12", b"coordinator"),
        letter(T.status, "0", "3", b"coordinator"),  # not audited
        letter(T.events, "0", "2", b"participant"),  # not the coordinator's verdict
        letter(T.events, "0", "x", b"coordinator"),  # no coordinates
        DeadLetter(0, 0, b"k", b"v", {"saga.component": b"coordinator"}),
    ]
    assert rejected_at(letters, T) == {
        T.requests: {(2, 7)},
        T.events: {(0, 1)},
        T.decisions: {(1, 12)},
    }


def test_benchmark_mix_adds_up() -> None:
    for sagas in (1, 999, 1000, 2000, 1_000_000):
        assert sum(expected_classes(sagas).values()) == sagas
    assert expected_classes(1000) == {
        "ok": 950,
        "in_flight": 20,
        "stuck_no_decision": 10,
        "stuck_unfinished": 10,
        "compensation_failed": 5,
        "violation": 5,
    }


def test_shuffle_partitions_follow_the_size_of_the_log() -> None:
    """Two for the demo's log (one per core of a small machine), eight for millions."""
    assert shuffle_partitions_for(0) == 2
    assert shuffle_partitions_for(16_053) == 2
    assert shuffle_partitions_for(SMALL_LOG) == 4
    assert shuffle_partitions_for(5_875_000) == 8


def test_the_class_archive_is_written_once_then_used(tmp_path: Path) -> None:
    """No archive yet: the JVM is asked to write one (a name of its own); once there,
    to map it; a jar that changed asks for a new one and the old one goes."""
    jar = tmp_path / "extra.jar"
    jar.write_bytes(b"x")
    environ = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    first = class_archive_options([jar], environ)
    assert "-Xlog:cds*=off" in first
    [write] = [o for o in first if o.startswith("-XX:ArchiveClassesAtExit=")]
    archive = Path(write.split("=", 1)[1])
    assert archive.parent == tmp_path / "cache" / "saga-olep"
    assert class_archive_options([jar], environ) == []  # the first run's JVM will write it
    archive.write_bytes(b"archive")  # what the JVM does as it exits
    assert class_archive_options([jar], environ) == []  # it may still be writing
    os.utime(archive, (time.time() - 60, time.time() - 60))
    assert f"-XX:SharedArchiveFile={archive}" in class_archive_options([jar], environ)
    jar.write_bytes(b"changed")
    again = class_archive_options([jar], environ)
    assert any(o.startswith("-XX:ArchiveClassesAtExit=") for o in again)
    assert not archive.exists()
    assert [p.suffix for p in archive.parent.iterdir()] == [".claim"]
    # A cache folder that cannot be made: no archive, no failure.
    (tmp_path / "file").write_bytes(b"")
    assert class_archive_options([jar], {"XDG_CACHE_HOME": str(tmp_path / "file")}) == []


def test_public_names() -> None:
    from saga.streams import reconcile

    assert set(reconcile.__all__) == {
        "CLASSES",
        "DEFAULT_GRACE_MS",
        "INVARIANTS",
        "BusinessCheck",
        "LedgerSource",
        "ReconcileConfig",
        "ReconcileError",
        "RunResult",
        "StoreSpec",
        "TableSource",
        "parse_check",
        "parse_duration_ms",
        "parse_ledger",
        "parse_table",
        "run",
    }
    assert reconcile.CLASSES == (
        "violation",
        "early_effect",
        "compensation_failed",
        "resolved_by_hand",
        "stuck_no_decision",
        "stuck_unfinished",
        "in_flight",
        "ok",
    )
