"""Read committed on SQL rows: holds, escrow reservations, and the guard of ``none`` compensations.

What :class:`~participants._actions.RecordOps` asks (its docstring is the contract),
on one row and the holds table beside it (:mod:`participants.sql._holds`):

* :meth:`IsolatedRecord.hold` checks the action's precondition on the row *as the
  saga sees it* (the committed row, with the saga's own earlier holds of it
  applied, so steps of one saga on one record are compatible) and records the
  hold with the intended fields; the row itself does not change;
* :meth:`IsolatedRecord.reserve` is escrow: the bound check counts the committed
  value plus every open reservation of the field in the direction that could
  break the bound; the reservation is recorded, the value does not change;
* :meth:`IsolatedRecord.commit` writes what was held or adds what was reserved, and
  removes the row from the holds table; :meth:`IsolatedRecord.release` only removes
  it. Both are idempotent (a removed row means done) and never fail: a commit
  whose row is gone, or whose field is ``NULL``, writes nothing;
* :meth:`IsolatedRecord.guard` runs before a ``none`` compensation and refuses it,
  naming the record, when it would overwrite work that is not the step's own.

Another saga's step on a held record fails at once, naming the holder: no step
waits for another saga, so no deadlock spans participants and no partition stalls
(the saga rolls back; the client may submit it again after the holder's decision).
Every read happens after the row is locked, or, for an absent row, after the
record lock (:class:`~participants.sql._holds.RecordLocks`), so two workers never
both pass a check.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

from sqlalchemy import CHAR, Column, delete, update
from sqlalchemy import exc as sa_exc

from saga.participants._actions import Delete, Increment, Insert, Put, Update
from saga.participants._storage import StepScope
from saga.participants.sql._errors import detail
from saga.participants.sql._holds import HOLD, RESERVE, Hold, HoldKey
from saga.participants.sql._record import RecordBase, counting
from saga.participants.sql._rows import NOT_CACHED, add, as_stored, subtract
from saga.participants.sql._values import coerce, column_range, to_json
from saga.streams import BusinessRejection

log = logging.getLogger("saga.participant")

RETRY: Final = "retry after it"
NOT_RESTORED: Final = "not restored"
BOUND_TAIL: Final = f" that a bounded increment relied on; {NOT_RESTORED}"

Held = Insert | Put | Update | Delete


class IsolatedRecord(RecordBase):
    """A row's ``read_committed`` operations and the guard of its ``none`` compensations."""

    # -- read_committed

    def hold(self, scope: StepScope, action: Held) -> None:
        name = _name(action)
        values = self._fields_of(action)
        row = self._row_or_lock()
        self._refuse_held(scope.tx_id, reservations=True, suffix=RETRY)
        view = self._view(scope.tx_id, row)
        if isinstance(action, Insert) and view is not None:
            raise BusinessRejection(f"{self.where} already exists")
        if isinstance(action, Update | Delete) and view is None:
            raise BusinessRejection(f"{self.where} does not exist")
        self._try(scope.tx_id, action, values, row)
        image = None if values is None else {n: to_json(v) for n, v in values.items()}
        hold = Hold(*self.at, "", scope.tx_id, scope.step, HOLD, name, image)
        self.session.holds.add(hold)

    def reserve(self, scope: StepScope, action: Increment) -> None:
        column = self._counter(action.field)
        by = coerce(column, action.by, f"the increment of {self.where}")
        low = None if action.min is None else coerce(column, action.min, "the minimum")
        high = None if action.max is None else coerce(column, action.max, "the maximum")
        row = self._row()
        self._refuse_held(scope.tx_id, reservations=False, suffix=RETRY)
        view = self._view(scope.tx_id, row)
        if view is None:
            raise BusinessRejection(f"{self.where} does not exist")
        current = view.get(column.name)
        if current is None:
            raise BusinessRejection(f"{self.where} has no value in {column.name}")
        self._escrow(column, current, by, low, high, scope.tx_id)
        self._fits(column, current, by)
        self._note_bounds(column, low, high)
        value = {"by": to_json(by)}
        hold = Hold(*self.at, column.name, scope.tx_id, scope.step, RESERVE, "increment", value)
        self.session.holds.add(hold)

    def commit(self, scope: StepScope, action: Held | Increment) -> None:
        if not self.session.holds.drop(self._key_of(scope, action)):
            return  # committed or released already
        self._held = None
        if isinstance(action, Increment):
            self._add(scope, action)
        elif isinstance(action, Delete):
            self._direct()
            self.session.execute(delete(self.table).where(self._match()))
        elif isinstance(action, Update):
            values = self._values(action.set, "update", key_allowed=False)
            self._direct()
            if self._set(values) == 0:  # deleted behind the product's back: stays deleted
                nothing_to_write(scope, self.where)
        else:
            values = self._values(action.value, _name(action), key_allowed=True)
            row = self._row_or_lock()
            self._direct()
            if row is None:
                self._insert(values)
            else:
                self._set(values)  # created behind the product's back: overwritten

    def release(self, scope: StepScope, action: Held | Increment) -> None:
        self.session.holds.drop(self._key_of(scope, action))
        self._held = None

    def _key_of(self, scope: StepScope, action: Held | Increment) -> HoldKey:
        field = self._counter(action.field).name if isinstance(action, Increment) else ""
        return (self.at[0], self.at[1], field, scope.tx_id, scope.step)

    def _add(self, scope: StepScope, action: Increment) -> None:
        """Commit a reservation: ``field + by``, unbounded (escrow kept the bounds)."""
        column = self._counter(action.field)
        by = coerce(column, action.by, f"the increment of {self.where}")
        rows = self.session.rows
        cached = NOT_CACHED if rows is None else rows.row(self.table, self.key)
        if rows is not None and isinstance(cached, dict):
            if cached[column.name] is None:
                nothing_to_write(scope, self.where)
            else:
                rows.set(self.table, self.key, column, add(cached[column.name], by))
            return
        if cached is None:
            nothing_to_write(scope, self.where)  # the row is gone: nothing to add to
            return
        self._direct()
        statement = (
            update(self.table)
            .where(self._match(), column.is_not(None))
            .values({column.name: column + by})
        )
        if self.session.execute(statement).rowcount == 0:
            nothing_to_write(scope, self.where)

    def _try(self, tx_id: str, action: Held, values: dict[str, Any] | None, row: Any) -> None:
        """Run the write the commit will run, in a savepoint rolled back at once, so that
        what the database refuses (a NOT NULL, a CHECK, a foreign key, a value out of
        range) fails the step now rather than its commit later. Only where the row in
        the database is the one the commit will meet (not after this saga's own holds).
        Triggers run and roll back with it; a sequence a default draws from advances,
        as after any insert rolled back."""
        if any(h.kind == HOLD and h.tx_id == tx_id for h in self._holds()):
            return
        self._direct()
        savepoint = self.session.connection.begin_nested()
        try:
            if isinstance(action, Delete):
                if row is not None:
                    self.session.execute(delete(self.table).where(self._match()))
            elif row is None:
                if not isinstance(action, Update):
                    self._insert(values or {})
            else:
                self._set(values or {})
        except (sa_exc.IntegrityError, sa_exc.DataError) as exc:
            if exc.connection_invalidated:
                raise
            raise BusinessRejection(
                f"{_name(action)} was refused by the database: {detail(exc)}"
            ) from exc
        finally:
            if savepoint.is_active:
                savepoint.rollback()

    def _fits(self, column: Column[Any], current: Any, by: Any) -> None:
        """Refuse an increment whose commit the column could not store (checked now, as
        the commit must not fail): counting the open reservations in either direction."""
        limits = column_range(column, self.session.connection.dialect.name)
        if limits is None:
            return
        down, up, _ = self._open(column)  # every saga's, the acting one's too
        for result in (add(add(current, down), by), add(add(current, up), by)):
            if not limits[0] <= as_stored(column, result) <= limits[1]:
                raise BusinessRejection(
                    f"{self.where} {column.name} would be {result}{counting(down or up)}, "
                    f"which does not fit column {self.table.name}.{column.name} ({column.type})"
                )

    def _fields_of(self, action: Held) -> dict[str, Any] | None:
        if isinstance(action, Delete):
            return None
        if isinstance(action, Update):
            return self._values(action.set, "update", key_allowed=False)
        return self._values(action.value, _name(action), key_allowed=True)

    def _view(self, tx_id: str, row: Mapping[Any, Any] | None) -> dict[str, Any] | None:
        """The row as saga ``tx_id`` sees it: committed, with its own holds applied in
        step order (the order its commit writes them)."""
        view = None if row is None else dict(row)
        for hold in self._holds():
            if hold.kind != HOLD or hold.tx_id != tx_id:
                continue
            if hold.action == "delete":
                view = None
                continue
            fields = self._restored(hold.value or {}, "its hold is unreadable")
            if hold.action == "update":
                if view is not None:
                    view.update(fields)
            else:
                view = {**(view or {self.pk.name: self.key}), **fields}
        return view

    # -- none: the compensation's guard

    def guard(self, action: Held | Increment, before: Any) -> None:
        """Refuse a ``none`` compensation that would overwrite what is not the step's own:
        the record held by a saga, a field changed since the step wrote it, or an
        increment's undo leaving the field outside a bound a step relied on. A row that
        is gone (or back, after a delete) is left to the compensation, which says so."""
        if isinstance(action, Increment):
            self._guard_increment(action)
            return
        row = self._row()
        self._refuse_held(None, reservations=True, suffix=NOT_RESTORED)
        if row is None or isinstance(action, Delete):
            return
        written = action.set if isinstance(action, Update) else action.value
        values = self._values(written, _name(action), key_allowed=not isinstance(action, Update))
        for name, value in values.items():
            column = self._column(name)
            now = row[name]
            if not _same(column, now, value):
                raise BusinessRejection(
                    f"{self.where} changed since this step wrote it: {name} is {_shown(now)}, "
                    f"not {_shown(as_stored(column, value))}; {NOT_RESTORED}"
                )

    def _guard_increment(self, action: Increment) -> None:
        column = self._counter(action.field)
        by = coerce(column, action.by, f"the increment of {self.where}")
        row = self._row()
        if row is None or row[column.name] is None:
            return
        self._refuse_held(None, reservations=False, suffix=NOT_RESTORED)
        after = subtract(row[column.name], by)
        low, high = self._bounds(column)
        down, up, _ = self._open(column)
        if low is not None and add(after, down) < low:
            raise BusinessRejection(
                f"{self.where} {column.name} would be {add(after, down)}{counting(down)} "
                f"after undoing this step, below the minimum {low}{BOUND_TAIL}"
            )
        if high is not None and add(after, up) > high:
            raise BusinessRejection(
                f"{self.where} {column.name} would be {add(after, up)}{counting(up)} "
                f"after undoing this step, above the maximum {high}{BOUND_TAIL}"
            )


def nothing_to_write(scope: StepScope, where: str) -> None:
    """A commit whose row changed outside the product (gone, or a ``NULL`` to add to)
    writes nothing: a commit never fails. Said in the log, for an operator."""
    log.warning(
        "commit of saga %s step %d found nothing to write: %s was changed outside the "
        "product (deleted, or its field set to NULL) while the step held it",
        scope.tx_id,
        scope.step,
        where,
    )


def _name(action: Held | Increment) -> str:
    return type(action).__name__.lower()


def _same(column: Column[Any], now: Any, written: Any) -> bool:
    """Whether the stored ``now`` is what writing ``written`` to ``column`` left."""
    if isinstance(now, str) and isinstance(written, str) and isinstance(column.type, CHAR):
        return now.rstrip(" ") == written.rstrip(" ")
    return bool(now == as_stored(column, written))


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(to_json(value))
