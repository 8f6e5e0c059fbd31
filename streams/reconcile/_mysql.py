"""SQL ledgers and tables on MySQL and MariaDB (``sql:mariadb://...``, ``sql:mysql://...``).

As for PostgreSQL (:mod:`streams.reconcile._sources`): a cluster run reads through
Spark's JDBC source with MariaDB Connector/J (``org.mariadb.jdbc:mariadb-java-client``
from Maven Central, in the jars folder beside PostgreSQL's driver), which also reads
MySQL servers; a ``local`` run reads the ledger here with PyMySQL (the ``mysql``
extra), streamed by an unbuffered cursor. Names are quoted with backticks, and a
``schema`` option names the database (MySQL's schemas are databases); without it, the
URL's database. The URL's query options are not passed to PyMySQL or JDBC.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final
from urllib.parse import unquote, urlsplit

from saga.streams.reconcile._config import StoreSpec
from saga.streams.reconcile._isolation import LEVEL_KEY, level_of
from saga.streams.reconcile._spark import ReconcileError

SCHEMES: Final = ("mysql", "mariadb")
_TIMEOUT_S: Final = 10


def is_mysql(url: str) -> bool:
    """Whether ``url`` is a MySQL or MariaDB address."""
    return urlsplit(url).scheme in SCHEMES


def jdbc_address(url: str) -> tuple[str, dict[str, str]]:
    """``mariadb://user:pw@host:port/db`` as a Connector/J URL and its user/password.

    The URL says ``jdbc:mysql:`` (which Connector/J takes with ``permitMysqlScheme``):
    Spark picks its SQL dialect by the URL's prefix, and knows only MySQL's; with a
    ``jdbc:mariadb:`` URL it quotes columns with double quotes, which MariaDB reads as
    strings."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise ReconcileError(
            f"the MariaDB URL {parts.scheme}://{parts.path} names no host; JDBC needs "
            "mariadb://user:password@host:port/database"
        )
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    database = parts.path.lstrip("/")
    jdbc = f"jdbc:mysql://{host}:{parts.port or 3306}/{database}?permitMysqlScheme"
    props = {"driver": "org.mariadb.jdbc.Driver"}
    if parts.username:
        props["user"] = unquote(parts.username)
    if parts.password:
        props["password"] = unquote(parts.password)
    return jdbc, props


def qualified(schema: str | None, table: str) -> str:
    """A table's name as MySQL quotes it (names are checked identifiers: no backticks)."""
    return f"`{schema}`.`{table}`" if schema else f"`{table}`"


def _connect(url: str, database: str | None = None) -> Any:
    import pymysql

    parts = urlsplit(url)
    return pymysql.connect(
        host=parts.hostname or "localhost",
        port=parts.port or 3306,
        user=unquote(parts.username or ""),
        password=unquote(parts.password or ""),
        database=database or parts.path.lstrip("/") or None,
        connect_timeout=_TIMEOUT_S,
        charset="utf8mb4",
    )


def ledger_rows(url: str, name: str, label: str) -> Iterator[tuple[Any, ...]]:
    """The step entries of the SQL ledger ``name`` (quoted), streamed by an unbuffered
    cursor, as rows of :data:`streams.reconcile._sources.LEDGER_SCHEMA`."""
    import pymysql.cursors

    level = f"JSON_UNQUOTE(JSON_EXTRACT(`before`, '$.\"{LEVEL_KEY}\"'))"
    query = (
        "SELECT participant, tx_id, step, status, effect, updated_ms, "  # noqa: S608 (quoted)
        f"{level} FROM {name} WHERE step >= 0"
    )
    with _connect(url) as conn, conn.cursor(pymysql.cursors.SSCursor) as cursor:
        cursor.execute(query)
        for participant, tx_id, step, status, effect, updated_ms, mark in cursor:
            yield (
                label,
                str(participant),
                str(tx_id),
                int(step),
                status,
                bool(effect),
                int(updated_ms or 0),
                False,
                level_of({LEVEL_KEY: mark}),
            )


def ping(store: StoreSpec, ledger_table: str | None) -> None:
    """Connect; with ``ledger_table``, check that it exists.

    Raises:
        ReconcileError: the table is missing (a failure to connect is the driver's).
    """
    schema = store.options.get("schema")
    with _connect(store.url) as conn:
        if ledger_table is None:
            return
        with conn.cursor() as cursor:
            cursor.execute(
                "SELECT 1 FROM information_schema.tables WHERE table_schema = "
                "COALESCE(%s, DATABASE()) AND table_name = %s",
                (schema, ledger_table),
            )
            if cursor.fetchone() is None:
                raise ReconcileError(
                    f"{store.where} has no table {qualified(schema, ledger_table)}"
                )
