"""The SQL storage: business tables and the step ledger changed in one database transaction.

SQLAlchemy Core only (no ORM); PostgreSQL through psycopg 3 in production,
SQLite for development and tests. Every table and column name reaches the
database through a reflected :class:`~sqlalchemy.Table`, so SQLAlchemy quotes
it; no SQL text is ever built from a step's arguments.

A batch is one database transaction. Inside it every work item gets a
savepoint, and inside that the item's business change gets its own *effect*
savepoint, opened by the first statement an action runs through the
:class:`SqlSession` it is handed::

    BEGIN                                    -- the batch
      SAVEPOINT item                         -- one work item
        SELECT ... FROM ledger FOR UPDATE    -- Unit.entry(): lock the step
        SAVEPOINT effect                     -- first statement of the action
          UPDATE accounts ...                -- the action
        ROLLBACK TO effect | RELEASE effect  -- Unit.rollback_effect() | Unit.write()
        INSERT/UPDATE ledger ...             -- Unit.write()
      RELEASE item
    COMMIT                                   -- only now are the reports emitted

So a rejected step undoes exactly its own change and still records ``failed``,
and its neighbours in the batch are untouched.

Two workers may briefly act on one transaction (a rebalance: a zombie and its
successor). On PostgreSQL a batch first takes transaction-scoped advisory locks
on its transactions (for this participant), so the two act one after the other
and the second sees the first's ledger entry: a request cannot slip past a
rollback marker being written. The ledger's primary key is the backstop (see
:class:`_SqlUnit`). SQLite lets one writer at a time anyway.

Errors, translated at this boundary (DESIGN §4):

* integrity and data errors raised by an action (duplicate key, NOT NULL,
  value out of range, ...) are a :class:`~streams.BusinessRejection`: the
  step fails and its saga rolls back;
* the database being unreachable, a lost connection, a deadlock or a
  serialization failure, and another worker writing the same ledger entry at
  the same time are a :class:`~streams.TransientError`: nothing of the batch
  took effect and the runtime retries it;
* a statement the database refuses as such (a missing table or privilege) is a
  :class:`~streams.ConfigurationError`.
"""

from __future__ import annotations

import logging
import re
import uuid
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import date, datetime, time
from decimal import Decimal, InvalidOperation
from typing import Any, Final, NoReturn

from sqlalchemy import (
    ARRAY,
    JSON,
    BigInteger,
    Boolean,
    Column,
    ColumnElement,
    Connection,
    CursorResult,
    Engine,
    Executable,
    Index,
    Integer,
    MetaData,
    NestedTransaction,
    RowMapping,
    String,
    Table,
    Text,
    and_,
    bindparam,
    case,
    create_engine,
    delete,
    event,
    func,
    insert,
    inspect,
    literal,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.pool import ConnectionPoolEntry
from sqlalchemy.sql import sqltypes

from participants._actions import (
    IDENTIFIER,
    BuiltinAction,
    BuiltinActions,
    Increment,
    RecordOps,
)
from participants._barrier import LedgerEntry, LedgerStatus, finished_ms
from participants._handlers import Handler, combine
from participants._storage import (
    Actions,
    Report,
    RequestSeen,
    Storage,
    Unit,
    WorkItem,
    run_item,
)
from streams import BusinessRejection, ConfigurationError, Mode, TransientError
from streams._secrets import redact, redact_url

log = logging.getLogger("saga.participant.sql")

_FINAL_STATUSES: Final = (
    LedgerStatus.COMMITTED,
    LedgerStatus.COMPENSATED,
    LedgerStatus.FAILED,
    LedgerStatus.SEEN,
)
"""Statuses that :func:`participants._barrier.finished_ms` counts as final (for the upgrade)."""

MARKER_STEP: Final = -1
"""The ledger's ``step`` of the transaction-level marker: a rollback arrived before this
participant knew which steps of the transaction are its own."""
SEEN_STEP: Final = -2
"""The ledger's ``step`` of the transaction-level *seen* marker: this participant read the
transaction's request, which has no step of its own (it keeps the request's fingerprint)."""

_LEDGER_COLUMNS: Final = (
    "participant",
    "tx_id",
    "step",
    "status",
    "action",
    "args",
    "mode",
    "n_steps",
    "deadline_ms",
    "effect",
    "before",
    "reason",
    "rollback_pending",
    "successor_compensated",
    "updated_ms",
)
_ADDED_COLUMNS: Final = ("fingerprint", "finished_ms")
"""Columns added after the first layout; :meth:`SqlStorage.setup` adds them to an older ledger."""
TX_LOCK_BUCKETS: Final = 256
"""PostgreSQL advisory locks per participant that serialise workers on one transaction."""
_INTEGER_TEXT: Final = re.compile(r"[+-]?[0-9]+")
# libpq reports a failed connection without a SQLSTATE (there is no result to carry
# one), so an authentication failure is known by the server's or libpq's words.
_AUTH_FAILURE: Final = re.compile(
    r"password authentication failed|authentication failed for user|role \S+ does not exist"
    r"|no pg_hba\.conf entry|is not permitted to log in|no password supplied"
    r"|server did not complete authentication|SCRAM authentication",
    re.IGNORECASE,
)


def define_ledger(metadata: MetaData, name: str = "saga_ledger") -> Table:
    """The ledger's table definition in ``metadata`` (portable types: PostgreSQL and SQLite).

    One row per ``(participant, tx_id, step)``; several participants may share one
    table. ``step = -1`` is the transaction-level rollback marker, ``step = -2`` the
    seen marker. ``fingerprint`` is the request's; ``finished_ms`` is set once the
    entry is finished (:func:`participants._barrier.finished_ms`) and indexed, so
    :meth:`SqlStorage.prune` finds what to remove without a scan.
    """
    return Table(
        name,
        metadata,
        Column("participant", String(128), primary_key=True),
        Column("tx_id", String(128), primary_key=True),
        Column("step", Integer, primary_key=True, autoincrement=False),
        Column("status", String(32), nullable=False),
        Column("action", Text),
        Column("args", JSON(none_as_null=True)),
        Column("mode", String(16), nullable=False),
        Column("n_steps", Integer, nullable=False),
        Column("deadline_ms", BigInteger, nullable=False),
        Column("effect", Boolean, nullable=False),
        Column("before", JSON(none_as_null=True)),
        Column("reason", Text),
        Column("rollback_pending", Boolean, nullable=False),
        Column("successor_compensated", Boolean, nullable=False),
        Column("updated_ms", BigInteger, nullable=False),
        Column("fingerprint", String(64)),
        Column("finished_ms", BigInteger),
        Index(f"{name}_by_status", "participant", "status"),
        Index(f"{name}_by_finish", "participant", "finished_ms"),
    )


# ---------------------------------------------------------------- native session


class SqlSession:
    """What actions get as ``native``: the batch's connection, scoped to one step's effect.

    The first use of :attr:`connection` (or :meth:`execute`) opens a savepoint, the
    *effect scope*; the unit rolls back to it when the step is rejected and
    releases it before it writes the ledger. Custom handlers run every statement
    through this object, and may nest their own savepoints with
    ``session.connection.begin_nested()``; they must not commit or roll back the
    connection itself.
    """

    def __init__(
        self, connection: Connection, tables: Mapping[str, Table], *, savepoints: bool = True
    ) -> None:
        self._connection = connection
        self._tables = tables
        self._savepoints = savepoints
        self._effect: NestedTransaction | None = None

    @property
    def connection(self) -> Connection:
        """The batch's connection; using it starts this step's effect scope."""
        if self._effect is None and self._savepoints:
            self._effect = self._connection.begin_nested()
        return self._connection

    def execute(self, statement: Executable, parameters: Any = None) -> CursorResult[Any]:
        """Run ``statement`` inside the effect scope."""
        return self.connection.execute(statement, parameters)

    def table(self, name: str) -> Table:
        """The reflected table of target ``name`` (one of the participant's targets)."""
        try:
            return self._tables[name]
        except KeyError:
            raise BusinessRejection(
                f"target {name!r} is not in this participant's allow-list "
                f"({', '.join(sorted(self._tables)) or 'empty'})"
            ) from None

    def keep_effect(self) -> None:
        """Release the effect savepoint (the change stays, pending the batch's commit)."""
        effect, self._effect = self._effect, None
        if effect is not None:
            _close_savepoint(self._connection, effect, keep=True)

    def undo_effect(self) -> None:
        """Roll back to the effect savepoint: every change since the scope opened is undone."""
        effect, self._effect = self._effect, None
        if effect is not None:
            _close_savepoint(self._connection, effect, keep=False)


def _close_savepoint(connection: Connection, savepoint: NestedTransaction, *, keep: bool) -> None:
    """Release (``keep``) or roll back ``savepoint``, first closing the same way any savepoint
    an action opened inside it and left open (SQLAlchemy tracks them as a stack)."""
    if not savepoint.is_active:
        return
    while (inner := connection.get_nested_transaction()) is not None and inner is not savepoint:
        if keep:
            inner.commit()
        else:
            inner.rollback()
    if keep:
        savepoint.commit()
    else:
        savepoint.rollback()


def _session(native: Any) -> SqlSession:
    if not isinstance(native, SqlSession):
        raise TypeError(f"SQL actions need a SqlSession as native, not {type(native).__name__}")
    return native


# ---------------------------------------------------------------- built-in actions


class SqlActions(BuiltinActions):
    """The built-in actions on reflected tables (``native`` must be a :class:`SqlSession`).

    ``key`` is the value of the table's single-column primary key; fields are
    columns (an unknown column is a business rejection). Values are converted to
    the column's type (``"42"`` for an integer column is 42; a fraction for an
    integer column is rejected). Before-images are JSON: ``Decimal`` as its exact
    string, dates and times as ISO 8601, UUIDs as strings, bytes as hex; the
    compensation converts them back by the column's type.

    ``put`` sets the given columns and leaves the others as they are (or at their
    defaults for a new row). ``increment`` runs ``SET field = field + by`` with
    the bounds in its ``WHERE``; only when that changes no row does a locked read
    find out why (absent, no value, out of bounds). Its compensation is
    ``field - by`` without bounds, so it commutes with other increments in between.

    Every built-in action and compensation decides to reject *before* it writes:
    a rejected built-in step has changed nothing, which is what lets a batch of
    built-in steps run without savepoints (see :meth:`SqlStorage.execute`).
    """

    def record(self, native: Any, action: BuiltinAction) -> RecordOps:
        session = _session(native)
        return _Record(session, session.table(action.target), action)


class _Record:
    """One row of a target table, addressed by the step's key, and what actions do to it."""

    def __init__(self, session: SqlSession, table: Table, action: BuiltinAction) -> None:
        columns = list(table.primary_key.columns)
        self.session = session
        self.table = table
        self.pk: Column[Any] = columns[0]
        self.where = f"{action.target}/{action.key}"
        self.key = _coerce(self.pk, action.key, f"key of {action.target}")

    # -- reads and writes

    def _match(self) -> ColumnElement[bool]:
        match: ColumnElement[bool] = self.pk == self.key
        return match

    def _locked(self) -> RowMapping | None:
        query = select(self.table).where(self._match()).with_for_update()
        return self.session.execute(query).mappings().first()

    def _existing(self) -> RowMapping:
        row = self._locked()
        if row is None:
            raise BusinessRejection(f"{self.where} does not exist")
        return row

    def _values(self, fields: Mapping[str, Any], what: str, *, key_allowed: bool) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for name, value in fields.items():
            column = self._column(name)
            coerced = _coerce(column, value, f"{what} field {name!r} of {self.where}")
            if column is self.pk:
                # The key is the record's identity: it may be repeated, never changed.
                if not key_allowed or coerced != self.key:
                    raise BusinessRejection(
                        f"{what} of {self.where} may not change the key column {name!r}"
                    )
                continue
            values[name] = coerced
        return values

    def _column(self, name: str) -> Column[Any]:
        column = self.table.c.get(name)
        if column is None:
            raise BusinessRejection(f"{self.table.name} has no column {name!r}")
        return column

    def _image(self, row: RowMapping, names: Iterable[str] | None = None) -> dict[str, Any]:
        chosen = row.keys() if names is None else names
        return {name: _to_json(row[name]) for name in chosen}

    def _restored(self, image: Any, what: str) -> dict[str, Any]:
        if not isinstance(image, Mapping):
            raise BusinessRejection(f"the before-image of {self.where} is missing; {what}")
        return {name: _from_json(self._column(name), value) for name, value in image.items()}

    def _insert(self, values: Mapping[str, Any]) -> None:
        self.session.execute(insert(self.table).values({self.pk.name: self.key, **values}))

    def _set(self, values: Mapping[str, Any]) -> int:
        if not values:
            return 1 if self._locked() is not None else 0
        statement = update(self.table).where(self._match()).values(dict(values))
        return self.session.execute(statement).rowcount

    # -- actions

    def insert(self, fields: Mapping[str, Any]) -> None:
        values = self._values(fields, "insert", key_allowed=True)
        if self._locked() is not None:
            raise BusinessRejection(f"{self.where} already exists")
        self._insert(values)

    def put(self, fields: Mapping[str, Any]) -> dict[str, Any] | None:
        values = self._values(fields, "put", key_allowed=True)
        row = self._locked()
        if row is None:
            # A concurrent writer may insert the same key between our read and our
            # insert; a savepoint lets us see that and overwrite it instead.
            try:
                with self.session.connection.begin_nested():
                    self._insert(values)
            except sa_exc.IntegrityError:
                row = self._locked()
                if row is None:
                    raise
            else:
                return None
        self._set(values)
        return self._image(row)

    def update(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        values = self._values(fields, "update", key_allowed=False)
        row = self._existing()
        self._set(values)
        return self._image(row, values)

    def delete(self) -> dict[str, Any]:
        row = self._existing()
        self.session.execute(delete(self.table).where(self._match()))
        return self._image(row)

    def increment(self, action: Increment) -> None:
        column = self._counter(action.field)
        by = _coerce(column, action.by, f"the increment of {self.where}")
        low = None if action.min is None else _coerce(column, action.min, "the minimum")
        high = None if action.max is None else _coerce(column, action.max, "the maximum")
        # One guarded statement does the common case; the bounds hold even where a
        # storage cannot lock (SQLite). Only when it changes nothing does a locked
        # read find out why, so the rejection names the reason.
        guards = [self._match(), column.is_not(None)]
        if low is not None:
            guards.append(column + by >= low)
        if high is not None:
            guards.append(column + by <= high)
        statement = update(self.table).where(and_(*guards)).values({column.name: column + by})
        if self.session.execute(statement).rowcount == 1:
            return
        current = self._existing()[column.name]
        if current is None:
            raise BusinessRejection(f"{self.where} has no value in {column.name}")
        result = current + by
        if low is not None and result < low:
            raise BusinessRejection(
                f"{self.where} {column.name} would be {result}, below the minimum {low}"
            )
        if high is not None and result > high:
            raise BusinessRejection(
                f"{self.where} {column.name} would be {result}, above the maximum {high}"
            )
        raise BusinessRejection(f"{self.where} {column.name} is out of bounds")

    # -- compensations

    def remove(self) -> None:
        # Already gone is fine: the compensation wants the key absent.
        self.session.execute(delete(self.table).where(self._match()))

    def restore_put(self, before: Any) -> None:
        if before is None:
            self.remove()
            return
        values = self._restored(before, "the put cannot be undone")
        values.pop(self.pk.name, None)
        if self._set(values) == 0:
            self._insert(values)

    def restore_fields(self, before: Any) -> None:
        values = self._restored(before, "the update cannot be undone")
        if self._set(values) == 0:
            raise BusinessRejection(
                f"{self.where} no longer exists, so its update cannot be undone"
            )

    def reinsert(self, before: Any) -> None:
        values = self._restored(before, "the deleted row cannot be restored")
        values.pop(self.pk.name, None)
        if self._locked() is not None:
            raise BusinessRejection(
                f"{self.where} exists again, so the deleted row cannot be restored"
            )
        self._insert(values)

    def increment_back(self, action: Increment, before: Any = None) -> None:
        column = self._counter(action.field)
        by = _coerce(column, action.by, f"the increment of {self.where}")
        statement = update(self.table).where(self._match()).values({column.name: column - by})
        if self.session.execute(statement).rowcount != 1:
            raise BusinessRejection(
                f"{self.where} no longer exists, so its increment of {column.name} cannot be undone"
            )

    def _counter(self, name: str) -> Column[Any]:
        column = self._column(name)
        if column is self.pk:
            raise BusinessRejection(f"increment may not change the key column {name!r}")
        if not isinstance(column.type, sqltypes.Integer | sqltypes.Numeric):
            raise BusinessRejection(f"{self.table.name}.{name} is not a numeric column")
        return column


# ---------------------------------------------------------------- values


def _coerce(column: Column[Any], value: Any, what: str) -> Any:
    """``value`` (a JSON scalar) as the Python value ``column`` stores, or a rejection."""
    if value is None:
        return None
    kind = column.type
    try:
        if isinstance(kind, sqltypes.Boolean):
            if isinstance(value, bool):
                return value
        elif isinstance(kind, sqltypes.Integer):
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, str) and _INTEGER_TEXT.fullmatch(value):
                return int(value)
        elif isinstance(kind, sqltypes.Numeric) and not kind.asdecimal:  # Float, usually
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value)
        elif isinstance(kind, sqltypes.Numeric):
            if isinstance(value, int | float | str) and not isinstance(value, bool):
                # str(float) is the shortest exact spelling: 0.1 stays 0.1, not
                # 0.1000000000000000055...
                number = Decimal(str(value))
                if number.is_finite():
                    return number
        elif isinstance(kind, sqltypes.String):
            if isinstance(value, str):
                return value
            if isinstance(value, int | float) and not isinstance(value, bool):
                return str(value)
        elif isinstance(kind, sqltypes.DateTime):
            if isinstance(value, str):
                return datetime.fromisoformat(value)
        elif isinstance(kind, sqltypes.Date):
            if isinstance(value, str):
                return date.fromisoformat(value)
        elif isinstance(kind, sqltypes.Time):
            if isinstance(value, str):
                return time.fromisoformat(value)
        elif isinstance(kind, sqltypes.Uuid):
            if isinstance(value, str):
                parsed = uuid.UUID(value)
                return parsed if kind.as_uuid else str(parsed)
        else:
            return value  # a type this adapter does not know: the database decides
    except (ValueError, InvalidOperation):
        pass
    raise BusinessRejection(
        f"{what} is {value!r}, which does not fit column {column.table.name}.{column.name} ({kind})"
    )


def _to_json(value: Any) -> Any:
    """A column value as JSON, for a before-image (see :class:`SqlActions`)."""
    if value is None or isinstance(value, bool | int | float | str | list | dict):
        return value
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    return str(value)


def _from_json(column: Column[Any], value: Any) -> Any:
    """The inverse of :func:`_to_json` for ``column``."""
    if not isinstance(value, str):
        return value
    kind = column.type
    if isinstance(kind, sqltypes.Numeric):
        return Decimal(value) if kind.asdecimal else float(value)
    if isinstance(kind, sqltypes.Integer):
        return int(value)
    if isinstance(kind, sqltypes.DateTime):
        return datetime.fromisoformat(value)
    if isinstance(kind, sqltypes.Date):
        return date.fromisoformat(value)
    if isinstance(kind, sqltypes.Time):
        return time.fromisoformat(value)
    if isinstance(kind, sqltypes.LargeBinary):
        return bytes.fromhex(value)
    if isinstance(kind, sqltypes.Uuid) and kind.as_uuid:
        return uuid.UUID(value)
    return value


def _plain(value: Any) -> Any:
    """A deep copy of ``value`` made of dicts and lists, so the JSON column can store it."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------- error translation


class _DriverErrorsTranslated(Actions):
    """Runs ``inner`` and turns an action's integrity or data error into a rejection.

    Anything else propagates: the storage boundary makes connection trouble a
    :class:`TransientError`, and a handler's own bug stops the participant.
    """

    def __init__(self, inner: Actions) -> None:
        self.inner = inner

    def apply(self, native: Any, action: str, args: Mapping[str, Any]) -> Any:
        with _rejected_by_database(action):
            return self.inner.apply(native, action, args)

    def compensate(self, native: Any, action: str, args: Mapping[str, Any], before: Any) -> None:
        with _rejected_by_database(f"the compensation of {action}"):
            self.inner.compensate(native, action, args, before)

    def confirm(self, native: Any, action: str, args: Mapping[str, Any]) -> None:
        with _rejected_by_database(f"the confirmation of {action}"):
            self.inner.confirm(native, action, args)


class _NeedsSavepoints(Exception):
    """A batch running without savepoints met a database error; run it carefully."""


class _SavepointsNeeded(Actions):
    """The built-in actions of a batch without savepoints.

    A database error inside an action (a duplicate key from a concurrent insert,
    a numeric overflow, ...) has aborted the whole PostgreSQL transaction, so it
    cannot become a rejection here: it stops the batch, which runs again with
    savepoints, where :class:`_DriverErrorsTranslated` rejects just that step.
    """

    def __init__(self, inner: Actions) -> None:
        self.inner = inner

    def apply(self, native: Any, action: str, args: Mapping[str, Any]) -> Any:
        with _savepoints_needed():
            return self.inner.apply(native, action, args)

    def compensate(self, native: Any, action: str, args: Mapping[str, Any], before: Any) -> None:
        with _savepoints_needed():
            self.inner.compensate(native, action, args, before)

    def confirm(self, native: Any, action: str, args: Mapping[str, Any]) -> None:
        with _savepoints_needed():
            self.inner.confirm(native, action, args)


@contextmanager
def _savepoints_needed() -> Iterator[None]:
    try:
        yield
    except (sa_exc.IntegrityError, sa_exc.DataError) as exc:
        if exc.connection_invalidated:
            raise
        raise _NeedsSavepoints from exc


@contextmanager
def _rejected_by_database(what: str) -> Iterator[None]:
    try:
        yield
    except (sa_exc.IntegrityError, sa_exc.DataError) as exc:
        if exc.connection_invalidated:
            raise
        raise BusinessRejection(f"{what} was refused by the database: {_detail(exc)}") from exc


def _detail(exc: BaseException) -> str:
    """The first line of the driver's message (the rest is SQL and hints), passwords hidden."""
    origin = getattr(exc, "orig", None) or exc
    lines = redact(str(origin)).strip().splitlines()
    text = lines[0].strip() if lines else type(origin).__name__
    return text if len(text) <= 240 else text[:237] + "..."


def _is_auth_failure(exc: sa_exc.DBAPIError) -> bool:
    """The server refused the login: SQLSTATE class 28, or libpq's words for it."""
    sqlstate = getattr(exc.orig, "sqlstate", None)
    if isinstance(sqlstate, str):
        return sqlstate.startswith("28")
    return bool(_AUTH_FAILURE.search(str(exc.orig)))


def _is_conflict(exc: sa_exc.DBAPIError) -> bool:
    """A deadlock or serialization failure (SQLSTATE class 40), or SQLite's lock timeout."""
    sqlstate = getattr(exc.orig, "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate.startswith("40"):
        return True
    return "database is locked" in str(exc.orig)


# ---------------------------------------------------------------- the unit


class _BatchLedger:
    """The batch's view of this participant's ledger: read once, written once.

    :meth:`load` reads (and locks, ``FOR UPDATE``) every entry of the batch's
    transactions in one statement; items then read and write this view, and
    :meth:`flush` writes what changed in two statements before the commit. A
    checkpoint lets a careful batch drop the writes of an item it rolls back.

    An entry that did not exist cannot be locked, so two workers may both read
    "absent"; such an entry is *inserted*, so the slower worker's insert collides
    with the primary key instead of overwriting the other's entry, and its whole
    batch (its duplicate effect included) rolls back as a transient error.
    """

    def __init__(self, storage: SqlStorage, connection: Connection) -> None:
        self._storage = storage
        self._table = storage.ledger_table
        self._connection = connection
        self._entries: dict[tuple[str, int], LedgerEntry | None] = {}
        self._existed: dict[tuple[str, int], bool] = {}
        self._loaded: set[str] = set()
        self._dirty: dict[tuple[str, int], LedgerEntry] = {}
        self._journal: list[tuple[tuple[str, int], LedgerEntry | None, LedgerEntry | None]] = []
        self._steps: dict[str, set[int]] = {}  # tx_id -> steps (markers too) in _entries

    def load(self, tx_ids: Iterable[str]) -> None:
        wanted = sorted(set(tx_ids) - self._loaded)
        c = self._table.c
        for chunk in (wanted[i : i + 1000] for i in range(0, len(wanted), 1000)):
            query = (
                select(self._table)
                .where(c.participant == self._storage.name, c.tx_id.in_(chunk))
                .order_by(c.tx_id, c.step)
                .with_for_update()
            )
            for row in self._connection.execute(query).mappings():
                key = (row["tx_id"], row["step"])
                self._entries[key] = _entry_of(row)
                self._existed[key] = True
                self._steps.setdefault(key[0], set()).add(key[1])
            self._loaded.update(chunk)

    def entry(self, tx_id: str, step: int) -> LedgerEntry | None:
        key = (tx_id, step)
        if key in self._entries:
            return self._entries[key]
        if tx_id in self._loaded:
            return None
        c = self._table.c
        query = (
            select(self._table)
            .where(c.participant == self._storage.name, c.tx_id == tx_id, c.step == step)
            .with_for_update()
        )
        row = self._connection.execute(query).mappings().first()
        found = None if row is None else _entry_of(row)
        self._entries[key] = found
        self._existed[key] = found is not None
        self._steps.setdefault(tx_id, set()).add(step)
        return found

    def _known(self, tx_id: str) -> list[LedgerEntry]:
        """Every entry of the transaction known in this view (markers too), in step order."""
        self.load([tx_id])
        found = [self._entries.get((tx_id, step)) for step in sorted(self._steps.get(tx_id, ()))]
        return [e for e in found if e is not None]

    def entries(self, tx_id: str) -> list[LedgerEntry]:
        """The transaction's step entries (not the markers), in step order."""
        return [e for e in self._known(tx_id) if e.step >= 0]

    def fingerprint(self, tx_id: str) -> str | None:
        """The request fingerprint recorded for the transaction (any entry or marker)."""
        return next((e.fingerprint for e in self._known(tx_id) if e.fingerprint), None)

    def write(self, entry: LedgerEntry) -> None:
        key = (entry.tx_id, entry.step)
        if key not in self._entries:
            self.entry(entry.tx_id, entry.step)
        self._journal.append((key, self._entries.get(key), self._dirty.get(key)))
        self._entries[key] = entry
        self._dirty[key] = entry
        self._steps.setdefault(entry.tx_id, set()).add(entry.step)

    def checkpoint(self) -> int:
        return len(self._journal)

    def undo_to(self, mark: int) -> None:
        """Forget the writes since ``mark`` (their item's savepoint was rolled back)."""
        while len(self._journal) > mark:
            key, entry, dirty = self._journal.pop()
            self._entries[key] = entry
            if dirty is None:
                self._dirty.pop(key, None)
            else:
                self._dirty[key] = dirty

    def flush(self) -> None:
        """Write the changed entries: new ones inserted, known ones updated."""
        name = self._storage.name
        inserts = [_row_of(name, e) for key, e in self._dirty.items() if not self._existed.get(key)]
        updates = [
            {f"v_{column}": value for column, value in _row_of(name, e).items()}
            for key, e in self._dirty.items()
            if self._existed.get(key)
        ]
        if inserts:
            try:
                self._connection.execute(insert(self._table), inserts)
            except sa_exc.IntegrityError as exc:
                raise TransientError(
                    f"participant {name!r}: another worker recorded a step of this batch "
                    f"({_detail(exc)}) at the same time; the batch will be retried"
                ) from exc
        if updates:
            c = self._table.c
            statement = (
                update(self._table)
                .where(
                    c.participant == name,
                    c.tx_id == bindparam("v_tx_id"),
                    c.step == bindparam("v_step"),
                )
                .values(
                    {
                        column: bindparam(f"v_{column}")
                        for column in (*_LEDGER_COLUMNS[3:], *_ADDED_COLUMNS)
                    }
                )
            )
            self._connection.execute(statement, updates)
        for key in self._dirty:
            self._existed[key] = True
        self._dirty.clear()
        self._journal.clear()


class _SqlUnit(Unit):
    """One work item's reads and writes of the ledger (through the batch's view)."""

    def __init__(self, ledger: _BatchLedger, session: SqlSession) -> None:
        self.native = session
        self._session = session
        self._ledger = ledger

    def entry(self, tx_id: str, step: int) -> LedgerEntry | None:
        return self._ledger.entry(tx_id, step)

    def entries(self, tx_id: str) -> list[LedgerEntry]:
        return self._ledger.entries(tx_id)

    def tx_rolled_back(self, tx_id: str) -> bool:
        return self._ledger.entry(tx_id, MARKER_STEP) is not None

    def mark_tx_rolled_back(self, tx_id: str, now_ms: int) -> None:
        marker = LedgerEntry(
            tx_id=tx_id,
            step=MARKER_STEP,
            status=LedgerStatus.COMPENSATED,
            reason="rolled back before this participant saw the request",
            updated_ms=now_ms,
        )
        self.write(marker)

    def known_fingerprint(self, tx_id: str) -> str | None:
        return self._ledger.fingerprint(tx_id)

    def mark_tx_seen(self, item: RequestSeen) -> None:
        self.write(_seen_marker(item, SEEN_STEP))

    def write(self, entry: LedgerEntry) -> None:
        # The effect (if any) is done: close its scope so that a later rollback_effect
        # in this unit (a decision covering several steps) cannot reach back into it.
        self._session.keep_effect()
        self._ledger.write(entry)

    def rollback_effect(self) -> None:
        self._session.undo_effect()


def _row_of(participant: str, entry: LedgerEntry) -> dict[str, Any]:
    return {
        "participant": participant,
        "tx_id": entry.tx_id,
        "step": entry.step,
        "status": str(entry.status),
        "action": entry.action,
        "args": None if entry.args is None else _plain(entry.args),
        "mode": str(entry.mode),
        "n_steps": entry.n_steps,
        "deadline_ms": entry.deadline_ms,
        "effect": entry.effect,
        "before": _plain(entry.before),
        "reason": entry.reason,
        "rollback_pending": entry.rollback_pending,
        "successor_compensated": entry.successor_compensated,
        "updated_ms": entry.updated_ms,
        "fingerprint": entry.fingerprint,
        "finished_ms": finished_ms(entry),
    }


def _seen_marker(item: RequestSeen, step: int) -> LedgerEntry:
    return LedgerEntry(
        tx_id=item.tx_id,
        step=step,
        status=LedgerStatus.SEEN,
        deadline_ms=item.deadline_ms,
        updated_ms=item.now_ms,
        fingerprint=item.fingerprint,
    )


def _entry_of(row: RowMapping) -> LedgerEntry:
    return LedgerEntry(
        tx_id=row["tx_id"],
        step=row["step"],
        status=LedgerStatus(row["status"]),
        action=row["action"],
        args=row["args"],
        mode=Mode(row["mode"]),
        n_steps=row["n_steps"],
        deadline_ms=row["deadline_ms"],
        effect=bool(row["effect"]),
        before=row["before"],
        reason=row["reason"],
        rollback_pending=bool(row["rollback_pending"]),
        successor_compensated=bool(row["successor_compensated"]),
        updated_ms=row["updated_ms"],
        fingerprint=row.get("fingerprint"),
    )


# ---------------------------------------------------------------- the storage


class SqlStorage(Storage):
    """A participant's SQL database: its target tables and its ledger, changed together.

    ``url`` is an SQLAlchemy URL; ``postgresql://`` (and ``postgres://``) mean
    psycopg 3. ``targets`` are the tables steps may touch (the allow-list); each
    must exist, in ``schema`` when given, with a single-column primary key.
    The ledger lives in ``ledger_table`` in the same schema and is created by
    :meth:`setup` when absent.

    ``handlers`` runs custom actions: either the mapping of action name to
    :class:`~participants.Handler` that :func:`~participants.load_handlers`
    returns (a handler named like a built-in action replaces it), or any
    :class:`~participants.Actions`, which gets every action that is not built in.
    Without handlers a custom action is a business rejection. Handlers receive a
    :class:`SqlSession` as ``native``.

    :meth:`execute` acts on every item in order, repeats included (a repeat
    re-reports its step's status); dropping repeats is the caller's choice.
    """

    def __init__(
        self,
        name: str,
        url: str,
        targets: Iterable[str],
        *,
        schema: str | None = None,
        ledger_table: str = "saga_ledger",
        handlers: Actions | Mapping[str, Handler] | None = None,
    ) -> None:
        if not isinstance(name, str) or not 0 < len(name) <= 128:
            raise ConfigurationError(f"participant name {name!r} must be 1-128 characters")
        self.name = name
        self.targets = frozenset(targets)
        for target in sorted(self.targets):
            _check_identifier(target, "target table")
        _check_identifier(ledger_table, "ledger table")
        if len(ledger_table) > 50:
            raise ConfigurationError(
                f"ledger table name {ledger_table!r} is too long (at most 50 characters)"
            )
        if ledger_table in self.targets:
            raise ConfigurationError(
                f"the ledger table {ledger_table!r} cannot also be a target: steps would "
                "be able to rewrite the ledger"
            )
        if schema is not None:
            _check_identifier(schema, "schema")
        self.schema = schema
        self.url = _sqlalchemy_url(url)
        self.database = _describe(self.url)
        self._engine = _engine(self.url)
        self._metadata = MetaData(schema=schema)
        self.ledger_table = define_ledger(self._metadata, ledger_table)
        self._tables: dict[str, Table] = {}
        self._ready = False
        self._lock_transactions = self._engine.dialect.name == "postgresql"
        builtin = SqlActions(self.targets)
        self.actions: Actions = _DriverErrorsTranslated(combine(builtin, handlers))
        # Without handlers every action is built in, and batches may skip savepoints.
        self._builtin_only = not handlers
        self._fast_actions: Actions = _SavepointsNeeded(builtin)

    # -- lifecycle

    def setup(self) -> None:
        """Create the ledger if absent and reflect the target tables; idempotent.

        Raises :class:`ConfigurationError` naming what to fix when the schema or a
        target table is missing, a target has no single-column primary key, or
        the ledger table exists with another shape; :class:`TransientError` when
        the database is unreachable.
        """
        with self._boundary("set up its ledger and tables"):
            with self._engine.connect() as connection:
                self._check_schema(connection)
            self._create_ledger()
            reflected = MetaData(schema=self.schema)
            tables: dict[str, Table] = {}
            with self._engine.connect() as connection:
                for name in sorted(self.targets):
                    tables[name] = self._reflect(connection, reflected, name)
        self._tables = tables
        self._ready = True

    def close(self) -> None:
        self._engine.dispose()

    # -- work

    def execute(self, items: Sequence[WorkItem]) -> list[Report]:
        """Run the batch in one database transaction; return the reports once it committed.

        With built-in actions only, the batch runs without savepoints (a rejected
        built-in step has changed nothing, see :class:`SqlActions`); should an
        action meet a database error anyway (which aborts a PostgreSQL
        transaction), the batch is rolled back and run again *carefully*: each
        item in its own savepoint and each effect in another, as custom handlers
        always run. The ledger entries of the batch's transactions are read in
        one statement and the changed ones written in two, before the commit.

        Raises :class:`TransientError` when the database is unavailable or the batch
        lost a conflict: nothing of the batch took effect (or, when the connection
        broke during the commit itself, all of it did), and retrying is safe either
        way because the retry finds the ledger entries and re-reports them.
        """
        if not self._ready:
            self.setup()
        if self._builtin_only:
            try:
                return self._batch(items, careful=False)
            except _NeedsSavepoints:
                pass
        return self._batch(items, careful=True)

    def _batch(self, items: Sequence[WorkItem], *, careful: bool) -> list[Report]:
        reports: list[Report] = []
        actions = self.actions if careful else self._fast_actions
        with self._boundary("run a batch"), self._engine.begin() as connection:
            tx_ids = {item.tx_id for item in items}
            if self._lock_transactions and tx_ids:
                connection.execute(_tx_locks(self.name, tx_ids))
            ledger = _BatchLedger(self, connection)
            ledger.load(tx_ids)
            for item in items:
                if careful:
                    reports.extend(self._run_carefully(connection, ledger, item))
                    continue
                session = SqlSession(connection, self._tables, savepoints=False)
                try:
                    reports.extend(run_item(_SqlUnit(ledger, session), actions, item))
                except BusinessRejection as exc:
                    raise _NeedsSavepoints from exc
            ledger.flush()
        return reports

    def _run_carefully(
        self, connection: Connection, ledger: _BatchLedger, item: WorkItem
    ) -> list[Report]:
        session = SqlSession(connection, self._tables)
        unit = _SqlUnit(ledger, session)
        savepoint = connection.begin_nested()
        mark = ledger.checkpoint()
        try:
            reports = run_item(unit, self.actions, item)
        except BusinessRejection as exc:
            # run_item turns rejections of apply and compensate into events; only a
            # custom confirm gets here. The step stays applied, nothing is reported,
            # and a replayed commit decision tries the confirmation again.
            session.undo_effect()
            _close_savepoint(connection, savepoint, keep=False)
            ledger.undo_to(mark)
            log.error(
                "participant %r: confirming %s was rejected and is left for a replayed "
                "decision: %s",
                self.name,
                item.tx_id,
                exc.reason,
            )
            return []
        session.keep_effect()
        _close_savepoint(connection, savepoint, keep=True)
        return reports

    # -- reading the ledger

    def ledger(self, tx_id: str | None = None) -> list[LedgerEntry]:
        c = self.ledger_table.c
        query = select(self.ledger_table).where(c.participant == self.name, c.step >= 0)
        if tx_id is not None:
            query = query.where(c.tx_id == tx_id)
        query = query.order_by(c.tx_id, c.step)
        with self._boundary("read its ledger"), self._engine.connect() as connection:
            return [_entry_of(row) for row in connection.execute(query).mappings()]

    def in_flight_sequential(self) -> set[str]:
        """Sequential transactions in which a step of this participant may still need a
        neighbour's event: one waiting for its predecessor to be applied, or one applied
        or failed and not decided yet (its rollback may wait for its successor's
        compensation, and the predecessor's event, read again after a crash, reports it
        again)."""
        c = self.ledger_table.c
        waiting = c.status == str(LedgerStatus.WAITING)
        may_wait = c.status.in_((str(LedgerStatus.APPLIED), str(LedgerStatus.FAILED)))
        query = (
            select(c.tx_id)
            .where(c.participant == self.name, c.step >= 0, c.mode == str(Mode.SEQUENTIAL))
            .where(waiting | may_wait)
            .distinct()
        )
        with self._boundary("read its ledger"), self._engine.connect() as connection:
            return {row[0] for row in connection.execute(query)}

    def prune(self, horizon_ms: int, limit: int) -> int:
        """Delete up to ``limit`` entries finished at or before ``horizon_ms`` (one statement,
        through the ``(participant, finished_ms)`` index)."""
        if not self._ready:
            self.setup()
        c = self.ledger_table.c
        due = and_(c.participant == self.name, c.finished_ms <= horizon_ms)
        chosen = select(c.tx_id, c.step).where(due).order_by(c.finished_ms).limit(limit).subquery()
        statement = delete(self.ledger_table).where(
            due, tuple_(c.tx_id, c.step).in_(select(chosen.c.tx_id, chosen.c.step))
        )
        with self._boundary("prune its ledger"), self._engine.begin() as connection:
            return int(connection.execute(statement).rowcount)

    # -- set-up details

    def _check_schema(self, connection: Connection) -> None:
        if self.schema is None:
            return
        if self.schema not in inspect(connection).get_schema_names():
            raise ConfigurationError(
                f"schema {self.schema!r} does not exist in {self.database}; create it "
                f"(CREATE SCHEMA {self.schema}) or leave the schema setting out"
            )

    def _create_ledger(self) -> None:
        try:
            self._metadata.create_all(self._engine, tables=[self.ledger_table], checkfirst=True)
        except (sa_exc.IntegrityError, sa_exc.ProgrammingError):
            # Two participants starting together both saw no ledger and raced to
            # create it; the loser finds it there now.
            if not inspect(self._engine).has_table(self.ledger_table.name, schema=self.schema):
                raise
        with self._engine.connect() as connection:
            names = {
                column["name"]
                for column in inspect(connection).get_columns(
                    self.ledger_table.name, schema=self.schema
                )
            }
        missing = [name for name in _LEDGER_COLUMNS if name not in names]
        if missing:
            raise ConfigurationError(
                f"table {self._qualified(self.ledger_table.name)} exists but is not a saga "
                f"ledger (it lacks {', '.join(missing)}); choose another ledger table name"
            )
        added = [name for name in _ADDED_COLUMNS if name not in names]
        if added:
            self._upgrade_ledger(added)

    def _upgrade_ledger(self, added: Sequence[str]) -> None:
        """Give a ledger of the first layout the columns added since, and their index.

        Entries already there get their ``finished_ms`` (so they are pruned too) and
        no fingerprint (they match every request). Two participants may race to do
        this; the loser finds the columns there.
        """
        types = {"fingerprint": "VARCHAR(64)", "finished_ms": "BIGINT"}
        table = self._engine.dialect.identifier_preparer.format_table(self.ledger_table)
        try:
            with self._engine.begin() as connection:
                for name in added:
                    connection.execute(text(f"ALTER TABLE {table} ADD COLUMN {name} {types[name]}"))
                if "finished_ms" in added:
                    c = self.ledger_table.c
                    final = [str(status) for status in _FINAL_STATUSES]
                    parallel_applied = and_(
                        c.status == str(LedgerStatus.APPLIED),
                        c.mode == str(Mode.PARALLEL),
                        c.rollback_pending.is_(False),
                    )
                    latest = case((c.deadline_ms > c.updated_ms, c.deadline_ms), else_=c.updated_ms)
                    connection.execute(
                        update(self.ledger_table)
                        .where(c.status.in_(final) | (c.step < 0) | parallel_applied)
                        .values(finished_ms=latest)
                    )
                index = next(i for i in self.ledger_table.indexes if i.name and "finish" in i.name)
                index.create(connection, checkfirst=True)
        except (sa_exc.ProgrammingError, sa_exc.OperationalError):
            with self._engine.connect() as connection:
                inspector = inspect(connection)
                columns = inspector.get_columns(self.ledger_table.name, schema=self.schema)
            if not set(added) <= {column["name"] for column in columns}:
                raise

    def _reflect(self, connection: Connection, metadata: MetaData, name: str) -> Table:
        try:
            table = Table(name, metadata, autoload_with=connection)
        except sa_exc.NoSuchTableError:
            raise ConfigurationError(
                f"target table {self._qualified(name)} does not exist in {self.database}; "
                "create it, or remove it from the participant's targets"
            ) from None
        keys = [column.name for column in table.primary_key.columns]
        if len(keys) != 1:
            has = "none" if not keys else f"{len(keys)} columns: {', '.join(keys)}"
            raise ConfigurationError(
                f"target table {self._qualified(name)} must have a single-column primary key "
                f"(it has {has}); the step's key addresses one row by it"
            )
        return table

    def _qualified(self, name: str) -> str:
        return f"{self.schema}.{name}" if self.schema else name

    @contextmanager
    def _boundary(self, what: str) -> Iterator[None]:
        """Translate the driver's errors into the saga error tree (see the module doc)."""
        try:
            yield
        except sa_exc.DBAPIError as exc:
            self._translate(exc, what)
        except (sa_exc.DisconnectionError, sa_exc.TimeoutError) as exc:
            raise TransientError(
                f"participant {self.name!r} could not {what}: {self.database} is "
                f"unavailable ({_detail(exc)}); retrying is safe"
            ) from exc

    def _translate(self, exc: sa_exc.DBAPIError, what: str) -> NoReturn:
        prefix = f"participant {self.name!r} could not {what}"
        if _is_auth_failure(exc):
            raise ConfigurationError(
                f"{prefix}: authentication failure: {self.database} refused the user "
                f"{self.url.username or '(none)'!r} ({_detail(exc)}); fix the user name or "
                "password in the storage URL, or the server's pg_hba.conf"
            ) from exc
        if isinstance(exc, sa_exc.ProgrammingError) and not exc.connection_invalidated:
            raise ConfigurationError(
                f"{prefix}: {self.database} refused a statement ({_detail(exc)}); check the "
                "tables and the database user's privileges"
            ) from exc
        if _is_conflict(exc):
            raise TransientError(
                f"{prefix}: it conflicted with a concurrent transaction on {self.database} "
                f"({_detail(exc)}); retrying is safe"
            ) from exc
        raise TransientError(
            f"{prefix}: {self.database} is unavailable or failed ({_detail(exc)}); retrying is safe"
        ) from exc


def _tx_locks(participant: str, tx_ids: Iterable[str]) -> Executable:
    """PostgreSQL: one statement that takes, until commit, the locks on these transactions.

    Transactions hash into :data:`TX_LOCK_BUCKETS` locks per participant, which
    bounds the lock table entries a batch uses; two transactions sharing a lock
    only wait for each other while two workers overlap. Every batch takes its
    locks in ascending order, so batches never deadlock on them.
    """
    owner = _int32(zlib.crc32(participant.encode()))
    buckets = sorted({zlib.crc32(tx_id.encode()) % TX_LOCK_BUCKETS for tx_id in tx_ids})
    ordered = (
        select(func.unnest(literal(buckets, ARRAY(Integer))).label("bucket"))
        .order_by("bucket")
        .subquery()
    )
    return select(func.count(func.pg_advisory_xact_lock(owner, ordered.c.bucket)))


def _int32(value: int) -> int:
    return value - 2**32 if value >= 2**31 else value


def _check_identifier(name: Any, what: str) -> None:
    if not isinstance(name, str) or not IDENTIFIER.fullmatch(name):
        raise ConfigurationError(
            f"{what} name {name!r} is not a plain SQL name (1-63 letters, digits or _, "
            "not starting with a digit)"
        )


def _sqlalchemy_url(url: str) -> URL:
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


def _describe(url: URL) -> str:
    """Where the database is, for messages (never the password)."""
    backend = url.get_backend_name()
    if backend == "sqlite":
        return f"SQLite database {url.database or ':memory:'}"
    names = {"postgresql": "PostgreSQL"}
    host = url.host or "localhost"
    port = f":{url.port}" if url.port else ""
    return f"{names.get(backend, backend)} at {host}{port}/{url.database or ''}"


def _engine(url: URL) -> Engine:
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
        _sqlite_savepoints(engine)
    return engine


def _sqlite_savepoints(engine: Engine) -> None:
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
