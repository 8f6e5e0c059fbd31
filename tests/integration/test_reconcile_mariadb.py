"""The reconciliation job's readers on a MariaDB participant's ledger and tables.

A real SQL participant (:class:`participants.sql.SqlStorage`) on the local MariaDB writes
its ledger: a ``read_committed`` step committed, a ``none`` step rolled back, a step
refused. The job reads that ledger here with PyMySQL (a ``local`` master) and through
Spark's JDBC source with MariaDB Connector/J (a cluster run), and the business table
through JDBC: each gives the same rows as the participant's own ledger.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _mariadb import MARIADB_URL, mariadb_database
from test_sql_storage import Database, commit, requested, rollback, sql_harness

from saga.participants._storage import Storage
from saga.streams import Isolation
from saga.streams.kafka import KafkaSettings
from saga.streams.reconcile import ReconcileConfig
from saga.streams.reconcile import _sources as sources
from saga.streams.reconcile._config import TableSource, parse_ledger, parse_table
from saga.streams.reconcile._spark import ReconcileError, check_jars, start_spark
from tests._infra import Services

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def spark(services: Services, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    config = ReconcileConfig(
        settings=KafkaSettings(bootstrap=services.kafka_bootstrap),
        out=tmp_path_factory.mktemp("unused"),
        master="local[2]",
        driver_memory="1g",
        shuffle_partitions=2,
    )
    session = start_spark(config, check_jars(services.spark_jars_dir))
    yield session
    session.stop()


@pytest.fixture
def ledger() -> Iterator[tuple[Database, Storage]]:
    """A MariaDB database whose participant ``bank`` recorded three sagas."""
    with mariadb_database() as db, sql_harness(db) as harness:
        storage = harness.storage
        bump = {"target": "accounts", "key": 1, "field": "balance", "by": -10, "min": 0}
        storage.execute([requested("T1", "increment", bump)])
        storage.execute([commit("T1")])
        storage.execute([requested("T2", "increment", bump, isolation=Isolation.NONE)])
        storage.execute([rollback("T2")])
        refused = {"target": "accounts", "key": 404, "set": {"owner": "nobody"}}
        storage.execute([requested("T3", "update", refused)])
        yield db, storage


def spec(db: Database) -> str:
    return f"sql:{MARIADB_URL}#schema={db.schema}"


def expected(storage: Storage) -> list[tuple[Any, ...]]:
    """What the participant's own ledger says, as the job's rows."""
    return sorted(
        (
            "bank",
            e.tx_id,
            e.step,
            str(e.status),
            e.effect,
            "read_committed" if e.before == {"saga.isolation": "read_committed"} else "none",
        )
        for e in storage.ledger()
    )


def rows(frame: Any) -> list[tuple[Any, ...]]:
    columns = ["participant", "tx_id", "step", "status", "effect", "level"]
    return sorted(tuple(r) for r in frame.select(*columns).collect())


def test_the_ledger_read_here_matches_the_participants(
    spark: Any, ledger: tuple[Database, Storage], tmp_path: Path
) -> None:
    """A ``local`` run reads the ledger with PyMySQL: every step entry, with its level."""
    db, storage = ledger
    frame, counts = sources.ledger_frame(spark, parse_ledger(spec(db)), tmp_path)
    assert counts == {"bank": 3}
    got = rows(frame)
    assert got == expected(storage)
    assert [(r[1], r[3], r[5]) for r in got] == [
        ("T1", "committed", "read_committed"),
        ("T2", "compensated", "none"),
        ("T3", "failed", "read_committed"),
    ]


def test_the_jdbc_reader_matches_the_participants(
    spark: Any, ledger: tuple[Database, Storage], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster run reads the ledger through JDBC (MariaDB Connector/J), the same rows."""
    db, storage = ledger
    monkeypatch.setattr(sources, "reads_here", lambda spark: False)
    frame, counts = sources.ledger_frame(spark, parse_ledger(spec(db)))
    assert counts is None
    assert rows(frame) == expected(storage)


def test_a_table_is_read_through_jdbc(spark: Any, ledger: tuple[Database, Storage]) -> None:
    """The business table for the invariants, through JDBC: T1's debit is in, T2's is not."""
    db, _ = ledger
    table = parse_table(f"accounts={spec(db)}")
    assert isinstance(table, TableSource)
    frame = sources.table_frame(spark, table)
    balances = {r["id"]: r["balance"] for r in frame.collect()}
    assert balances == {1: 90, 2: 50}


def test_ping_names_a_missing_ledger_table(ledger: tuple[Database, Storage]) -> None:
    db, _ = ledger
    store = parse_ledger(spec(db)).store
    sources.ping(store, "saga_ledger")
    with pytest.raises(ReconcileError, match=r"has no table `.*`\.`no_such_ledger`"):
        sources.ping(store, "no_such_ledger")
