"""One business row as the built-in actions reach it: reads, writes and the checks they share.

:class:`RecordBase` reads a row locked (through the batch's copy of the rows when
there is one, :mod:`participants.sql._rows`), writes it with its own statements,
and reads its holds (:mod:`participants.sql._holds`). What each action does with it
is in :mod:`participants.sql._actions` (level ``none``) and
:mod:`participants.sql._isolation` (``read_committed``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import Column, ColumnElement, RowMapping, Table, insert, select, update
from sqlalchemy.sql import sqltypes

from saga.participants._actions import BuiltinAction
from saga.participants.sql._holds import BOUNDS, HOLD, RESERVE, Hold, bounds_key
from saga.participants.sql._rows import NOT_CACHED, add
from saga.participants.sql._session import SqlSession
from saga.participants.sql._values import coerce, from_json, record_text, to_json
from saga.streams import BusinessRejection


class RecordBase:
    """One row of a target table, addressed by the step's key."""

    def __init__(self, session: SqlSession, table: Table, action: BuiltinAction) -> None:
        columns = list(table.primary_key.columns)
        self.session = session
        self.table = table
        self.pk: Column[Any] = columns[0]
        self.where = f"{action.target}/{action.key}"
        self.key = coerce(self.pk, action.key, f"key of {action.target}")
        self.at = (table.name, record_text(self.pk, self.key))
        self._held: list[Hold] | None = None

    # -- the row

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

    def _row(self) -> Mapping[Any, Any] | None:
        """The row, locked, as the batch has left it (``None``: absent); do not change it."""
        rows = self.session.rows
        if rows is not None:
            found = rows.row(self.table, self.key)
            if found is not NOT_CACHED:
                return found
        return self._locked()

    def _row_or_lock(self) -> Mapping[Any, Any] | None:
        """:meth:`_row`; when absent, first the record lock (so that another batch cannot
        create the row or hold the record meanwhile), then the row and holds again."""
        row = self._row()
        if row is None and self.session.holds.lock_absent(self.at):
            rows = self.session.rows
            if rows is not None:
                rows.forget_absent(self.table, self.key)
            self._held = None
            row = self._row()
        return row

    def _values(self, fields: Mapping[str, Any], what: str, *, key_allowed: bool) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for name, value in fields.items():
            column = self._column(name)
            coerced = coerce(column, value, f"{what} field {name!r} of {self.where}")
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

    def _counter(self, name: str) -> Column[Any]:
        column = self._column(name)
        if column is self.pk:
            raise BusinessRejection(f"increment may not change the key column {name!r}")
        if not isinstance(column.type, sqltypes.Integer | sqltypes.Numeric):
            raise BusinessRejection(f"{self.table.name}.{name} is not a numeric column")
        return column

    def _image(self, row: Mapping[Any, Any], names: Iterable[str] | None = None) -> dict[str, Any]:
        chosen = row.keys() if names is None else names
        return {name: to_json(row[name]) for name in chosen}

    def _restored(self, image: Any, what: str) -> dict[str, Any]:
        if not isinstance(image, Mapping):
            raise BusinessRejection(f"the before-image of {self.where} is missing; {what}")
        return {name: from_json(self._column(name), value) for name, value in image.items()}

    def _insert(self, values: Mapping[str, Any]) -> None:
        self.session.execute(insert(self.table).values({self.pk.name: self.key, **values}))

    def _set(self, values: Mapping[str, Any]) -> int:
        if not values:
            return 1 if self._locked() is not None else 0
        statement = update(self.table).where(self._match()).values(dict(values))
        return self.session.execute(statement).rowcount

    # -- holds

    def _holds(self) -> list[Hold]:
        """The record's holds, reservations and bounds (read once per action)."""
        if self._held is None:
            self._held = self.session.holds.of(self.at)
        return self._held

    def _refuse_held(self, tx_id: str | None, *, reservations: bool, suffix: str) -> None:
        """A :class:`BusinessRejection` naming the first other saga that holds the record
        (``reservations``: or has an open increment of it); ``tx_id`` is the acting saga."""
        kinds = (HOLD, RESERVE) if reservations else (HOLD,)
        for hold in self._holds():
            if hold.kind in kinds and hold.tx_id != tx_id:
                raise BusinessRejection(
                    f"{self.where} is held by saga {hold.tx_id} (step {hold.step}) until "
                    f"its decision; {suffix}"
                )

    def _open(self, column: Column[Any], tx_id: str | None = None) -> tuple[Any, Any, Any]:
        """The sums of the open decrements and increments of ``column`` by sagas other
        than ``tx_id``, and the sum of ``tx_id``'s own: those commit or roll back with
        the step that counts them, so they count in both directions."""
        down: Any = 0
        up: Any = 0
        own: Any = 0
        for hold in self._holds():
            if hold.kind == RESERVE and hold.field == column.name:
                by = from_json(column, (hold.value or {}).get("by"))
                if by is None:
                    continue
                if hold.tx_id == tx_id:
                    own = add(own, by)
                elif by < 0:
                    down = add(down, by)
                else:
                    up = add(up, by)
        return down, up, own

    def _bounds(self, column: Column[Any]) -> tuple[Any, Any]:
        """The tightest ``min`` and ``max`` any bounded increment of ``column`` relied on."""
        for hold in self._holds():
            if hold.kind == BOUNDS and hold.field == column.name:
                value = hold.value or {}
                return from_json(column, value.get("min")), from_json(column, value.get("max"))
        return None, None

    def _escrow(
        self,
        column: Column[Any],
        current: Any,
        by: Any,
        low: Any,
        high: Any,
        tx_id: str | None = None,
    ) -> None:
        """Reject unless ``current + by`` stays in ``[low, high]`` whichever of the open
        increments of the field commit: the check counts those of other sagas in the
        direction that could break each bound (O'Neil's escrow), and those of saga
        ``tx_id`` (the acting one) in both."""
        down, up, own = self._open(column, tx_id)
        current = add(current, own)
        if low is not None:
            result = add(add(current, down), by)
            if result < low:
                raise BusinessRejection(
                    f"{self.where} {column.name} would be {result}{counting(down)}, below "
                    f"the minimum {low}"
                )
        if high is not None:
            result = add(add(current, up), by)
            if result > high:
                raise BusinessRejection(
                    f"{self.where} {column.name} would be {result}{counting(up)}, above "
                    f"the maximum {high}"
                )

    def _note_bounds(self, column: Column[Any], low: Any, high: Any) -> None:
        """Record ``low``/``high`` on the field when tighter than those recorded."""
        if low is None and high is None:
            return
        old_low, old_high = self._bounds(column)
        new_low = low if old_low is None or (low is not None and low > old_low) else old_low
        new_high = high if old_high is None or (high is not None and high < old_high) else old_high
        if (new_low, new_high) == (old_low, old_high):
            return
        key = bounds_key(self.at[0], self.at[1], column.name)
        value = {"min": to_json(new_low), "max": to_json(new_high)}
        self.session.holds.add(Hold(*key, kind=BOUNDS, action="increment", value=value))
        self._held = None


def counting(open_sum: Any) -> str:
    return "" if open_sum == 0 else " (counting open reservations)"
