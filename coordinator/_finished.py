"""Finished sagas on disk: what the coordinator remembers of a saga that has ended.

A saga that ended ``committed`` or ``rolled_back`` changes no more, yet the coordinator
must know it until its retention ends (seven days by default): a repeated request is
recognised (nothing new happens), a conflicting one is dead-lettered, late events,
aborts and resolves are ignored or reported, a forged status is covered again, and the
saga gets its tombstone when it is forgotten. Kept as objects, that cost about 1.3 KB of
heap per saga for the whole retention (docs/memory.md); here each one is a row of a
SQLite database instead, so the heap holds only the sagas in flight.

The database is private to the process and temporary: SQLite makes it in its temporary
directory (``SQLITE_TMPDIR``, else ``TMPDIR``, else ``/var/tmp`` or ``/tmp``) and unlinks
the file at once, so nothing is left behind, even by ``kill -9``. It is a cache of the
status topic, rebuilt by every restore (:mod:`coordinator._restore`): no journal, no
sync. What it costs in memory is SQLite's page cache, at most :data:`CACHE_KIB`,
whatever the number of sagas; on disk, about 300 bytes per finished saga.

One :class:`FinishedStore` per coordinator holds one :class:`FinishedTable` per owned
partition (dropped with the partition). Used from the service's thread only.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final

import orjson

from saga.coordinator._machine import Saga
from saga.streams import ConfigurationError, SagaState, StepStatus

__all__ = ["CACHE_KIB", "FINISHED", "FinishedLoader", "FinishedStore", "FinishedTable"]

CACHE_KIB: Final = 32 * 1024
"""SQLite's page cache for all partitions (KiB): the store's whole share of memory."""

FINISHED: Final = frozenset({SagaState.COMMITTED, SagaState.ROLLED_BACK})
"""The states of a saga that goes to disk once its request was seen."""


def _failed(exc: sqlite3.Error) -> ConfigurationError:
    return ConfigurationError(
        f"the coordinator could not use its store of finished sagas ({exc}); free space in "
        "SQLite's temporary directory, or point SQLITE_TMPDIR at a larger disk"
    )


def pack(saga: Saga) -> str:
    """The row form of a finished saga (only this module reads it)."""
    # As text: orjson's bytes keep the 4 KiB buffer they were written in, and a restore
    # holds thousands of rows before it writes them.
    return orjson.dumps(
        [
            saga.saga,
            saga.participants,
            [s.value for s in saga.steps],
            [saga.confirm_of(i) for i in range(len(saga.steps))],
            saga.reason,
            saga.created_ms,
            saga.updated_ms,
            saga.deadline_ms,
            saga.fingerprint,
        ]
    ).decode()


def unpack(tx_id: str, state: str, row: str) -> Saga:
    """The saga :func:`pack` wrote (its state kept apart, in its own column)."""
    name, participants, steps, confirms, reason, created, updated, deadline, fingerprint = (
        orjson.loads(row)
    )
    return Saga.ended(
        tx_id=tx_id,
        saga=name,
        state=SagaState(state),
        participants=tuple(participants),
        steps=tuple(StepStatus(s) for s in steps),
        confirms=tuple(confirms),
        reason=reason,
        created_ms=created,
        updated_ms=updated,
        deadline_ms=deadline,
        fingerprint=fingerprint,
    )


class FinishedStore:
    """One private, temporary SQLite database: the finished sagas of every owned partition."""

    def __init__(self) -> None:
        try:
            self._db = sqlite3.connect("", isolation_level=None, check_same_thread=False)
            for pragma in ("journal_mode=OFF", "synchronous=OFF", f"cache_size=-{CACHE_KIB}"):
                self._db.execute(f"PRAGMA {pragma}")
        except sqlite3.Error as exc:
            raise _failed(exc) from exc
        self._depth = 0

    @contextmanager
    def writing(self) -> Iterator[None]:
        """One SQLite transaction around the changes made inside (re-entrant)."""
        if self._depth == 0:
            self.execute("BEGIN")
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.execute("COMMIT")

    def execute(self, sql: str, args: Sequence[Any] = (), *, table: str = "") -> sqlite3.Cursor:
        """Run ``sql``, its ``{t}`` naming ``table`` (a name this module made, never input)."""
        try:
            return self._db.execute(sql.replace("{t}", table), args)
        except sqlite3.Error as exc:
            raise _failed(exc) from exc

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]], *, table: str) -> None:
        try:
            self._db.executemany(sql.replace("{t}", table), rows)
        except sqlite3.Error as exc:
            raise _failed(exc) from exc

    def table(self, partition: int) -> FinishedTable:
        """An empty table for ``partition`` (one left from an earlier assignment is dropped)."""
        return FinishedTable(self, partition)

    def close(self) -> None:
        self._db.close()


_CREATE = (
    "CREATE TABLE {t} (tx_id TEXT PRIMARY KEY, forget_at INTEGER NOT NULL, "
    "state TEXT NOT NULL, saga TEXT NOT NULL) WITHOUT ROWID"
)
_INDEX = "CREATE INDEX {t}_forget ON {t} (forget_at)"


class FinishedTable:
    """The finished sagas of one partition: ``tx_id`` -> saga and when to forget it."""

    def __init__(self, store: FinishedStore, partition: int) -> None:
        self.store = store
        self.name = f"finished_{int(partition)}"
        self.counts: Counter[str] = Counter()
        """Rows per state (``committed``, ``rolled_back``)."""
        self._next: int | None = None
        self._next_known = True
        self._sql("DROP TABLE IF EXISTS {t}")
        self._sql(_CREATE)
        self._sql(_INDEX)

    def _sql(self, sql: str, *args: Any) -> sqlite3.Cursor:
        return self.store.execute(sql, args, table=self.name)

    @classmethod
    def private(cls) -> FinishedTable:
        """A table in a store of its own (a partition state made by hand, in tests)."""
        return cls(FinishedStore(), 0)

    def __len__(self) -> int:
        return sum(self.counts.values())

    def __contains__(self, tx_id: object) -> bool:
        return self._sql("SELECT 1 FROM {t} WHERE tx_id = ?", tx_id).fetchone() is not None

    def get(self, tx_id: str) -> Saga | None:
        row = self._sql("SELECT state, saga FROM {t} WHERE tx_id = ?", tx_id).fetchone()
        return None if row is None else unpack(tx_id, row[0], row[1])

    def put(self, saga: Saga, forget_at: int) -> None:
        """Keep ``saga`` (finished) until ``forget_at``; replaces what the table had of it."""
        old = self._sql("SELECT state FROM {t} WHERE tx_id = ?", saga.tx_id).fetchone()
        if old is not None:
            self.counts[old[0]] -= 1
        self._sql(
            "INSERT OR REPLACE INTO {t} VALUES (?, ?, ?, ?)",
            saga.tx_id,
            forget_at,
            saga.state.value,
            pack(saga),
        )
        self.counts[saga.state.value] += 1
        if self._next_known and (self._next is None or forget_at < self._next):
            self._next = forget_at

    def remove(self, tx_id: str) -> None:
        gone = self._sql("DELETE FROM {t} WHERE tx_id = ? RETURNING state", tx_id).fetchone()
        if gone is not None:
            self.counts[gone[0]] -= 1
            self._next_known = False

    def due(self, now: int, limit: int) -> list[tuple[int, str]]:
        """Up to ``limit`` ``(forget_at, tx_id)`` with ``forget_at <= now``, soonest first."""
        return self._sql(
            "SELECT forget_at, tx_id FROM {t} WHERE forget_at <= ? ORDER BY forget_at LIMIT ?",
            now,
            limit,
        ).fetchall()

    def next_due(self) -> int | None:
        """When the first saga of the table may be forgotten (None: the table is empty)."""
        if not self._next_known:
            self._next = self._sql("SELECT MIN(forget_at) FROM {t}").fetchone()[0]
            self._next_known = True
        return self._next

    def loader(self) -> FinishedLoader:
        """Fills the (empty) table in bulk, for a restore."""
        return FinishedLoader(self)

    def _loaded(self) -> None:
        self.counts = Counter(dict(self._sql("SELECT state, COUNT(*) FROM {t} GROUP BY state")))
        self._next_known = False

    def drop(self) -> None:
        """Delete the table (its partition was revoked)."""
        self._sql("DROP TABLE IF EXISTS {t}")
        self.counts.clear()
        self._next, self._next_known = None, True


class FinishedLoader:
    """Bulk-loads a restore into an empty :class:`FinishedTable`, in the order read.

    Rows are appended to a staging table as they come (a random insert into a large
    B-tree costs a disk page), then moved in ``tx_id`` order by :meth:`finish`: the last
    row of a ``tx_id`` stands, and if it is a :meth:`gone` row the saga is not kept.
    """

    _BATCH = 5000

    def __init__(self, table: FinishedTable) -> None:
        self._table = table
        self._stage = f"{table.name}_stage"
        self._seq = 0
        self._rows: list[tuple[int, str, int | None, str | None, str | None]] = []
        self._sql("DROP TABLE IF EXISTS {t}")
        self._sql(
            "CREATE TABLE {t} (seq INTEGER PRIMARY KEY, tx_id TEXT NOT NULL, "
            "forget_at INTEGER, state TEXT, saga TEXT)"
        )
        # Made again at the end, in one sorted pass, rather than row by row.
        table._sql("DROP INDEX IF EXISTS {t}_forget")

    def _sql(self, sql: str) -> None:
        self._table.store.execute(sql, table=self._stage)

    def finished(self, saga: Saga, forget_at: int) -> None:
        """``saga`` stands (finished) unless a later row says otherwise."""
        self._add(saga.tx_id, forget_at, saga.state.value, pack(saga))

    def gone(self, tx_id: str) -> None:
        """``tx_id`` is not finished (forgotten, or in flight) unless a later row says so."""
        self._add(tx_id, None, None, None)

    def _add(self, tx_id: str, at: int | None, state: str | None, row: str | None) -> None:
        self._seq += 1
        self._rows.append((self._seq, tx_id, at, state, row))
        if len(self._rows) >= self._BATCH:
            self.flush()

    def flush(self) -> None:
        if self._rows:
            store = self._table.store
            with store.writing():
                store.executemany(
                    "INSERT INTO {t} VALUES (?, ?, ?, ?, ?)", self._rows, table=self._stage
                )
            self._rows = []

    def finish(self) -> None:
        """Move the staged rows into the table: the last of each ``tx_id`` stands."""
        self.flush()
        store = self._table.store
        with store.writing():
            moved = (
                "INSERT INTO {t} SELECT tx_id, forget_at, state, saga FROM (SELECT *, "
                "ROW_NUMBER() OVER (PARTITION BY tx_id ORDER BY seq DESC) AS newest "
                "FROM {t}_stage) WHERE newest = 1 AND state IS NOT NULL ORDER BY tx_id"
            )
            self._table._sql(moved)
            self._sql("DROP TABLE {t}")
            self._table._sql(_INDEX)
        self._table._loaded()
