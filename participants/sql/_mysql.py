"""MySQL and MariaDB: what the SQL adapter does differently on them.

URLs ``mysql://`` and ``mariadb://`` mean PyMySQL (a pure-Python driver, the ``mysql``
extra). The engine's connections run at ``READ COMMITTED``: InnoDB's default,
``REPEATABLE READ``, reads a plain ``SELECT`` from the snapshot of the transaction's
first read, so a batch that waited for a row lock would then read the holds of that
record as they were before it waited (and miss the hold the other batch just
committed), and its locking reads of absent keys take gap locks, which turn two
inserts of one key into a deadlock. At ``READ COMMITTED`` every statement reads the
latest committed rows and a locking read locks the rows it finds, as on PostgreSQL.

Locks. PostgreSQL's advisory locks (a batch's transactions, the records a step may
create) are transaction-scoped; MySQL's ``GET_LOCK()`` is session-scoped (released only
by ``RELEASE_LOCK``, one more round trip after each commit, or by the connection's end)
and invisible to InnoDB's deadlock detector. Here they are rows of ``<ledger>_locks``,
locked with ``SELECT ... FOR UPDATE``: released by the commit or rollback (or a lost
connection) like every other lock of the batch, and seen by the deadlock detector
with the row locks (a deadlock is a transient error, and the batch is retried). The
rows are made once, by :func:`fill_locks` at set-up: :data:`TX_LOCK_BUCKETS` per
participant (its name as ``owner``), and :data:`RECORD_BUCKETS` for records (``owner``
empty, a name no participant can have). Two records in one bucket only wait for
each other while two batches overlap.

Bulk writes, where PostgreSQL binds a JSON array (:mod:`participants.sql._rows`): the
batch's rows in one ``UPDATE ... SET c = CASE pk WHEN ... END``, and its known ledger
entries in one ``INSERT ... ON DUPLICATE KEY UPDATE`` (the entries are locked, so each
row takes the update branch).

The ledger and holds tables are ``utf8mb4`` with the binary collation: the server's
default collation compares case-insensitively, and ``T1`` and ``t1`` are two
transactions. Business tables keep theirs; see docs/mysql.md for keys under a
case-insensitive collation.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from sqlalchemy import (
    Column,
    Connection,
    Dialect,
    Engine,
    Executable,
    Integer,
    MetaData,
    String,
    Table,
    case,
    create_engine,
    event,
    func,
    literal,
    select,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects.mysql import insert as mysql_insert
from sqlalchemy.engine import URL, ExceptionContext

from saga.streams import ConfigurationError
from saga.streams._secrets import redact

DIALECTS: Final = frozenset({"mysql", "mariadb"})
"""SQLAlchemy's dialect names for MySQL and MariaDB."""
TX_LOCK_BUCKETS: Final = 256
"""Lock rows per participant that serialise workers on one transaction (as on PostgreSQL)."""
RECORD_BUCKETS: Final = 4096
"""Lock rows shared by every record a step may create."""
TABLE_OPTIONS: Final[Mapping[str, Any]] = {
    f"{name}_{option}": value
    for name in DIALECTS
    for option, value in (("charset", "utf8mb4"), ("collate", "utf8mb4_bin"))
}
"""Keyword arguments of the ledger's tables: utf8mb4, binary collation (ignored elsewhere)."""
_CHUNK: Final = 500

# Errors PyMySQL reports as OperationalError (a transient trouble to the adapter) that are
# the database refusing a value: the step is rejected, as PostgreSQL's own classes say.
_INTEGRITY: Final = frozenset({3819, 4025})  # CHECK constraint (MySQL, MariaDB)
_DATA: Final = frozenset(
    {
        1292,  # an incorrect date/time or number value
        1364,  # a NOT NULL column without a default, left out
        1365,  # division by zero
        1690,  # a value out of range in an expression (BIGINT + by)
    }
)


def is_mysql(dialect: Dialect) -> bool:
    return dialect.name in DIALECTS


def is_mysql_url(url: URL) -> bool:
    return url.get_backend_name() in DIALECTS


def driver_url(url: URL) -> URL:
    """``mysql://`` and ``mariadb://`` (no driver named) as PyMySQL URLs."""
    if url.drivername in DIALECTS:
        return url.set(drivername=f"{url.drivername}+pymysql")
    return url


def make_engine(url: URL) -> Engine:
    """An engine whose connections run at ``READ COMMITTED`` (see the module doc)."""
    options: dict[str, Any] = {"pool_pre_ping": True, "isolation_level": "READ COMMITTED"}
    if url.get_driver_name() == "pymysql" and "connect_timeout" not in url.query:
        # Fail fast (and retry) rather than hang on a black-holed address.
        options["connect_args"] = {"connect_timeout": 10}
    try:
        engine = create_engine(url, **options)
    except (sa_exc.ArgumentError, sa_exc.NoSuchModuleError, ImportError) as exc:
        extra = " (pip install 'saga-olep[mysql]')" if isinstance(exc, ImportError) else ""
        raise ConfigurationError(
            f"cannot use database URL {url.render_as_string(hide_password=True)!r}: "
            f"{redact(str(exc))}{extra}"
        ) from exc
    event.listen(engine, "handle_error", _as_refusal)
    return engine


def errno(exc: BaseException) -> int | None:
    """The server's error number of a driver error (``None``: not a MySQL error)."""
    args = getattr(getattr(exc, "orig", exc), "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def describe(url: URL) -> str:
    """Where the database is, for messages (never the password)."""
    name = "MariaDB" if url.get_backend_name() == "mariadb" else "MySQL"
    port = f":{url.port}" if url.port else ""
    return f"{name} at {url.host or 'localhost'}{port}/{url.database or ''}"


def _as_refusal(context: ExceptionContext) -> BaseException | None:
    """A value the database refused, which PyMySQL reports as an operational error, as the
    integrity or data error it is (so the step fails, rather than the batch retrying)."""
    made = context.sqlalchemy_exception
    code = errno(context.original_exception)
    kind: type[sa_exc.DBAPIError] | None = None
    if code in _INTEGRITY:
        kind = sa_exc.IntegrityError
    elif code in _DATA:
        kind = sa_exc.DataError
    if kind is None or made is None or isinstance(made, kind):
        return None
    assert isinstance(context.original_exception, Exception)
    return kind(context.statement, context.parameters, context.original_exception)


# ---------------------------------------------------------------- locks


def define_locks(metadata: MetaData, ledger: str, targets: Iterable[str]) -> Table:
    """The lock rows of ledger ``ledger`` (``<ledger>_locks``, see the module doc), which
    may not be one of the participant's ``targets``."""
    if f"{ledger}_locks" in targets:
        raise ConfigurationError(
            f"the lock table {ledger}_locks cannot also be a target: steps would be able "
            "to remove the locks of other workers"
        )
    return Table(
        f"{ledger}_locks",
        metadata,
        Column("owner", String(128), primary_key=True),
        Column("bucket", Integer, primary_key=True, autoincrement=False),
        **TABLE_OPTIONS,
    )


def fill_locks(connection: Connection, table: Table, participant: str) -> None:
    """Make the lock rows of ``participant`` and of records when missing (idempotent)."""
    c = table.c
    have = connection.execute(
        select(c.owner, func.count()).where(c.owner.in_(["", participant])).group_by(c.owner)
    ).all()
    counts = {owner: int(n) for owner, n in have}
    rows = []
    if counts.get(participant, 0) < TX_LOCK_BUCKETS:
        rows += [{"owner": participant, "bucket": b} for b in range(TX_LOCK_BUCKETS)]
    if counts.get("", 0) < RECORD_BUCKETS:
        rows += [{"owner": "", "bucket": b} for b in range(RECORD_BUCKETS)]
    if rows:
        connection.execute(mysql_insert(table).prefix_with("IGNORE"), rows)


def tx_locks(table: Table, participant: str, tx_ids: Iterable[str]) -> Executable:
    """Lock, until the batch ends, the rows of these transactions (for this participant),
    in ascending order, so batches never deadlock on them."""
    buckets = sorted({zlib.crc32(tx_id.encode()) % TX_LOCK_BUCKETS for tx_id in tx_ids})
    return _lock(table, participant, buckets)


def record_locks(table: Table, keys: Iterable[int]) -> Executable:
    """Lock the rows of these record keys (:class:`participants.sql._holds.RecordLocks`)."""
    return _lock(table, "", sorted({key % RECORD_BUCKETS for key in keys}))


def _lock(table: Table, owner: str, buckets: Sequence[int]) -> Executable:
    c = table.c
    return (
        select(c.bucket)
        .where(c.owner == owner, c.bucket.in_(buckets))
        .order_by(c.bucket)
        .with_for_update()
    )


# ---------------------------------------------------------------- bulk writes


def case_updates(
    table: Table, key: Column[Any], columns: Sequence[str], rows: Sequence[Mapping[str, Any]]
) -> list[Executable]:
    """``rows`` (the key's and ``columns``' values) written by one ``UPDATE`` per 500 rows:
    ``SET c = CASE key WHEN k THEN v ... ELSE c END WHERE key IN (...)``."""
    statements: list[Executable] = []
    for start in range(0, len(rows), _CHUNK):
        chunk = rows[start : start + _CHUNK]
        values = {
            name: case(
                *[
                    (literal(row[key.name], key.type), literal(row[name], table.c[name].type))
                    for row in chunk
                ],
                value=key,
                else_=table.c[name],
            )
            for name in columns
        }
        keys = [row[key.name] for row in chunk]
        statements.append(update(table).where(key.in_(keys)).values(values))
    return statements


def upsert(table: Table, columns: Sequence[str]) -> Executable:
    """``INSERT ... ON DUPLICATE KEY UPDATE`` of ``columns``, for ``executemany``: known
    rows, locked, updated in one statement."""
    statement = mysql_insert(table)
    return statement.on_duplicate_key_update({name: statement.inserted[name] for name in columns})


def limited(statement: Any, limit: int) -> Any:
    """A ``DELETE`` (or ``UPDATE``) of at most ``limit`` rows (MySQL's ``LIMIT`` clause)."""
    return statement.with_dialect_options(**{f"{name}_limit": limit for name in DIALECTS})
