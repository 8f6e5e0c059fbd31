"""The SQL ledger: its table, the batch's view of it, and one item's unit.

One row per ``(participant, tx_id, step)``; the entry's fields are those of the
ledger codec (:mod:`participants._ledger`), plus ``participant`` and
``finished_ms``. The markers are rows with the reserved steps
:data:`~participants._ledger.MARKER_STEP` and :data:`~participants._ledger.SEEN_STEP`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Final, TypeAlias, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Connection,
    Engine,
    Index,
    Integer,
    MetaData,
    NestedTransaction,
    RowMapping,
    String,
    Table,
    Text,
    TextualSelect,
    and_,
    bindparam,
    case,
    insert,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy import exc as sa_exc

from saga.participants._barrier import LedgerEntry, LedgerStatus, finished_ms
from saga.participants._ledger import ENTRY_FIELDS, MARKER_STEP, entry_fields, entry_of
from saga.participants._storage import Unit
from saga.participants.sql._actions import NeedsSavepoints
from saga.participants.sql._errors import detail
from saga.participants.sql._mysql import TABLE_OPTIONS, is_mysql, upsert
from saga.participants.sql._rows import bulk_rows, bulk_statement, one_of
from saga.participants.sql._session import SqlSession, close_savepoint
from saga.streams import BusinessRejection, TransientError

if TYPE_CHECKING:  # psycopg is PostgreSQL's driver: SQLite runs without it
    import psycopg

# The table's name is quoted by the dialect; every value is bound, in the parameter
# style filled in: SQLAlchemy's (":tx_ids") or psycopg's ("%(tx_ids)s").
_KEYED_LOOKUP: Final = (
    "SELECT l.* FROM unnest(CAST({tx_ids} AS VARCHAR(128)[])) AS k(tx_id) "
    "CROSS JOIN LATERAL (SELECT * FROM {table} AS t WHERE t.participant = "
    "{participant} AND t.tx_id = k.tx_id FOR UPDATE) AS l ORDER BY l.tx_id, l.step"
)
"""The ledger lookup of :meth:`BatchLedger._keyed_lookup` and :meth:`BatchLedger.load_pipelined`."""

Loading: TypeAlias = Callable[[], None]
"""Reads a lookup sent in a pipeline into the ledger view (:meth:`BatchLedger.load_pipelined`)."""

FINAL_STATUSES: Final = (
    LedgerStatus.COMMITTED,
    LedgerStatus.COMPENSATED,
    LedgerStatus.FAILED,
    LedgerStatus.SEEN,
)
"""Statuses that :func:`participants._barrier.finished_ms` counts as final (for the upgrade)."""

ADDED_COLUMNS: Final = ("fingerprint", "finished_ms")
# The ledger table's first columns: the participant, then the entry's fields (the
# codec's), less the ones later versions added (created by an ALTER when missing).
LEDGER_COLUMNS: Final = (
    "participant",
    *(name for name in ENTRY_FIELDS if name not in ADDED_COLUMNS),
)
"""Columns added after the first layout; :meth:`SqlStorage.setup` adds them to an older ledger."""


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
        **TABLE_OPTIONS,
    )


class BatchLedger:
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

    def __init__(self, participant: str, table: Table, connection: Connection) -> None:
        self._participant = participant
        self._table = table
        self._connection = connection
        self._entries: dict[tuple[str, int], LedgerEntry | None] = {}
        self._existed: dict[tuple[str, int], bool] = {}
        self._loaded: set[str] = set()
        self._dirty: dict[tuple[str, int], LedgerEntry] = {}
        self._journal: list[tuple[tuple[str, int], LedgerEntry | None, LedgerEntry | None]] = []
        self._steps: dict[str, set[int]] = {}  # tx_id -> steps (markers too) in _entries

    def load(self, tx_ids: Iterable[str]) -> None:
        wanted = sorted(set(tx_ids) - self._loaded)
        if not wanted:
            return
        c = self._table.c
        pg = self._connection.dialect.name == "postgresql"
        for chunk in (wanted[i : i + 1000] for i in range(0, len(wanted), 1000)):
            query: Any = (
                self._keyed_lookup()
                if pg
                else select(self._table)
                .where(c.participant == self._participant, one_of(c.tx_id, chunk, postgresql=pg))
                .order_by(c.tx_id, c.step)
                .with_for_update()
            )
            params = {"participant": self._participant, "tx_ids": chunk} if pg else {}
            self._found(self._connection.execute(query, params).mappings())
            self._loaded.update(chunk)

    def load_pipelined(self, driver: psycopg.Connection[Any], tx_ids: Iterable[str]) -> Loading:
        """:meth:`load` on PostgreSQL, sent inside a pipeline (:func:`pipelined`): the
        lookup goes out with the statements before it, and the returned call, made
        after the pipeline, reads what it found into this view."""
        from psycopg.rows import dict_row

        wanted = sorted(set(tx_ids) - self._loaded)
        table = self._connection.dialect.identifier_preparer.format_table(self._table)
        cursors = []
        for chunk in (wanted[i : i + 1000] for i in range(0, len(wanted), 1000)):
            cursor = driver.cursor(row_factory=dict_row)
            cursor.execute(
                _KEYED_LOOKUP.format(
                    table=table, tx_ids="%(tx_ids)s", participant="%(participant)s"
                ),
                {"participant": self._participant, "tx_ids": chunk},
            )
            cursors.append((cursor, chunk))

        def read() -> None:
            for cursor, chunk in cursors:
                with cursor:
                    self._found(cursor.fetchall())
                self._loaded.update(chunk)

        return read

    def _found(self, rows: Iterable[Mapping[Any, Any]]) -> None:
        for row in rows:
            key = (row["tx_id"], row["step"])
            self._entries[key] = entry_of(row)
            self._existed[key] = True
            self._steps.setdefault(key[0], set()).add(key[1])

    def _keyed_lookup(self) -> TextualSelect:
        """PostgreSQL: the entries of ``:tx_ids``, each looked up by its primary key.

        ``participant = :p AND tx_id = ANY(:tx_ids)`` reads the same rows, but the
        planner chooses its plan on the table's statistics, and a ledger that grew
        since autovacuum last analysed it (a new one, in its first minute) looks
        small: it then scanned every entry of the participant through an index that
        leads with ``participant`` and filtered them, so a batch's cost grew with the
        ledger (found by the bench: a participant slowing down through a 60 s run).
        One lookup per key through ``LATERAL`` makes the primary key the cheaper
        plan once the table holds a few hundred entries, whatever the statistics say,
        provided the plan is chosen at each run: the batch's first statement forbids
        cached generic plans (:func:`participants._sql_errors.tx_locks`).
        """
        table = self._connection.dialect.identifier_preparer.format_table(self._table)
        sql = _KEYED_LOOKUP.format(table=table, tx_ids=":tx_ids", participant=":participant")
        return text(sql).columns(*self._table.c)

    def entry(self, tx_id: str, step: int) -> LedgerEntry | None:
        key = (tx_id, step)
        if key in self._entries:
            return self._entries[key]
        if tx_id in self._loaded:
            return None
        c = self._table.c
        query = (
            select(self._table)
            .where(c.participant == self._participant, c.tx_id == tx_id, c.step == step)
            .with_for_update()
        )
        row = self._connection.execute(query).mappings().first()
        found = None if row is None else entry_of_row(row)
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

    def stored(self, entry: LedgerEntry) -> None:
        """``entry`` as the batch's statements have written it already (not written again)."""
        key = (entry.tx_id, entry.step)
        self._entries[key] = entry
        self._existed[key] = True
        self._steps.setdefault(entry.tx_id, set()).add(entry.step)

    @property
    def table(self) -> Table:
        return self._table

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
        """Write the changed entries: new ones inserted, known ones updated (on PostgreSQL
        one statement each, the rows bound as one JSON text: :func:`bulk_statement`)."""
        name = self._participant
        if self._connection.dialect.name == "postgresql" and self._flush_arrays():
            return
        inserts = [row_of(name, e) for key, e in self._dirty.items() if not self._existed.get(key)]
        updates = [
            {f"v_{column}": value for column, value in row_of(name, e).items()}
            for key, e in self._dirty.items()
            if self._existed.get(key)
        ]
        if inserts:
            with self._collision():
                self._connection.execute(insert(self._table), inserts)
        if updates and is_mysql(self._connection.dialect):
            # One statement: every entry here exists and is locked (participants.sql._mysql).
            rows = [row_of(name, e) for key, e in self._dirty.items() if self._existed.get(key)]
            written = (*LEDGER_COLUMNS[3:], *ADDED_COLUMNS)
            self._connection.execute(upsert(self._table, written), rows)
        elif updates:
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
                        for column in (*LEDGER_COLUMNS[3:], *ADDED_COLUMNS)
                    }
                )
            )
            self._connection.execute(statement, updates)
        self._flushed()

    def _flushed(self) -> None:
        for key in self._dirty:
            self._existed[key] = True
        self._dirty.clear()
        self._journal.clear()

    def _flush_arrays(self) -> bool:
        """:meth:`flush` in two statements whatever the batch size; ``False`` when a column
        type cannot be named (then ``executemany`` does it)."""
        name = self._participant
        keys = LEDGER_COLUMNS[:3]
        columns = (*LEDGER_COLUMNS[3:], *ADDED_COLUMNS)
        dialect = self._connection.dialect
        fresh = bulk_statement(dialect, self._table, keys, columns, insert=True)
        known = bulk_statement(dialect, self._table, keys, columns, by_row_id=True)
        if fresh is None or known is None:
            return False
        inserts = [row_of(name, e) for key, e in self._dirty.items() if not self._existed.get(key)]
        updates = [row_of(name, e) for key, e in self._dirty.items() if self._existed.get(key)]
        if inserts:
            with self._collision():
                self._connection.execute(fresh, bulk_rows(inserts))
        if updates:
            self._connection.execute(known, bulk_rows(updates))
        self._flushed()
        return True

    @contextmanager
    def _collision(self) -> Iterator[None]:
        """An insert colliding with the primary key: another worker wrote the entry first."""
        try:
            yield
        except sa_exc.IntegrityError as exc:
            raise TransientError(
                f"participant {self._participant!r}: another worker recorded a step of this "
                f"batch ({detail(exc)}) at the same time; the batch will be retried"
            ) from exc


class SqlUnit(Unit[SqlSession]):
    """One work item's reads and writes of the ledger (through the batch's view).

    With ``savepoint`` (a careful batch) the item runs inside it: :meth:`finish`
    releases it, or, for a rejected confirmation, rolls it back and drops the
    item's ledger writes. Without (a batch of built-in steps only, see
    :meth:`participants._sql.SqlStorage.execute`) a rejection cannot be undone
    alone, so it runs the batch again carefully.
    """

    def __init__(
        self,
        ledger: BatchLedger,
        session: SqlSession,
        connection: Connection,
        savepoint: NestedTransaction | None = None,
    ) -> None:
        self.native = session
        self._ledger = ledger
        self._connection = connection
        self._savepoint = savepoint
        self._mark = ledger.checkpoint()

    def entry(self, tx_id: str, step: int) -> LedgerEntry | None:
        return self._ledger.entry(tx_id, step)

    def entries(self, tx_id: str) -> list[LedgerEntry]:
        return self._ledger.entries(tx_id)

    def tx_rolled_back(self, tx_id: str) -> bool:
        return self._ledger.entry(tx_id, MARKER_STEP) is not None

    def known_fingerprint(self, tx_id: str) -> str | None:
        return self._ledger.fingerprint(tx_id)

    def write(self, entry: LedgerEntry) -> None:
        # The effect (if any) is done: close its scope so that a later rollback_effect
        # in this unit (a decision covering several steps) cannot reach back into it.
        self.native.keep_effect()
        self._ledger.write(entry)

    def rollback_effect(self) -> None:
        self.native.undo_effect()

    def finish(self, error: BaseException | None) -> None:
        if self._savepoint is None:
            if isinstance(error, BusinessRejection):
                raise NeedsSavepoints from error
            return
        if error is None:
            self.native.keep_effect()
            close_savepoint(self._connection, self._savepoint, keep=True)
        elif isinstance(error, BusinessRejection):
            self.native.undo_effect()
            close_savepoint(self._connection, self._savepoint, keep=False)
            self._ledger.undo_to(self._mark)
        # Any other error rolls the whole batch back.


def row_of(participant: str, entry: LedgerEntry) -> dict[str, Any]:
    """The ledger row of ``entry`` (the codec's fields, the participant and when it finished)."""
    return {"participant": participant, **entry_fields(entry), "finished_ms": finished_ms(entry)}


def entry_of_row(row: RowMapping) -> LedgerEntry:
    """The entry a ledger row holds (a ledger from before fingerprints has no such column)."""
    return entry_of(cast(Mapping[str, Any], row))


def upgrade_ledger(engine: Engine, ledger: Table, added: Sequence[str], schema: str | None) -> None:
    """Give a ledger of the first layout the columns added since, and their index.

    Entries already there get their ``finished_ms`` (so they are pruned too) and
    no fingerprint (they match every request). Two participants may race to do
    this; the loser finds the columns there.
    """
    types = {"fingerprint": "VARCHAR(64)", "finished_ms": "BIGINT"}
    table = engine.dialect.identifier_preparer.format_table(ledger)
    try:
        with engine.begin() as connection:
            for name in added:
                connection.execute(text(f"ALTER TABLE {table} ADD COLUMN {name} {types[name]}"))
            if "finished_ms" in added:
                c = ledger.c
                final = [str(status) for status in FINAL_STATUSES]
                # as finished_ms(): an applied step not waiting to be compensated
                applied = and_(
                    c.status == str(LedgerStatus.APPLIED),
                    c.rollback_pending.is_(False),
                )
                latest = case((c.deadline_ms > c.updated_ms, c.deadline_ms), else_=c.updated_ms)
                connection.execute(
                    update(ledger)
                    .where(c.status.in_(final) | (c.step < 0) | applied)
                    .values(finished_ms=latest)
                )
            index = next(i for i in ledger.indexes if i.name and "finish" in i.name)
            index.create(connection, checkfirst=True)
    except (sa_exc.ProgrammingError, sa_exc.OperationalError):
        with engine.connect() as connection:
            columns = inspect(connection).get_columns(ledger.name, schema=schema)
        if not set(added) <= {column["name"] for column in columns}:
            raise
