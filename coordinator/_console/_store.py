"""The console's tables: the materialised status view, its offsets, the DLQ and the audit trail.

One :class:`ViewStore` over one DB-API connection guarded by a lock (the HTTP
threads read while the follower writes): the standard library's ``sqlite3`` by
default, ``psycopg`` when the URL is ``postgresql://...`` (imported only then; the
core may not import SQLAlchemy, see tests/unit/test_layering.py, and needs none for
five tables). The SQL is written once, with ``?`` placeholders and an upsert both
servers understand (``INSERT ... ON CONFLICT ... DO UPDATE``).

Tables:

* ``sagas(tx_id PK, saga, state, reason, created_ms, updated_ms, deadline_ms,
  steps_json, participants)``: the latest standing status per transaction;
  ``participants`` is ``,a,b,`` so that one ``LIKE '%,a,%'`` finds a participant's;
* ``console_offsets(topic, part, next_offset)``: where the follower resumes. It is
  written in the same database transaction as the rows a batch changed
  (:meth:`ViewStore.apply`), so after a crash the view and its offsets agree;
* ``console_dlq``: the dead letters (headers and an excerpt of the bytes), the
  newest :data:`DLQ_ROWS_KEPT`;
* ``console_audit``: what operators did through the console, and who.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from saga.streams import ConfigurationError, SagaState, SagaStatus
from saga.streams._secrets import redact

DLQ_ROWS_KEPT = 10_000
"""How many dead letters the console keeps (the newest); Kafka's retention keeps the rest."""

MAX_ROWS = 500
"""The most rows one listing returns (the UI pages with a search, not by scrolling)."""

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS sagas ("
    " tx_id TEXT PRIMARY KEY, saga TEXT NOT NULL, state TEXT NOT NULL, reason TEXT,"
    " created_ms BIGINT NOT NULL, updated_ms BIGINT NOT NULL, deadline_ms BIGINT NOT NULL,"
    " steps_json TEXT NOT NULL, participants TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS sagas_updated ON sagas (updated_ms)",
    "CREATE INDEX IF NOT EXISTS sagas_state ON sagas (state, updated_ms)",
    "CREATE TABLE IF NOT EXISTS console_offsets ("
    " topic TEXT NOT NULL, part INTEGER NOT NULL, next_offset BIGINT NOT NULL,"
    " PRIMARY KEY (topic, part))",
    "CREATE TABLE IF NOT EXISTS console_dlq ("
    " part INTEGER NOT NULL, record_offset BIGINT NOT NULL, tx_id TEXT, error TEXT NOT NULL,"
    " source_topic TEXT, source_partition INTEGER, source_offset BIGINT, at_ms BIGINT,"
    " size BIGINT NOT NULL, excerpt TEXT NOT NULL, PRIMARY KEY (part, record_offset))",
    "CREATE TABLE IF NOT EXISTS console_audit ("
    " at_ms BIGINT NOT NULL, operator TEXT NOT NULL, action TEXT NOT NULL, tx_id TEXT,"
    " detail TEXT NOT NULL, outcome TEXT NOT NULL)",
)

_SAGA_COLUMNS = (
    "tx_id, saga, state, reason, created_ms, updated_ms, deadline_ms, steps_json, participants"
)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One record of the DLQ topic, as the console lists it."""

    partition: int
    offset: int
    tx_id: str | None
    error: str
    source_topic: str | None
    source_partition: int | None
    source_offset: int | None
    at_ms: int | None
    size: int
    excerpt: str


class _Connection(Protocol):
    """The part of a DB-API 2.0 connection the store uses."""

    def cursor(self) -> Any: ...

    def commit(self) -> None: ...

    def rollback(self) -> None: ...

    def close(self) -> None: ...


def saga_row(status: SagaStatus) -> tuple[Any, ...]:
    """The ``sagas`` row of ``status``, in :data:`_SAGA_COLUMNS` order."""
    steps = [{"participant": s.participant, "status": s.status.value} for s in status.steps]
    names = sorted({s.participant for s in status.steps})
    return (
        status.tx_id,
        status.saga,
        status.state.value,
        status.reason,
        status.created_ms,
        status.updated_ms,
        status.deadline_ms,
        json.dumps(steps),
        "," + ",".join(names) + ",",
    )


def _like_prefix(text: str) -> str:
    """``text`` as a LIKE prefix pattern with its wildcards escaped (ESCAPE '!')."""
    return text.replace("!", "!!").replace("%", "!%").replace("_", "!_") + "%"


class ViewStore:
    """The console's database. Thread-safe: every call holds one lock.

    ``url`` is ``sqlite:///path``, ``sqlite:///:memory:`` (or ``:memory:``) or
    ``postgresql://user:password@host/db`` (``postgresql+psycopg://`` too). A URL that
    cannot be opened raises :class:`ConfigurationError` with the password redacted.
    """

    def __init__(self, url: str) -> None:
        self._url = url
        self._lock = threading.RLock()
        self._postgres = url.startswith(("postgresql:", "postgresql+psycopg:", "postgres:"))
        self._conn = self._connect()
        with self._transaction() as cur:
            for statement in _SCHEMA:
                cur.execute(statement)

    @property
    def kind(self) -> str:
        """``postgresql`` or ``sqlite``."""
        return "postgresql" if self._postgres else "sqlite"

    def _connect(self) -> _Connection:
        if self._postgres:
            try:
                import psycopg
            except ImportError as exc:
                raise ConfigurationError(
                    "a PostgreSQL console database needs psycopg: pip install 'saga-olep[postgres]'"
                ) from exc
            dsn = "postgresql:" + self._url.split(":", 1)[1]
            try:
                return psycopg.connect(dsn, connect_timeout=10)
            except psycopg.Error as exc:
                raise ConfigurationError(
                    f"cannot open the console database {redact(self._url)}: "
                    f"{' '.join(redact(str(exc)).split())}; check the URL and that the server runs"
                ) from None
        path = self._url
        if path.startswith("sqlite:///"):
            path = path[len("sqlite:///") :]
        elif path.startswith("sqlite://"):
            path = path[len("sqlite://") :] or ":memory:"
        try:
            # One connection shared by the follower and the HTTP threads, under the lock.
            conn = sqlite3.connect(
                path or ":memory:", check_same_thread=False, isolation_level=None
            )
        except sqlite3.Error as exc:
            raise ConfigurationError(
                f"cannot open the console database {path}: {exc}; give a writable file with "
                "--db sqlite:///path/console.db"
            ) from None
        conn.execute("PRAGMA journal_mode=WAL")
        return _SqliteAdapter(conn)

    def reconnect(self) -> None:
        """Open the connection again (after the server went away)."""
        with self._lock:
            # A broken connection may fail to close; it is replaced either way.
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = self._connect()

    def _sql(self, statement: str) -> str:
        return statement.replace("?", "%s") if self._postgres else statement

    @contextmanager
    def _transaction(self) -> Iterator[_Cursor]:
        with self._lock:
            cur = _Cursor(self._conn.cursor(), self._sql)
            try:
                if not self._postgres:
                    cur.execute("BEGIN")
                yield cur
                self._conn.commit()
            except BaseException:
                self._conn.rollback()
                raise
            finally:
                cur.close()

    # ------------------------------------------------------------------ the follower's side

    def offsets(self, topics: Sequence[str]) -> dict[tuple[str, int], int]:
        """The stored resume offsets of ``topics``: ``{(topic, partition): next_offset}``."""
        with self._transaction() as cur:
            found: dict[tuple[str, int], int] = {}
            for topic in topics:
                cur.execute(
                    "SELECT part, next_offset FROM console_offsets WHERE topic = ?", (topic,)
                )
                for part, offset in cur.fetchall():
                    found[(topic, int(part))] = int(offset)
            return found

    def apply(
        self,
        upserts: Sequence[SagaStatus],
        deletes: Sequence[str],
        dead_letters: Sequence[DeadLetter],
        offsets: Mapping[tuple[str, int], int],
    ) -> None:
        """Write one batch and the offsets after it in one database transaction."""
        with self._transaction() as cur:
            for tx_id in deletes:
                cur.execute("DELETE FROM sagas WHERE tx_id = ?", (tx_id,))
            for status in upserts:
                cur.execute(
                    f"INSERT INTO sagas ({_SAGA_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "  # noqa: S608
                    "ON CONFLICT (tx_id) DO UPDATE SET saga = excluded.saga, "
                    "state = excluded.state, reason = excluded.reason, "
                    "created_ms = excluded.created_ms, updated_ms = excluded.updated_ms, "
                    "deadline_ms = excluded.deadline_ms, steps_json = excluded.steps_json, "
                    "participants = excluded.participants",
                    saga_row(status),
                )
            for d in dead_letters:
                cur.execute(
                    "INSERT INTO console_dlq (part, record_offset, tx_id, error, source_topic, "
                    "source_partition, source_offset, at_ms, size, excerpt) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (part, record_offset) DO NOTHING",
                    (
                        d.partition,
                        d.offset,
                        d.tx_id,
                        d.error,
                        d.source_topic,
                        d.source_partition,
                        d.source_offset,
                        d.at_ms,
                        d.size,
                        d.excerpt,
                    ),
                )
            if dead_letters:
                cur.execute("SELECT COUNT(*) FROM console_dlq")
                if int(cur.fetchone()[0]) > DLQ_ROWS_KEPT:
                    cur.execute(
                        "DELETE FROM console_dlq WHERE at_ms < (SELECT MIN(at_ms) FROM "
                        "(SELECT at_ms FROM console_dlq ORDER BY at_ms DESC LIMIT ?) newest)",
                        (DLQ_ROWS_KEPT,),
                    )
            for (topic, part), offset in offsets.items():
                cur.execute(
                    "INSERT INTO console_offsets (topic, part, next_offset) VALUES (?, ?, ?) "
                    "ON CONFLICT (topic, part) DO UPDATE SET next_offset = excluded.next_offset",
                    (topic, part, offset),
                )

    def reset(self, topics: Sequence[str]) -> None:
        """Forget the view and the offsets of ``topics`` (the topics were made anew)."""
        with self._transaction() as cur:
            cur.execute("DELETE FROM sagas")
            cur.execute("DELETE FROM console_dlq")
            for topic in topics:
                cur.execute("DELETE FROM console_offsets WHERE topic = ?", (topic,))

    # ------------------------------------------------------------------ the API's side

    def sagas(
        self,
        *,
        q: str = "",
        state: str = "",
        participant: str = "",
        limit: int = 200,
    ) -> list[dict[str, Any]]:
        """The newest rows (by ``updated_ms``) whose tx_id starts with ``q`` or whose saga
        name starts with ``q``, in ``state`` and naming ``participant`` when given."""
        where: list[str] = []
        params: list[Any] = []
        if q:
            where.append("(tx_id LIKE ? ESCAPE '!' OR saga LIKE ? ESCAPE '!')")
            params += [_like_prefix(q), _like_prefix(q)]
        if state:
            where.append("state = ?")
            params.append(state)
        if participant:
            where.append("participants LIKE ? ESCAPE '!'")
            params.append("%," + _like_prefix(participant)[:-1] + ",%")
        clause = (" WHERE " + " AND ".join(where)) if where else ""
        params.append(max(1, min(limit, MAX_ROWS)))
        with self._transaction() as cur:
            cur.execute(
                f"SELECT {_SAGA_COLUMNS} FROM sagas{clause} "  # noqa: S608 - values are parameters
                "ORDER BY updated_ms DESC, tx_id LIMIT ?",
                tuple(params),
            )
            return [_saga_dict(r) for r in cur.fetchall()]

    def saga(self, tx_id: str) -> dict[str, Any] | None:
        with self._transaction() as cur:
            statement = f"SELECT {_SAGA_COLUMNS} FROM sagas WHERE tx_id = ?"  # noqa: S608
            cur.execute(statement, (tx_id,))
            row = cur.fetchone()
            return _saga_dict(row) if row is not None else None

    def metrics(self, now_ms: int) -> dict[str, Any]:
        """Counts by state, sagas decided or finished in the last minute, DLQ size."""
        with self._transaction() as cur:
            cur.execute("SELECT state, COUNT(*) FROM sagas GROUP BY state")
            counts = {s.value: 0 for s in SagaState}
            for state, n in cur.fetchall():
                counts[str(state)] = int(n)
            cur.execute(
                "SELECT COUNT(*) FROM sagas WHERE state <> ? AND updated_ms >= ?",
                (SagaState.PENDING.value, now_ms - 60_000),
            )
            decided = int(cur.fetchone()[0])
            cur.execute("SELECT COUNT(*) FROM console_dlq")
            dlq = int(cur.fetchone()[0])
        return {
            "counts": counts,
            "total": sum(counts.values()),
            "decided_last_minute": decided,
            "dlq": dlq,
        }

    def dead_letters(self, limit: int = 200, tx_id: str | None = None) -> list[dict[str, Any]]:
        """The newest dead letters (of ``tx_id`` when given)."""
        clause = "WHERE tx_id = ? " if tx_id else ""
        params: list[Any] = [tx_id] if tx_id else []
        params.append(max(1, min(limit, MAX_ROWS)))
        with self._transaction() as cur:
            cur.execute(
                "SELECT part, record_offset, tx_id, error, source_topic, source_partition, "  # noqa: S608
                f"source_offset, at_ms, size, excerpt FROM console_dlq {clause}"
                "ORDER BY at_ms DESC, part, record_offset DESC LIMIT ?",
                tuple(params),
            )
            names = (
                "partition",
                "offset",
                "tx_id",
                "error",
                "source_topic",
                "source_partition",
                "source_offset",
                "at_ms",
                "size",
                "excerpt",
            )
            return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]

    def record_action(
        self, at_ms: int, operator: str, action: str, tx_id: str | None, detail: str, outcome: str
    ) -> None:
        """Append one line to the audit trail."""
        with self._transaction() as cur:
            cur.execute(
                "INSERT INTO console_audit (at_ms, operator, action, tx_id, detail, outcome) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (at_ms, operator, action, tx_id, detail, outcome),
            )

    def audit(self, limit: int = 200) -> list[dict[str, Any]]:
        """The newest audit lines first."""
        with self._transaction() as cur:
            cur.execute(
                "SELECT at_ms, operator, action, tx_id, detail, outcome FROM console_audit "
                "ORDER BY at_ms DESC LIMIT ?",
                (max(1, min(limit, MAX_ROWS)),),
            )
            names = ("at_ms", "operator", "action", "tx_id", "detail", "outcome")
            return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _saga_dict(row: Sequence[Any]) -> dict[str, Any]:
    tx_id, saga, state, reason, created, updated, deadline, steps_json, _names = row
    return {
        "tx_id": tx_id,
        "saga": saga,
        "state": state,
        "reason": reason,
        "created_ms": int(created),
        "updated_ms": int(updated),
        "deadline_ms": int(deadline),
        "steps": json.loads(steps_json),
    }


class _Cursor:
    """A DB-API cursor whose statements use ``?`` placeholders on either server."""

    def __init__(self, cursor: Any, translate: Any) -> None:
        self._cursor = cursor
        self._translate = translate

    def execute(self, statement: str, params: Sequence[Any] = ()) -> None:
        # PostgreSQL's text cannot hold NUL, which a hostile record's strings may.
        cleaned = tuple(p.replace("\x00", "\ufffd") if isinstance(p, str) else p for p in params)
        self._cursor.execute(self._translate(statement), cleaned)

    def fetchone(self) -> Any:
        return self._cursor.fetchone()

    def fetchall(self) -> list[Any]:
        return list(self._cursor.fetchall())

    def close(self) -> None:
        self._cursor.close()


class _SqliteAdapter:
    """sqlite3 in autocommit mode, where :meth:`ViewStore._transaction` says BEGIN itself."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def cursor(self) -> sqlite3.Cursor:
        return self._conn.cursor()

    def commit(self) -> None:
        if self._conn.in_transaction:
            self._conn.execute("COMMIT")

    def rollback(self) -> None:
        if self._conn.in_transaction:
            self._conn.execute("ROLLBACK")

    def close(self) -> None:
        self._conn.close()
