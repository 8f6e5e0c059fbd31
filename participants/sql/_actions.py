"""The built-in actions on reflected SQL tables, and an action's database errors as rejections.

See :class:`SqlActions` for what each action does to a row and its before-image.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import date, datetime, time
from decimal import Decimal, InvalidOperation
from typing import Any, Final

from sqlalchemy import (
    Column,
    ColumnElement,
    RowMapping,
    Table,
    and_,
    delete,
    insert,
    select,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.sql import sqltypes

from saga.participants._actions import (
    BuiltinAction,
    BuiltinActions,
    Increment,
    RecordOps,
)
from saga.participants._barrier import LedgerEntry, Requested
from saga.participants._storage import Actions, RunBatchAgain, StepScope, WorkItem
from saga.participants.sql._errors import detail
from saga.participants.sql._rows import NOT_CACHED, add, subtract
from saga.participants.sql._session import SqlSession
from saga.streams import BusinessRejection

_INTEGER_TEXT: Final = re.compile(r"[+-]?[0-9]+")


class SqlActions(BuiltinActions[SqlSession]):
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
    In a batch without savepoints both run on the batch's locked copy of the rows
    and are written once at the end (:mod:`participants._sql_rows`); every other
    action first writes that copy back and then runs its own statements.

    Every built-in action and compensation decides to reject *before* it writes:
    a rejected built-in step has changed nothing, which is what lets a batch of
    built-in steps run without savepoints (see :meth:`SqlStorage.execute`).
    """

    def record(self, native: SqlSession, action: BuiltinAction) -> RecordOps:
        return _Record(native, native.table(action.target), action)


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

    def _direct(self) -> None:
        """This action runs its own statements on the row: the batch's copy steps aside."""
        rows = self.session.rows
        if rows is not None:
            rows.direct(self.table, self.key)

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
        self._direct()
        values = self._values(fields, "insert", key_allowed=True)
        if self._locked() is not None:
            raise BusinessRejection(f"{self.where} already exists")
        self._insert(values)

    def put(self, fields: Mapping[str, Any]) -> dict[str, Any] | None:
        self._direct()
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
        self._direct()
        values = self._values(fields, "update", key_allowed=False)
        row = self._existing()
        self._set(values)
        return self._image(row, values)

    def delete(self) -> dict[str, Any]:
        self._direct()
        row = self._existing()
        self.session.execute(delete(self.table).where(self._match()))
        return self._image(row)

    def increment(self, action: Increment) -> None:
        column = self._counter(action.field)
        by = _coerce(column, action.by, f"the increment of {self.where}")
        low = None if action.min is None else _coerce(column, action.min, "the minimum")
        high = None if action.max is None else _coerce(column, action.max, "the maximum")
        rows = self.session.rows
        row = NOT_CACHED if rows is None else rows.row(self.table, self.key)
        if rows is not None and isinstance(row, dict):
            current = row[column.name]
            if current is None:
                raise BusinessRejection(f"{self.where} has no value in {column.name}")
            self._check_bounds(column, add(current, by), low, high)
            rows.set(self.table, self.key, column, add(current, by))
            return
        if row is None:
            raise BusinessRejection(f"{self.where} does not exist")
        self._direct()
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
        self._check_bounds(column, current + by, low, high)
        raise BusinessRejection(f"{self.where} {column.name} is out of bounds")

    def _check_bounds(self, column: Column[Any], result: Any, low: Any, high: Any) -> None:
        if low is not None and result < low:
            raise BusinessRejection(
                f"{self.where} {column.name} would be {result}, below the minimum {low}"
            )
        if high is not None and result > high:
            raise BusinessRejection(
                f"{self.where} {column.name} would be {result}, above the maximum {high}"
            )

    # -- compensations

    def remove(self) -> None:
        self._direct()
        # Already gone is fine: the compensation wants the key absent.
        self.session.execute(delete(self.table).where(self._match()))

    def restore_put(self, before: Any) -> None:
        self._direct()
        if before is None:
            self.remove()
            return
        values = self._restored(before, "the put cannot be undone")
        values.pop(self.pk.name, None)
        if self._set(values) == 0:
            self._insert(values)

    def restore_fields(self, before: Any) -> None:
        self._direct()
        values = self._restored(before, "the update cannot be undone")
        if self._set(values) == 0:
            raise BusinessRejection(
                f"{self.where} no longer exists, so its update cannot be undone"
            )

    def reinsert(self, before: Any) -> None:
        self._direct()
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
        rows = self.session.rows
        row = NOT_CACHED if rows is None else rows.row(self.table, self.key)
        if rows is not None and isinstance(row, dict):
            current = row[column.name]
            if current is not None:  # NULL - by stays NULL, as the statement would leave it
                rows.set(self.table, self.key, column, subtract(current, by))
            return
        if row is not None:
            self._direct()
            statement = update(self.table).where(self._match()).values({column.name: column - by})
            if self.session.execute(statement).rowcount == 1:
                return
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


def increment_keys(
    items: Iterable[WorkItem],
    entries: Iterable[LedgerEntry],
    tables: Mapping[str, Table],
) -> dict[str, set[Any]]:
    """The rows (table name -> coerced keys) that the increments of a batch may touch:
    those its requests name, and those of its transactions' ledger ``entries`` (their
    compensations). Steps that do not parse or whose key does not fit are left out:
    they will be rejected, or read on their own when they run."""
    wanted: dict[str, set[Any]] = {}
    actions = [(item.action, item.args) for item in items if isinstance(item, Requested)]
    actions += [(e.action, e.args) for e in entries if e.action is not None and e.args]
    for name, args in actions:
        if name != "increment" or not isinstance(args, Mapping):
            continue
        # Only the target and the key matter here (the action validates the whole step
        # when it runs): reading a row a rejected step names costs nothing but the lock.
        target, key = args.get("target"), args.get("key")
        if not isinstance(target, str) or isinstance(key, bool) or not isinstance(key, str | int):
            continue
        table = tables.get(target)
        if table is None:
            continue
        try:
            coerced = _coerce(next(iter(table.primary_key.columns)), key, "key")
        except BusinessRejection:
            continue
        if coerced is not None:
            wanted.setdefault(target, set()).add(coerced)
    return wanted


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


# ---------------------------------------------------------------- driver errors


class NeedsSavepoints(RunBatchAgain):
    """A batch running without savepoints met a database error; run it carefully."""


class DriverErrors(Actions[SqlSession]):
    """Runs ``inner`` and turns an action's integrity or data error into a rejection.

    Only inside the step's effect savepoint can that be: in a batch without
    savepoints (:attr:`SqlSession.savepoints` false) the error has aborted the whole
    PostgreSQL transaction, so it stops the batch (:class:`NeedsSavepoints`), which
    runs again with savepoints, where just that step is rejected. Anything else
    propagates: the storage boundary makes connection trouble a
    :class:`TransientError`, and a handler's own bug fails its item.
    """

    def __init__(self, inner: Actions[SqlSession]) -> None:
        self.inner = inner

    def apply(self, native: SqlSession, action: str, args: Mapping[str, Any]) -> Any:
        with _rejected_by_database(native, action):
            return self.inner.apply(native, action, args)

    def compensate(
        self, native: SqlSession, action: str, args: Mapping[str, Any], before: Any
    ) -> None:
        with _rejected_by_database(native, f"the compensation of {action}"):
            self.inner.compensate(native, action, args, before)

    def confirm(self, native: SqlSession, action: str, args: Mapping[str, Any]) -> None:
        with _rejected_by_database(native, f"the confirmation of {action}"):
            self.inner.confirm(native, action, args)

    def scoped(self, scope: StepScope) -> Actions[SqlSession]:
        return DriverErrors(self.inner.scoped(scope))

    def has_confirm(self, action: str) -> bool:
        return self.inner.has_confirm(action)

    def confirms_any(self) -> bool:
        return self.inner.confirms_any()


@contextmanager
def _rejected_by_database(session: SqlSession, what: str) -> Iterator[None]:
    try:
        yield
    except (sa_exc.IntegrityError, sa_exc.DataError) as exc:
        if exc.connection_invalidated:
            raise
        if not session.savepoints:
            raise NeedsSavepoints from exc
        raise BusinessRejection(f"{what} was refused by the database: {detail(exc)}") from exc
