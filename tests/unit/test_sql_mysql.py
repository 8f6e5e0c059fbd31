"""The SQL adapter's MySQL and MariaDB pieces, compiled without a server
(:mod:`participants.sql._mysql`); tests/integration runs them on the local MariaDB."""

from __future__ import annotations

from decimal import Decimal

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.dialects.mysql.mariadb import MariaDBDialect
from sqlalchemy.schema import CreateTable

from saga.participants.sql import _mysql
from saga.participants.sql._holds import define_holds
from saga.participants.sql._ledger import define_ledger
from saga.participants.sql._values import column_range
from saga.streams import ConfigurationError

pytestmark = pytest.mark.unit

MYSQL = mysql.dialect()
MARIADB = MariaDBDialect()


def sql(statement: sa.Executable, dialect: sa.Dialect = MARIADB) -> str:
    return " ".join(str(statement.compile(dialect=dialect)).split())  # type: ignore[attr-defined]


def test_urls_name_pymysql_and_messages_name_the_server() -> None:
    url = _mysql.driver_url(sa.make_url("mariadb://saga:secret@db:3306/shop"))
    assert url.drivername == "mariadb+pymysql"
    assert _mysql.driver_url(sa.make_url("mysql://db/shop")).drivername == "mysql+pymysql"
    assert _mysql.driver_url(sa.make_url("mysql+mysqldb://db/shop")).drivername == "mysql+mysqldb"
    assert _mysql.is_mysql_url(url) and not _mysql.is_mysql_url(sa.make_url("sqlite://"))
    assert _mysql.describe(url) == "MariaDB at db:3306/shop"
    assert _mysql.describe(sa.make_url("mysql://u:p@db/shop")) == "MySQL at db/shop"


@pytest.mark.parametrize("dialect", [MYSQL, MARIADB], ids=["mysql", "mariadb"])
def test_the_ledger_tables_are_utf8mb4_and_binary(dialect: sa.Dialect) -> None:
    """``T1`` and ``t1`` are two transactions: the server's default collation would
    make them one key."""
    metadata = sa.MetaData()
    tables = [
        define_ledger(metadata),
        define_holds(metadata, "saga_ledger"),
        _mysql.define_locks(metadata, "saga_ledger", ["accounts"]),
    ]
    for table in tables:
        ddl = sql(CreateTable(table), dialect)
        assert ddl.endswith("CHARSET=utf8mb4 COLLATE utf8mb4_bin"), ddl
    # Elsewhere the options are ignored.
    assert "utf8mb4" not in sql(CreateTable(tables[0]), sa.dialects.postgresql.dialect())


def test_the_lock_table_cannot_be_a_target() -> None:
    with pytest.raises(ConfigurationError, match="saga_ledger_locks cannot also be a target"):
        _mysql.define_locks(sa.MetaData(), "saga_ledger", ["saga_ledger_locks"])


def test_locks_are_taken_in_ascending_order() -> None:
    table = _mysql.define_locks(sa.MetaData(), "saga_ledger", [])
    statement = _mysql.record_locks(table, [5, -1, 5 + _mysql.RECORD_BUCKETS])
    text = sql(statement)
    assert text.endswith("ORDER BY saga_ledger_locks.bucket FOR UPDATE"), text
    params = statement.compile(dialect=MARIADB).params  # type: ignore[attr-defined]
    assert sorted(params.values(), key=str) == ["", [5, _mysql.RECORD_BUCKETS - 1]]


def test_bulk_writes() -> None:
    metadata = sa.MetaData()
    accounts = sa.Table(
        "accounts",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("balance", sa.Integer),
    )
    rows = [{"id": i, "balance": 10 * i} for i in range(1, 1002)]
    statements = _mysql.case_updates(accounts, accounts.c.id, ["balance"], rows)
    assert len(statements) == 3  # 500 rows each
    text = sql(statements[0])
    assert text.startswith("UPDATE accounts SET balance=CASE accounts.id WHEN")
    assert "ELSE accounts.balance END WHERE accounts.id IN" in text
    ledger = define_ledger(metadata)
    upsert = sql(_mysql.upsert(ledger, ["status", "updated_ms"]))
    assert upsert.endswith(
        "ON DUPLICATE KEY UPDATE status = VALUES(status), updated_ms = VALUES(updated_ms)"
    )
    prune = sql(_mysql.limited(sa.delete(ledger).where(ledger.c.step >= 0), 100))
    assert prune.endswith("LIMIT 100"), prune


@pytest.mark.parametrize(
    ("kind", "low", "high"),
    [
        (mysql.TINYINT(), -(2**7), 2**7 - 1),
        (mysql.SMALLINT(), -(2**15), 2**15 - 1),
        (mysql.MEDIUMINT(), -(2**23), 2**23 - 1),
        (mysql.INTEGER(), -(2**31), 2**31 - 1),
        (mysql.INTEGER(unsigned=True), 0, 2**32 - 1),
        (mysql.BIGINT(), -(2**63), 2**63 - 1),
        (mysql.DECIMAL(5, 2), Decimal("-999.99"), Decimal("999.99")),
    ],
)
def test_what_a_mysql_column_holds(
    kind: sa.types.TypeEngine[object], low: object, high: object
) -> None:
    """An increment is refused when it is reserved, not when its commit meets the column."""
    column = sa.Column("n", kind)
    got = column_range(column, "mariadb")
    assert got is not None
    assert got == (low, high)
