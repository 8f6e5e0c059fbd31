"""Holds, reservations and recorded bounds: what isolation keeps beside the business rows.

One table per ledger, ``<ledger>_holds``, in the ledger's schema and database, so a
hold changes in the same local transaction as the ledger entry of its step (a
crash loses none and applies none twice). One row per::

    target   record  field    tx_id  step  kind     action     value
    accounts 7       ''       tx-1   0     hold     update     {"owner": "al"}
    accounts 7       balance  tx-2   1     reserve  increment  {"by": -5}
    accounts 7       balance  ''     -1    bounds   increment  {"min": 0, "max": null}

* ``hold``: saga ``tx_id``'s step ``step`` holds the record until its decision; the
  intended fields (``insert``/``put``/``update``; ``null`` for ``delete``) are kept
  here, not in the record;
* ``reserve``: an open escrow increment of ``field`` by ``value.by``;
* ``bounds``: the tightest ``min``/``max`` any bounded increment of ``field`` relied
  on (either level), kept for good, so a ``none`` compensation never leaves the
  field outside them.

Values are JSON as :func:`~participants.sql._values.to_json` writes them. Commit and
rollback remove a step's row; pruning the ledger never touches this table.

Who may read or change the rows of a record: a batch that holds the record's
business row locked (``SELECT ... FOR UPDATE``), or, when the row is absent, its
*record lock* (on PostgreSQL a transaction-scoped advisory lock keyed by the
record, :class:`RecordLocks`; SQLite has one writer at a time). A hold is read
after that lock is taken, so two workers never both pass a check on one record.

Two stores of the same rows: :class:`DirectHolds` runs a statement per call (a
careful batch, inside the step's savepoint); :class:`BatchHolds` reads the rows of
the batch's records once, keeps the changes in memory and writes them once before
the commit (a batch of built-in steps, see :mod:`participants.sql._rows`).
"""

from __future__ import annotations

import json
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from sqlalchemy import (
    ARRAY,
    JSON,
    Column,
    Connection,
    CursorResult,
    Executable,
    Integer,
    MetaData,
    String,
    Table,
    and_,
    delete,
    func,
    insert,
    literal,
    or_,
    select,
)

from saga.participants.sql._mysql import TABLE_OPTIONS, record_locks
from saga.participants.sql._rows import bulk_delete, bulk_rows, bulk_statement, one_of

if TYPE_CHECKING:  # psycopg is PostgreSQL's driver: SQLite runs without it
    import psycopg

HOLD: Final = "hold"
RESERVE: Final = "reserve"
BOUNDS: Final = "bounds"

HOLDS_LOOKUP: Final = (
    "SELECT h.* FROM unnest(CAST({targets} AS text[]), CAST({records} AS text[])) "
    "AS k(target, record) CROSS JOIN LATERAL (SELECT * FROM {table} AS r "
    "WHERE r.target = k.target AND r.record = k.record OFFSET 0) AS h"
)
"""The rows of some records (PostgreSQL, :meth:`BatchHolds.load_pipelined`): one
primary-key lookup per record. ``OFFSET 0`` keeps it from being flattened into a join
of the whole table, which the planner ran as a scan of every row: its cost grew with
the ``bounds`` rows, one per record ever bounded. The table's name is quoted by the
dialect; the values are bound."""

HoldKey: TypeAlias = tuple[str, str, str, str, int]
"""``(target, record, field, tx_id, step)``: the primary key of a row."""
Record: TypeAlias = tuple[str, str]
"""``(target, record)``: a business record as the holds table names it."""
Execute: TypeAlias = Callable[[Executable], CursorResult[Any]]

_KEYS: Final = ("target", "record", "field", "tx_id", "step")
_COLUMNS: Final = ("kind", "action", "value")
_CHUNK: Final = 500


def define_holds(metadata: MetaData, ledger: str) -> Table:
    """The holds table of ledger ``ledger`` (``<ledger>_holds``) in ``metadata``."""
    return Table(
        f"{ledger}_holds",
        metadata,
        Column("target", String(63), primary_key=True),
        Column("record", String(300), primary_key=True),
        Column("field", String(63), primary_key=True),
        Column("tx_id", String(128), primary_key=True),
        Column("step", Integer, primary_key=True, autoincrement=False),
        Column("kind", String(16), nullable=False),
        Column("action", String(16)),
        Column("value", JSON(none_as_null=True)),
        **TABLE_OPTIONS,
    )


HOLDS_COLUMNS: Final = (*_KEYS, *_COLUMNS)


@dataclass(frozen=True, slots=True)
class Hold:
    """One row of the holds table (see the module doc)."""

    target: str
    record: str
    field: str
    tx_id: str
    step: int
    kind: str
    action: str | None = None
    value: Any = None

    @property
    def key(self) -> HoldKey:
        return (self.target, self.record, self.field, self.tx_id, self.step)

    def row(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "record": self.record,
            "field": self.field,
            "tx_id": self.tx_id,
            "step": self.step,
            "kind": self.kind,
            "action": self.action,
            "value": self.value,
        }


def hold_of(row: Mapping[Any, Any]) -> Hold:
    value = row["value"]
    if isinstance(value, str):  # a driver that hands JSON back as text
        value = json.loads(value)
    return Hold(
        row["target"],
        row["record"],
        row["field"],
        row["tx_id"],
        row["step"],
        row["kind"],
        row["action"],
        value,
    )


def bounds_key(target: str, record: str, field: str) -> HoldKey:
    return (target, record, field, "", -1)


class RecordLocks:
    """The record locks of one batch's transaction (PostgreSQL advisory locks; on MySQL
    and MariaDB the lock rows ``rows``, :mod:`participants.sql._mysql`; nothing on SQLite,
    which lets one writer at a time). Keyed by the holds table and the record; held
    until the transaction ends. ``taken``: the locks taken at the batch's top level
    (never inside a savepoint, which would release them on a rollback)."""

    def __init__(
        self, connection: Connection, table: Table, *, postgresql: bool, rows: Table | None = None
    ) -> None:
        self._connection = connection
        self.postgresql = postgresql
        self._rows = rows
        name = connection.dialect.identifier_preparer.format_table(table)
        self._owner = _int32(zlib.crc32(f"saga holds {name}".encode()))
        self.taken: set[int] = set()

    def _key(self, record: Record) -> int:
        return _int32(zlib.crc32(f"{record[0]}/{record[1]}".encode()))

    def take(self, records: Iterable[Record]) -> None:
        """Lock ``records`` at the batch's top level: one statement, in ascending order,
        so two batches taking theirs this way never deadlock."""
        if not self.postgresql and self._rows is None:
            return
        keys = sorted({self._key(r) for r in records} - self.taken)
        if keys:
            self._connection.execute(self._statement(keys))
            self.taken.update(keys)

    def take_one(self, record: Record, execute: Execute, *, top_level: bool) -> bool:
        """Lock one record through ``execute``; ``True`` when it was not locked before
        (the caller reads the record again: another batch may have changed it while
        this one waited). ``top_level``: not inside a savepoint, so it is remembered."""
        if not self.postgresql and self._rows is None:
            return False
        key = self._key(record)
        if key in self.taken:
            return False
        execute(self._statement([key]))
        if top_level:
            self.taken.add(key)
        return True

    def _statement(self, keys: list[int]) -> Executable:
        if self._rows is not None:
            return record_locks(self._rows, keys)
        return _lock_statement(self._owner, keys)


def _lock_statement(owner: int, keys: list[int]) -> Executable:
    ordered = select(func.unnest(literal(keys, ARRAY(Integer))).label("k")).order_by("k").subquery()
    return select(func.count(func.pg_advisory_xact_lock(owner, ordered.c.k)))


def _int32(value: int) -> int:
    return value - 2**32 if value >= 2**31 else value


class Holds(ABC):
    """The holds table as one batch's steps see it (see the module doc)."""

    def __init__(self, table: Table, locks: RecordLocks) -> None:
        self.table = table
        self.locks = locks

    @abstractmethod
    def of(self, record: Record) -> list[Hold]:
        """Every row of ``record`` (holds, reservations, bounds), by ``(tx_id, step)``."""

    @abstractmethod
    def add(self, hold: Hold) -> None:
        """Write ``hold``, replacing a row with the same key (bounds are replaced)."""

    @abstractmethod
    def drop(self, key: HoldKey) -> bool:
        """Remove the row of ``key``; whether it was there."""

    @abstractmethod
    def lock_absent(self, record: Record) -> bool:
        """Take ``record``'s record lock (its business row is absent); ``True`` when the
        caller must read the row again (its rows here are read again already)."""


class DirectHolds(Holds):
    """A statement per call, through ``execute`` (the step's effect savepoint)."""

    def __init__(self, table: Table, locks: RecordLocks, execute: Execute) -> None:
        super().__init__(table, locks)
        self._execute = execute

    def of(self, record: Record) -> list[Hold]:
        c = self.table.c
        query = (
            select(self.table)
            .where(c.target == record[0], c.record == record[1])
            .order_by(c.tx_id, c.step, c.field)
        )
        return [hold_of(row) for row in self._execute(query).mappings()]

    def add(self, hold: Hold) -> None:
        if hold.kind == BOUNDS:
            self.drop(hold.key)
        self._execute(insert(self.table).values(hold.row()))

    def drop(self, key: HoldKey) -> bool:
        statement = delete(self.table).where(_match(self.table, key))
        return bool(self._execute(statement).rowcount)

    def lock_absent(self, record: Record) -> bool:
        return self.locks.take_one(record, self._execute, top_level=False)


class BatchHolds(Holds):
    """The rows of the batch's records, read once, changed in memory, written by
    :meth:`flush` (a delete and an insert statement) before the commit."""

    def __init__(self, connection: Connection, table: Table, locks: RecordLocks) -> None:
        super().__init__(table, locks)
        self._connection = connection
        self._view: dict[Record, dict[HoldKey, Hold]] = {}  # as the batch has left them
        self._stored: set[HoldKey] = set()  # rows read from the table
        self._added: dict[HoldKey, Hold] = {}
        self._dropped: set[HoldKey] = set()

    def preload(self, records: Iterable[Record]) -> None:
        """Read the rows of ``records`` (after their rows or record locks are taken)."""
        wanted = sorted(set(records) - set(self._view))
        for start in range(0, len(wanted), _CHUNK):
            self._read(wanted[start : start + _CHUNK])

    def load_pipelined(
        self, driver: psycopg.Connection[Any], records: Iterable[Record]
    ) -> Callable[[], None]:
        """:meth:`preload` on PostgreSQL, sent inside a pipeline (after the statements that
        lock the records' rows, which the server runs first); the returned call, made
        after the pipeline, reads what it found."""
        from psycopg.rows import dict_row

        wanted = sorted(set(records) - set(self._view))
        table = self._connection.dialect.identifier_preparer.format_table(self.table)
        cursor = driver.cursor(row_factory=dict_row)
        cursor.execute(
            HOLDS_LOOKUP.format(table=table, targets="%(targets)s", records="%(records)s"),
            {"targets": [r[0] for r in wanted], "records": [r[1] for r in wanted]},
        )

        def read() -> None:
            with cursor:
                found = cursor.fetchall()
            self._fill(wanted, found)

        return read

    def _read(self, records: list[Record]) -> None:
        c = self.table.c
        by_target: dict[str, list[str]] = {}
        for target, record in records:
            by_target.setdefault(target, []).append(record)
        pg = self.locks.postgresql
        match = or_(
            *(
                and_(c.target == target, one_of(c.record, keys, postgresql=pg))
                for target, keys in sorted(by_target.items())
            )
        )
        self._fill(records, self._connection.execute(select(self.table).where(match)).mappings())

    def _fill(self, records: Iterable[Record], rows: Iterable[Mapping[Any, Any]]) -> None:
        """The records' rows as read, with this batch's own changes applied."""
        fresh: dict[Record, dict[HoldKey, Hold]] = {each: {} for each in records}
        for row in rows:
            hold = hold_of(row)
            self._stored.add(hold.key)
            if hold.key not in self._dropped:
                fresh.setdefault((hold.target, hold.record), {})[hold.key] = hold
        for key, hold in self._added.items():
            if key[:2] in fresh:
                fresh[key[:2]][key] = hold
        self._view.update(fresh)

    def of(self, record: Record) -> list[Hold]:
        if record not in self._view:
            self._read([record])
        return sorted(self._view[record].values(), key=lambda h: (h.tx_id, h.step, h.field))

    def add(self, hold: Hold) -> None:
        key = hold.key
        if key[:2] not in self._view:
            self._read([key[:2]])
        if key in self._stored:
            self._dropped.add(key)  # replaced: the old row goes first
        self._view[key[:2]][key] = hold
        self._added[key] = hold

    def drop(self, key: HoldKey) -> bool:
        record = (key[0], key[1])
        if record not in self._view:
            self._read([record])
        if self._view[record].pop(key, None) is None:
            return False
        self._added.pop(key, None)
        if key in self._stored:
            self._dropped.add(key)
        return True

    def lock_absent(self, record: Record) -> bool:
        if not self.locks.take_one(record, self._connection.execute, top_level=True):
            return False
        self._read([record])
        return True

    def flush(self) -> None:
        """Write the changes: removed rows deleted, then new ones inserted."""
        dropped, added = sorted(self._dropped), list(self._added.values())
        self._dropped, self._added = set(), {}
        dialect = self._connection.dialect
        if dropped:
            rows = [dict(zip(_KEYS, key, strict=True)) for key in dropped]
            bulk = bulk_delete(dialect, self.table, _KEYS) if self.locks.postgresql else None
            if bulk is not None:
                self._connection.execute(bulk, bulk_rows(rows))
            else:
                for start in range(0, len(dropped), _CHUNK):
                    chunk = dropped[start : start + _CHUNK]
                    matches = or_(*(_match(self.table, key) for key in chunk))
                    self._connection.execute(delete(self.table).where(matches))
        if added:
            rows = [hold.row() for hold in added]
            fresh = (
                bulk_statement(dialect, self.table, _KEYS, _COLUMNS, insert=True)
                if self.locks.postgresql
                else None
            )
            if fresh is not None:
                self._connection.execute(fresh, bulk_rows(rows))
            else:
                self._connection.execute(insert(self.table), rows)


def _match(table: Table, key: HoldKey) -> Any:
    c = table.c
    return and_(*(c[name] == value for name, value in zip(_KEYS, key, strict=True)))
