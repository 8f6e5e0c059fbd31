"""The SQL adapter's connection helpers and how it reads the driver's errors.

Where the database is (for messages, never the password), the engine (PostgreSQL
through psycopg 3, SQLite with savepoints that work), the advisory locks a batch
takes on PostgreSQL, and the classification of a driver error that
:meth:`participants.sql.SqlStorage.translate` and the actions' wrapper use.

Classification (:func:`verdict`, see :mod:`participants._refusals` for what each
verdict does). PostgreSQL by SQLSTATE: its class 08 (connection), 25 (transaction
state: a read-only standby, a killed idle transaction), 40 (serialization failure,
deadlock), 53 (insufficient resources), 57 (operator intervention), 58 (system) and XX
(internal) are transient; 57014 (a statement timeout, or a cancel) and 55P03 (a lock
timeout) are timeouts; 28 is the credentials (configuration); every other SQLSTATE is
the server's answer to the statement itself, refused (22 data, 23 integrity, P0 a
PL/pgSQL ``RAISE``, 42 syntax or access, ...). SQLite by its error name: busy, locked,
I/O, full, out of memory, read-only, schema changed, corrupt are transient; an
interrupt is a timeout; auth and permission are configuration; the rest (a
constraint, a trigger's ``RAISE``, a type mismatch, too big, an error in the
statement) refused. MySQL and MariaDB (PyMySQL) by error number: a lock wait or
statement timeout is a timeout, a deadlock and lost connections transient, access
denied configuration, a trigger's ``SIGNAL`` refused. An error without a code is a lost
connection (transient), unless the driver raised it as an integrity, data or
programming error (refused).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import (
    ARRAY,
    Connection,
    Engine,
    Executable,
    Integer,
    create_engine,
    event,
    func,
    literal,
    select,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.pool import ConnectionPoolEntry

from saga.participants._refusals import StoreRefused, Verdict, refusal
from saga.streams import ConfigurationError
from saga.streams._secrets import redact, redact_url

if TYPE_CHECKING:  # psycopg is PostgreSQL's driver: SQLite runs without it
    import psycopg

TX_LOCK_BUCKETS: Final = 256
"""PostgreSQL advisory locks per participant that serialise workers on one transaction."""
# libpq reports a failed connection without a SQLSTATE (there is no result to carry
# one), so an authentication failure is known by the server's or libpq's words.
_AUTH_FAILURE: Final = re.compile(
    r"password authentication failed|authentication failed for user|role \S+ does not exist"
    r"|no pg_hba\.conf entry|is not permitted to log in|no password supplied"
    r"|server did not complete authentication|SCRAM authentication",
    re.IGNORECASE,
)


def detail(exc: BaseException) -> str:
    """The first line of the driver's message (the rest is SQL and hints), passwords hidden."""
    origin = getattr(exc, "orig", None) or exc
    lines = redact(str(origin)).strip().splitlines()
    text = lines[0].strip() if lines else type(origin).__name__
    return text if len(text) <= 240 else text[:237] + "..."


def is_auth_failure(exc: sa_exc.DBAPIError) -> bool:
    """The server refused the login: SQLSTATE class 28, or libpq's words for it."""
    sqlstate = getattr(exc.orig, "sqlstate", None)
    if isinstance(sqlstate, str):
        return sqlstate.startswith("28")
    return bool(_AUTH_FAILURE.search(str(exc.orig)))


def is_conflict(exc: sa_exc.DBAPIError) -> bool:
    """A deadlock or serialization failure (SQLSTATE class 40), or SQLite's lock timeout."""
    sqlstate = getattr(exc.orig, "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate.startswith("40"):
        return True
    return "database is locked" in str(exc.orig)


_PG_CODES: Final = {"57014": Verdict.TIMEOUT, "55P03": Verdict.TIMEOUT}
_PG_CLASSES: Final = {
    "08": Verdict.TRANSIENT,
    "25": Verdict.TRANSIENT,
    "28": Verdict.CONFIGURATION,
    "40": Verdict.TRANSIENT,
    "53": Verdict.TRANSIENT,
    "57": Verdict.TRANSIENT,
    "58": Verdict.TRANSIENT,
    "XX": Verdict.TRANSIENT,
}
_SQLITE_NAMES: Final = (  # by prefix: SQLITE_BUSY_TIMEOUT is SQLITE_BUSY's
    ("SQLITE_INTERRUPT", Verdict.TIMEOUT),
    ("SQLITE_BUSY", Verdict.TRANSIENT),
    ("SQLITE_LOCKED", Verdict.TRANSIENT),
    ("SQLITE_IOERR", Verdict.TRANSIENT),
    ("SQLITE_FULL", Verdict.TRANSIENT),
    ("SQLITE_NOMEM", Verdict.TRANSIENT),
    ("SQLITE_CANTOPEN", Verdict.TRANSIENT),
    ("SQLITE_PROTOCOL", Verdict.TRANSIENT),
    ("SQLITE_READONLY", Verdict.TRANSIENT),
    ("SQLITE_SCHEMA", Verdict.TRANSIENT),
    ("SQLITE_CORRUPT", Verdict.TRANSIENT),
    ("SQLITE_NOTADB", Verdict.TRANSIENT),
    ("SQLITE_ABORT", Verdict.TRANSIENT),
    ("SQLITE_AUTH", Verdict.CONFIGURATION),
    ("SQLITE_PERM", Verdict.CONFIGURATION),
)


_MYSQL_NUMBERS: Final = {
    1205: Verdict.TIMEOUT,  # lock wait timeout exceeded
    3024: Verdict.TIMEOUT,  # max_execution_time exceeded
    1969: Verdict.TIMEOUT,  # MariaDB: max_statement_time exceeded
    1213: Verdict.TRANSIENT,  # deadlock
    1040: Verdict.TRANSIENT,  # too many connections
    1053: Verdict.TRANSIENT,  # server shutdown
    2002: Verdict.TRANSIENT,  # cannot connect
    2003: Verdict.TRANSIENT,
    2006: Verdict.TRANSIENT,  # server has gone away
    2013: Verdict.TRANSIENT,  # lost connection during query
    1044: Verdict.CONFIGURATION,  # access denied to the database
    1045: Verdict.CONFIGURATION,  # access denied for the user
}


def error_code(exc: BaseException) -> str | None:
    """The database's code for the error: PostgreSQL's SQLSTATE, SQLite's error name, or
    MySQL's error number."""
    origin = getattr(exc, "orig", None) or exc
    number = _mysql_number(origin)
    if number is not None:
        return str(number)
    for attribute in ("sqlstate", "sqlite_errorname"):
        code = getattr(origin, attribute, None)
        if isinstance(code, str) and code:
            return code
    return None


def _mysql_number(origin: object) -> int | None:
    if not type(origin).__module__.startswith(("pymysql", "MySQLdb")):
        return None
    args = getattr(origin, "args", ())
    return args[0] if args and isinstance(args[0], int) and args[0] > 0 else None


def _sqlstate(origin: object) -> str | None:
    """PostgreSQL's SQLSTATE of a psycopg error (``None`` for the driver's own errors)."""
    if not type(origin).__module__.startswith("psycopg"):
        return None
    code = getattr(origin, "sqlstate", None)
    return code if isinstance(code, str) and code else None


def verdict(exc: BaseException) -> Verdict:
    """What the driver error ``exc`` means for the work (see the module doc)."""
    if not isinstance(exc, sa_exc.DBAPIError) or exc.connection_invalidated:
        return Verdict.TRANSIENT
    number = _mysql_number(exc.orig)
    if number is not None:
        client = 2000 <= number < 3000  # the driver's own: the connection
        return _MYSQL_NUMBERS.get(number, Verdict.TRANSIENT if client else Verdict.REFUSED)
    sqlstate = _sqlstate(exc.orig)
    if sqlstate is not None:
        return _PG_CODES.get(sqlstate) or _PG_CLASSES.get(sqlstate[:2], Verdict.REFUSED)
    name = getattr(exc.orig, "sqlite_errorname", None)
    if isinstance(name, str) and name:
        return next((v for n, v in _SQLITE_NAMES if name.startswith(n)), Verdict.REFUSED)
    if is_auth_failure(exc):
        return Verdict.CONFIGURATION
    if isinstance(exc, sa_exc.IntegrityError | sa_exc.DataError | sa_exc.ProgrammingError):
        return Verdict.REFUSED
    return Verdict.TRANSIENT


def store_name(exc: BaseException) -> str:
    """``PostgreSQL``, ``SQLite`` or ``MySQL``, by the driver that raised ``exc``."""
    module = type(getattr(exc, "orig", None) or exc).__module__
    if module.startswith("psycopg"):
        return "PostgreSQL"
    if module.startswith(("pymysql", "MySQLdb")):
        return "MySQL"
    return "SQLite" if module.startswith("sqlite3") else "the database"


def is_schema_error(exc: BaseException) -> bool:
    """A statement wrong for the schema (a syntax error, a missing table, column or
    privilege): PostgreSQL's class 42, SQLite's plain error, or the driver's programming
    error (not a PL/pgSQL ``RAISE``, which psycopg raises as one too)."""
    sqlstate = _sqlstate(getattr(exc, "orig", None))
    if sqlstate is not None:
        return sqlstate.startswith("42")
    code = error_code(exc) or ""
    if code.startswith("SQLITE_"):
        return code == "SQLITE_ERROR"
    return isinstance(exc, sa_exc.ProgrammingError)


def step_refusal(exc: BaseException, what: str) -> StoreRefused | None:
    """The step's refusal for a driver error met doing ``what`` (``the increment of
    accounts/frozen``), or ``None`` when the error is not the step's (transient)."""
    judged = verdict(exc)
    if judged not in (Verdict.REFUSED, Verdict.TIMEOUT):
        return None
    return refusal(store_name(exc), what, detail(exc), error_code(exc), judged)


def tx_locks(participant: str, tx_ids: Iterable[str]) -> Executable:
    """PostgreSQL: one statement that takes, until commit, the locks on these transactions.

    Transactions hash into :data:`TX_LOCK_BUCKETS` locks per participant, which
    bounds the lock table entries a batch uses; two transactions sharing a lock
    only wait for each other while two workers overlap. Every batch takes its
    locks in ascending order, so batches never deadlock on them.

    The same statement sets ``plan_cache_mode = force_custom_plan`` for the batch's
    transaction (``SET LOCAL``: nothing outlives the commit, and it works through a
    transaction-pooling proxy). psycopg prepares a statement on its fifth run, and
    PostgreSQL then may keep a *generic* plan chosen on the statistics of that
    moment. The ledger of a new deployment starts empty, so that plan looked its
    entries up through an index that leads with ``participant`` only and filtered
    every entry of the participant, per key, until autovacuum next analysed the
    table (measured in the bench's open loop: 63 million index entries read in 30 s,
    the lookup's mean 22 ms and its maximum 1.2 s). A custom plan is chosen on each
    run with the table's current size, and planning costs a fraction of a
    millisecond per batch.
    """
    owner = _int32(zlib.crc32(participant.encode()))
    buckets = sorted({zlib.crc32(tx_id.encode()) % TX_LOCK_BUCKETS for tx_id in tx_ids})
    ordered = (
        select(func.unnest(literal(buckets, ARRAY(Integer))).label("bucket"))
        .order_by("bucket")
        .subquery()
    )
    return select(
        func.count(func.pg_advisory_xact_lock(owner, ordered.c.bucket)),
        func.set_config("plan_cache_mode", "force_custom_plan", True),
    )


def can_pipeline(engine: Engine) -> bool:
    """PostgreSQL through psycopg 3 with a libpq that has pipeline mode (14 or later)."""
    if engine.dialect.name != "postgresql" or engine.dialect.driver != "psycopg":
        return False
    import psycopg

    return psycopg.Pipeline.is_supported()


@contextmanager
def pipelined(connection: Connection) -> Iterator[psycopg.Connection[Any]]:
    """psycopg's pipeline mode on the connection: what runs inside goes out in one round trip.

    Statements run through ``connection`` (or a cursor of the driver's connection,
    yielded) are sent without waiting for each other's results; the server runs them
    in order, each with its own snapshot, as if sent one by one, and leaving the block
    waits once for all of them. A statement whose result is needed must be read after
    the block (through SQLAlchemy, its result is empty: run only statements whose
    results are not read). The first error aborts the statements after it and is
    raised on leaving the block, as SQLAlchemy's exception of the same kind; a lost
    connection is invalidated first, as SQLAlchemy does.
    """
    import psycopg

    driver: psycopg.Connection[Any] = connection.connection.driver_connection  # type: ignore[assignment]
    try:
        with driver.pipeline():
            yield driver
    except psycopg.Error as exc:
        lost = driver.broken or driver.closed
        if lost:
            connection.invalidate(exc)
        raise sa_exc.DBAPIError.instance(
            None, None, exc, psycopg.Error, connection_invalidated=lost
        ) from exc


def _int32(value: int) -> int:
    return value - 2**32 if value >= 2**31 else value


def sqlalchemy_url(url: str) -> URL:
    try:
        parsed = make_url(url)
    except (sa_exc.ArgumentError, ValueError) as exc:
        # ValueError: a port that is not a number; neither message may show the password.
        port = " (the port must be a number)" if isinstance(exc, ValueError) else ""
        raise ConfigurationError(
            f"{redact_url(url)!r} is not a database URL{port}; give one such as "
            "postgresql://user@host:5432/db or sqlite:///path/to/file.db"
        ) from exc
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def describe(url: URL) -> str:
    """Where the database is, for messages (never the password)."""
    backend = url.get_backend_name()
    if backend == "sqlite":
        return f"SQLite database {url.database or ':memory:'}"
    names = {"postgresql": "PostgreSQL"}
    host = url.host or "localhost"
    port = f":{url.port}" if url.port else ""
    return f"{names.get(backend, backend)} at {host}{port}/{url.database or ''}"


def make_engine(url: URL) -> Engine:
    options: dict[str, Any] = {"pool_pre_ping": True}
    backend = url.get_backend_name()
    if backend == "postgresql" and "connect_timeout" not in url.query:
        # Fail fast (and retry) rather than hang on a black-holed address.
        options["connect_args"] = {"connect_timeout": 10}
    try:
        engine = create_engine(url, **options)
    except (sa_exc.ArgumentError, sa_exc.NoSuchModuleError, ImportError) as exc:
        raise ConfigurationError(
            f"cannot use database URL {url.render_as_string(hide_password=True)!r}: "
            f"{redact(str(exc))}"
        ) from exc
    if backend == "sqlite":
        sqlite_savepoints(engine)
    return engine


def sqlite_savepoints(engine: Engine) -> None:
    """Make pysqlite leave transactions to SQLAlchemy, so that SAVEPOINT works.

    The driver otherwise opens and commits transactions on its own, which
    silently breaks savepoints (see SQLAlchemy's pysqlite notes).
    """

    @event.listens_for(engine, "connect")
    def _no_driver_transactions(dbapi: DBAPIConnection, record: ConnectionPoolEntry) -> None:
        dbapi.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN")
