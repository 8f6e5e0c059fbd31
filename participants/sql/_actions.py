"""The built-in actions on reflected SQL tables, and an action's database errors as rejections.

See :class:`SqlActions` for what each action does to a row and its before-image, and
:mod:`participants.sql._isolation` for what it does under ``read_committed``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final

from sqlalchemy import Table, delete, update
from sqlalchemy import exc as sa_exc

from saga.participants._actions import BuiltinAction, BuiltinActions, Increment, RecordOps
from saga.participants._barrier import (
    LedgerEntry,
    LedgerStatus,
    PredecessorApplied,
    Requested,
    SuccessorCompensated,
    isolation_of,
)
from saga.participants._refusals import step_name
from saga.participants._storage import (
    Actions,
    DecisionArrived,
    RunBatchAgain,
    StepScope,
    WorkItem,
)
from saga.participants.sql._errors import step_refusal
from saga.participants.sql._holds import Record
from saga.participants.sql._isolation import RETRY, IsolatedRecord
from saga.participants.sql._rows import add, subtract
from saga.participants.sql._session import SqlSession
from saga.participants.sql._values import coerce, record_text
from saga.streams import BusinessRejection, Isolation, Outcome

_CREATING: Final = frozenset({"insert", "put"})
"""Actions whose request may create a row (and whose entries' decisions may, with delete's
compensation): their records are locked before the batch reads them."""


class SqlActions(BuiltinActions[SqlSession]):
    """The built-in actions on reflected tables (``native`` must be a :class:`SqlSession`).

    ``key`` is the value of the table's single-column primary key; fields are
    columns (an unknown column is a business rejection). Values are converted to
    the column's type (``"42"`` for an integer column is 42; a fraction for an
    integer column is rejected). Before-images are JSON
    (:mod:`participants.sql._values`); the compensation converts them back by the
    column's type.

    At level ``none``: ``put`` sets the given columns and leaves the others as they
    are (or at their defaults for a new row). ``increment`` reads the row locked,
    checks the bounds (counting the open reservations of ``read_committed`` sagas,
    :meth:`~participants.sql._record.RecordBase._escrow`) and adds ``by``. Its
    compensation is ``field - by``, so it commutes with other increments in between.
    Every step also fails on a record another saga holds. In a batch without
    savepoints increments run on the batch's locked copy of the rows and are written
    once at the end (:mod:`participants.sql._rows`); every other action first writes
    that copy back and then runs its own statements. Under ``read_committed`` see
    :mod:`participants.sql._isolation`.

    Every built-in action and compensation decides to reject *before* it writes:
    a rejected built-in step has changed nothing, which is what lets a batch of
    built-in steps run without savepoints (see :meth:`SqlStorage.execute`).
    """

    def record(self, native: SqlSession, action: BuiltinAction) -> RecordOps:
        return _Record(native, native.table(action.target), action)


class _Record(IsolatedRecord):
    """One row of a target table and what the actions do to it at level ``none``."""

    # -- actions

    def insert(self, fields: Mapping[str, Any]) -> None:
        values = self._values(fields, "insert", key_allowed=True)
        row = self._row_or_lock()
        self._refuse_held(None, reservations=True, suffix=RETRY)
        if row is not None:
            raise BusinessRejection(f"{self.where} already exists")
        self._direct()
        self._insert(values)

    def put(self, fields: Mapping[str, Any]) -> dict[str, Any] | None:
        values = self._values(fields, "put", key_allowed=True)
        row = self._row_or_lock()
        self._refuse_held(None, reservations=True, suffix=RETRY)
        self._direct()
        if row is None:
            # A writer outside the product may insert the same key between our read
            # and our insert; a savepoint lets us see that and overwrite it instead.
            try:
                with self.session.connection.begin_nested():
                    self._insert(values)
            except sa_exc.IntegrityError:
                row = self._locked()
                if row is None:
                    raise
            else:
                return None
        image = self._image(row)
        self._set(values)
        return image

    def update(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        values = self._values(fields, "update", key_allowed=False)
        row = self._row()
        if row is None:
            raise BusinessRejection(f"{self.where} does not exist")
        self._refuse_held(None, reservations=True, suffix=RETRY)
        image = self._image(row, values)
        self._direct()
        self._set(values)
        return image

    def delete(self) -> dict[str, Any]:
        row = self._row()
        if row is None:
            raise BusinessRejection(f"{self.where} does not exist")
        self._refuse_held(None, reservations=True, suffix=RETRY)
        image = self._image(row)
        self._direct()
        self.session.execute(delete(self.table).where(self._match()))
        return image

    def increment(self, action: Increment) -> None:
        column = self._counter(action.field)
        by = coerce(column, action.by, f"the increment of {self.where}")
        low = None if action.min is None else coerce(column, action.min, "the minimum")
        high = None if action.max is None else coerce(column, action.max, "the maximum")
        row = self._row()
        if row is None:
            raise BusinessRejection(f"{self.where} does not exist")
        self._refuse_held(None, reservations=False, suffix=RETRY)
        current = row[column.name]
        if current is None:
            raise BusinessRejection(f"{self.where} has no value in {column.name}")
        self._escrow(column, current, by, low, high)
        self._note_bounds(column, low, high)
        rows = self.session.rows
        if rows is not None and isinstance(row, dict):
            rows.set(self.table, self.key, column, add(current, by))
            return
        self._direct()
        # The row is locked (read FOR UPDATE above): nobody changed it since.
        statement = update(self.table).where(self._match()).values({column.name: column + by})
        self.session.execute(statement)

    # -- compensations (after guard())

    def remove(self) -> None:
        self._direct()
        # Already gone is fine: the compensation wants the key absent.
        self.session.execute(delete(self.table).where(self._match()))

    def restore_put(self, before: Any) -> None:
        if before is None:
            self.remove()
            return
        values = self._restored(before, "the put cannot be undone")
        values.pop(self.pk.name, None)
        self._row_or_lock()
        self._direct()
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
        values = self._restored(before, "the deleted row cannot be restored")
        values.pop(self.pk.name, None)
        if self._row_or_lock() is not None:
            raise BusinessRejection(
                f"{self.where} exists again, so the deleted row cannot be restored"
            )
        self._direct()
        self._insert(values)

    def increment_back(self, action: Increment, before: Any = None) -> None:
        column = self._counter(action.field)
        by = coerce(column, action.by, f"the increment of {self.where}")
        row = self._row()
        rows = self.session.rows
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


@dataclass
class BatchKeys:
    """The records a batch's built-in steps will touch (see :func:`batch_keys`)."""

    rows: dict[str, set[Any]] = field(default_factory=dict)
    """Target name -> coerced keys: the rows to read (and lock) first."""
    records: set[Record] = field(default_factory=set)
    """Their ``(target, record)`` names in the holds table: the holds to read."""
    creating: set[Record] = field(default_factory=set)
    """Those whose row a step may create: their record locks are taken first."""


def batch_keys(
    items: Iterable[WorkItem],
    entries: Callable[[str], list[LedgerEntry]],
    tables: Mapping[str, Table],
) -> BatchKeys:
    """The records a batch's built-in steps will touch: those its requests name, and
    those of the recorded steps its other items act on (``entries`` gives a
    transaction's recorded steps): a commit's ``read_committed`` steps, a
    rollback's applied ones, a neighbour's signal's step. Steps that do not parse or
    whose key does not fit are left out: they will be rejected, or read on their own
    when they run. A commit of ``none`` steps touches nothing."""
    wanted = BatchKeys()
    for item in items:
        for name, args, creating in _touched(item, entries):
            if not isinstance(args, Mapping):
                continue
            # Only the target and the key matter here (the action validates the whole
            # step when it runs): reading a row a rejected step names costs nothing
            # but the lock.
            target, key = args.get("target"), args.get("key")
            if not isinstance(target, str) or isinstance(key, bool):
                continue
            table = tables.get(target)
            if table is None or not isinstance(key, str | int) or not isinstance(name, str):
                continue
            pk = next(iter(table.primary_key.columns))
            try:
                coerced = coerce(pk, key, "key")
            except BusinessRejection:
                continue
            if coerced is None:
                continue
            wanted.rows.setdefault(target, set()).add(coerced)
            record = (table.name, record_text(pk, coerced))
            wanted.records.add(record)
            if creating:
                wanted.creating.add(record)
    return wanted


def _touched(
    item: WorkItem, entries: Callable[[str], list[LedgerEntry]]
) -> list[tuple[Any, Any, bool]]:
    """``(action, args, may create the row)`` of the steps ``item`` may act on."""
    if isinstance(item, Requested):
        return [(item.action, item.args, item.action in _CREATING)]
    if isinstance(item, DecisionArrived):
        commit = item.outcome is Outcome.COMMIT
        chosen = [
            e
            for e in entries(item.tx_id)
            if (
                e.status is LedgerStatus.APPLIED
                and (not commit or isolation_of(e.before) is Isolation.READ_COMMITTED)
            )
            or (not commit and e.status is LedgerStatus.COMPENSATION_FAILED)
        ]
    elif isinstance(item, PredecessorApplied | SuccessorCompensated):
        chosen = [e for e in entries(item.tx_id) if e.step == item.step]
    else:
        return []
    return [(e.action, e.args, e.action in (*_CREATING, "delete")) for e in chosen if e.action]


# ---------------------------------------------------------------- driver errors


class NeedsSavepoints(RunBatchAgain):
    """A batch running without savepoints met a database error; run it carefully."""


class DriverErrors(Actions[SqlSession]):
    """Runs ``inner`` and turns what the database says about an action's statement (built-in
    or a custom handler's) into the step's refusal: :func:`participants.sql._errors.verdict`
    says which errors are the step's (a constraint, a trigger's exception, a data or
    syntax error: :class:`~participants._refusals.StoreRefused`; a statement or lock
    timeout: the same, marked a timeout, which the storage runs again a few times first).

    Only inside the step's effect savepoint can that be: in a batch without
    savepoints (:attr:`SqlSession.savepoints` false) the error has aborted the whole
    PostgreSQL transaction, so it stops the batch (:class:`NeedsSavepoints`), which
    runs again with savepoints, where just that step is refused. Anything else
    propagates: the storage boundary makes connection trouble a
    :class:`TransientError`, and a handler's own bug fails its item.
    """

    def __init__(self, inner: Actions[SqlSession]) -> None:
        self.inner = inner

    def apply(self, native: SqlSession, action: str, args: Mapping[str, Any]) -> Any:
        with _rejected_by_database(native, "", action, args):
            return self.inner.apply(native, action, args)

    def compensate(
        self, native: SqlSession, action: str, args: Mapping[str, Any], before: Any
    ) -> None:
        with _rejected_by_database(native, "the compensation of ", action, args):
            self.inner.compensate(native, action, args, before)

    def confirm(self, native: SqlSession, action: str, args: Mapping[str, Any]) -> None:
        with _rejected_by_database(native, "the commit of ", action, args):
            self.inner.confirm(native, action, args)

    def scoped(self, scope: StepScope) -> Actions[SqlSession]:
        return DriverErrors(self.inner.scoped(scope))

    def has_confirm(self, action: str) -> bool:
        return self.inner.has_confirm(action)

    def confirms_any(self) -> bool:
        return self.inner.confirms_any()


@contextmanager
def _rejected_by_database(
    session: SqlSession, doing: str, action: str, args: Mapping[str, Any]
) -> Iterator[None]:
    try:
        yield
    except sa_exc.DBAPIError as exc:
        refused = step_refusal(exc, doing + step_name(action, args))
        if refused is None:
            raise
        if not session.savepoints:
            raise NeedsSavepoints from exc
        raise refused from exc
