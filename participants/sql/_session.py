"""The SQL adapter's native session: the batch's connection, scoped to one step's effect.

See :mod:`participants._sql` for the savepoints a batch uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, CursorResult, Executable, NestedTransaction, Table

from saga.streams import BusinessRejection

if TYPE_CHECKING:
    from saga.participants.sql._holds import Holds
    from saga.participants.sql._rows import BatchRows


class SqlSession:
    """What actions get as ``native``: the batch's connection, scoped to one step's effect.

    The first use of :attr:`connection` (or :meth:`execute`) opens a savepoint, the
    *effect scope*; the unit rolls back to it when the step is rejected and
    releases it before it writes the ledger. Custom handlers run every statement
    through this object, and may nest their own savepoints with
    ``session.connection.begin_nested()``; they must not commit or roll back the
    connection itself.

    ``rows`` (a batch without savepoints) is the batch's copy of the rows its
    built-in increments touch (:mod:`participants._sql_rows`). :attr:`holds` are the
    holds, reservations and bounds of the records (:mod:`participants.sql._holds`),
    set by the storage before the session is handed out.
    """

    holds: Holds

    def __init__(
        self,
        connection: Connection,
        tables: Mapping[str, Table],
        *,
        savepoints: bool = True,
        rows: BatchRows | None = None,
        holds: Holds | None = None,
    ) -> None:
        self._connection = connection
        self._tables = tables
        self.savepoints = savepoints
        self.rows = rows
        if holds is not None:
            self.holds = holds
        self._effect: NestedTransaction | None = None

    @property
    def connection(self) -> Connection:
        """The batch's connection; using it starts this step's effect scope."""
        if self._effect is None and self.savepoints:
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
            close_savepoint(self._connection, effect, keep=True)

    def undo_effect(self) -> None:
        """Roll back to the effect savepoint: every change since the scope opened is undone."""
        effect, self._effect = self._effect, None
        if effect is not None:
            close_savepoint(self._connection, effect, keep=False)


def close_savepoint(connection: Connection, savepoint: NestedTransaction, *, keep: bool) -> None:
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
