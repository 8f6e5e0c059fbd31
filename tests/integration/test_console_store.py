"""The console's view in PostgreSQL (``--db postgresql://...``), against the real server;
and ``saga console`` on a prefix whose topics do not exist.

The same store code as the SQLite default, through psycopg: rows, search, a
tombstone, dead letters with a NUL byte (PostgreSQL text holds none), the audit
trail, and offsets that a second store on the same database reads back. The test's
own schema is chosen through the URL (``options=-csearch_path=...``), as the README
suggests for one console per topic prefix.
"""

from __future__ import annotations

import subprocess
import sys
from urllib.parse import quote

import pytest

from saga.coordinator._console import ViewStore
from saga.coordinator._console._store import DeadLetter
from saga.streams import ConfigurationError, SagaState, SagaStatus, StepProgress, StepStatus
from tests._infra import Services, unique_name

pytestmark = pytest.mark.integration


def status(tx_id: str, state: SagaState, updated_ms: int) -> SagaStatus:
    return SagaStatus(
        tx_id=tx_id,
        saga="transfer\x00",
        state=state,
        steps=(StepProgress("ledger", StepStatus.APPLIED),),
        reason=None,
        created_ms=1_000,
        updated_ms=updated_ms,
        deadline_ms=60_000,
    )


def test_the_view_in_postgresql(services: Services, pg_schema: tuple[str, str]) -> None:
    _, schema = pg_schema
    url = services.postgres_url + "?options=" + quote(f"-csearch_path={schema}")
    store = ViewStore(url)
    assert store.kind == "postgresql"
    letter = DeadLetter(0, 7, "tx-9", "not JSON", "t.requests", 0, 3, 5_000, 4, "\x00abc")
    store.apply(
        [status("tx-1", SagaState.PENDING, 2_000), status("tx-2", SagaState.COMMITTED, 3_000)],
        [],
        [letter],
        {("t.status", 0): 2, ("t.dlq", 0): 8},
    )
    store.apply([], ["tx-2"], [letter], {("t.status", 0): 3})
    store.record_action(4_000, "alice", "abort", "tx-1", "stuck", "sent")

    again = ViewStore(url)
    assert again.offsets(["t.status", "t.dlq"]) == {("t.status", 0): 3, ("t.dlq", 0): 8}
    assert [r["tx_id"] for r in again.sagas(q="tx")] == ["tx-1"]
    assert again.sagas(q="tx_") == []  # "_" is searched for, not a wildcard
    assert again.sagas(q="tx-")[0]["saga"] == "transfer\ufffd"
    assert again.sagas(state="committed") == []
    assert again.sagas(participant="ledger")[0]["tx_id"] == "tx-1"
    [dead] = again.dead_letters()
    assert dead["excerpt"] == "\ufffdabc"
    assert again.metrics(now_ms=4_000)["counts"]["pending"] == 1
    assert again.audit()[0]["operator"] == "alice"
    store.close()
    again.close()


def test_a_database_that_cannot_be_opened_is_one_sentence_without_the_password(
    services: Services,
) -> None:
    url = "postgresql://saga:s3cret-pass@127.0.0.1:1/saga"
    with pytest.raises(ConfigurationError) as caught:
        ViewStore(url)
    assert "s3cret-pass" not in str(caught.value)
    assert "cannot open the console database" in str(caught.value)


def test_a_prefix_without_topics_is_one_sentence(services: Services) -> None:
    args = ["--prefix", unique_name("none"), "--bootstrap", services.kafka_bootstrap]
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "console", *args, "--db", ":memory:", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "there is no topic" in done.stderr and "--prefix" in done.stderr
