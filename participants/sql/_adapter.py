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
        SELECT ... FROM ledger FOR UPDATE    -- the batch's ledger view, read once
        SAVEPOINT effect                     -- first statement of the action
          UPDATE accounts ...                -- the action
        ROLLBACK TO effect | RELEASE effect  -- Unit.rollback_effect() | Unit.write()
      RELEASE item                           -- Unit.finish()
      INSERT/UPDATE ledger ...               -- the changed entries, written once
    COMMIT                                   -- only now are the reports emitted

So a rejected step undoes exactly its own change and still records ``failed``,
and its neighbours in the batch are untouched.

A batch of built-in actions only (no custom handlers) runs without those
savepoints, its increments on the batch's locked copy of their rows
(:mod:`participants.sql._rows`) and its holds and reservations on the batch's copy
of the holds table (:mod:`participants.sql._holds`); on PostgreSQL it costs the same
statements whatever its size::

    BEGIN
      SELECT pg_advisory_xact_lock(...)            -- the batch's transactions
      SELECT ... FROM ledger WHERE tx_id = ANY(...) FOR UPDATE
      SELECT pg_advisory_xact_lock(...)            -- records a step may create
      SELECT ... FROM accounts WHERE id = ANY(...) FOR UPDATE   -- per target table
      SELECT ... FROM ledger_holds ...             -- the holds of those records
      UPDATE accounts ... FROM json_to_recordset(...)           -- per target table
      DELETE FROM ledger_holds ... / INSERT INTO ledger_holds ...
      INSERT INTO ledger ... / UPDATE ledger ...   -- new and changed entries
    COMMIT

Through psycopg, the locks and the ledger lookup go out together in one pipeline,
the record locks, rows and holds in a second, and the writes with the ``COMMIT``
in a third (:func:`~participants.sql._errors.pipelined`): with the pool's liveness
check and psycopg's own ``BEGIN``, a batch waits for the server five times, as it
did before the holds (their read shares the rows' wait, their writes the commit's).

Isolation (:mod:`participants.sql._isolation`): under ``read_committed`` a step
changes the holds table only (a hold with the intended fields, or an escrow
reservation), and its commit decision writes the row and removes the hold, each in
the same transaction as the step's ledger entry. Holds live in ``<ledger>_holds``,
created with the ledger (and added to a ledger made before it), never pruned.

Any other built-in action runs its own statements, after the copy is written
back. When the database refuses a statement (which aborts a PostgreSQL
transaction), the batch runs again *carefully*, as above, and only the refused
step fails.

Two workers may briefly act on one transaction (a rebalance: a zombie and its
successor). On PostgreSQL a batch first takes transaction-scoped advisory locks
on its transactions (for this participant), so the two act one after the other
and the second sees the first's ledger entry: a request cannot slip past a
rollback marker being written. The ledger's primary key is the backstop (see
:class:`~participants._sql_ledger.BatchLedger`). SQLite lets one writer at a time anyway.

The adapter is :class:`SqlStorage` (a :class:`~participants._storage.LedgerStorage`,
whose batch loop drives it) here; its native session is in
:mod:`participants.sql._session`, its built-in actions in
:mod:`participants.sql._actions` (``none``), :mod:`participants.sql._isolation`
(``read_committed``) and :mod:`participants.sql._record` (what both share), their
holds in :mod:`participants.sql._holds`, its ledger and unit in
:mod:`participants.sql._ledger`, its connection and error helpers in
:mod:`participants.sql._errors`.

Errors (docs/architecture.md §4), classified by :func:`participants.sql._errors.verdict`
(by SQLSTATE on PostgreSQL, by error name on SQLite):

* what the database says about an action's statement, built-in or a custom
  handler's (a constraint, a trigger's ``RAISE``, a data or syntax error, a missing
  privilege) is that step's :class:`~participants._refusals.StoreRefused`: the step
  fails and its saga rolls back, or its decision is parked and reported; a statement
  or lock timeout is run again a few times first (:mod:`participants._refusals`);
* the database being unreachable or short of resources, a lost connection, a
  deadlock or a serialization failure, a timeout on the batch's own locks, and another
  worker writing the same ledger entry at the same time are a
  :class:`~streams.TransientError`: nothing of the batch took effect and the runtime
  retries it;
* a statement of the batch's own the database refuses as such (a missing table or
  privilege) is a :class:`~streams.ConfigurationError`; one it refuses for a value
  fails the item it belongs to (the runtime runs the batch's items one by one).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

from sqlalchemy import (
    Connection,
    MetaData,
    Table,
    and_,
    delete,
    inspect,
    select,
    tuple_,
)
from sqlalchemy import exc as sa_exc

from saga.participants._actions import check_identifier
from saga.participants._barrier import LedgerEntry, LedgerStatus
from saga.participants._handlers import Handler, combine
from saga.participants._refusals import StoreRefused, Verdict
from saga.participants._storage import Actions, LedgerStorage, Report, Unit, WorkItem
from saga.participants.sql import _mysql as mysql
from saga.participants.sql._actions import (
    BatchKeys,
    DriverErrors,
    NeedsSavepoints,
    SqlActions,
    batch_keys,
)
from saga.participants.sql._errors import (
    can_pipeline,
    describe,
    detail,
    error_code,
    is_auth_failure,
    is_conflict,
    is_schema_error,
    make_engine,
    pipelined,
    sqlalchemy_url,
    tx_locks,
    verdict,
)
from saga.participants.sql._escrow import EscrowCommits
from saga.participants.sql._holds import (
    HOLDS_COLUMNS,
    BatchHolds,
    DirectHolds,
    RecordLocks,
    define_holds,
)
from saga.participants.sql._ledger import (
    ADDED_COLUMNS,
    LEDGER_COLUMNS,
    BatchLedger,
    SqlUnit,
    define_ledger,
    entry_of_row,
    upgrade_ledger,
)
from saga.participants.sql._rows import BatchRows
from saga.participants.sql._session import SqlSession
from saga.streams import ConfigurationError, Mode, TransientError
from saga.streams._faults import NO_FAULTS, Faults


@contextmanager
def _careful_if_refused() -> Iterator[None]:
    """What the database refused, or timed out on, in a batch's reads or writes of the rows
    its steps touch (a constraint, a trigger's exception, a lock timeout): run the batch
    again carefully, where it is the one step's."""
    try:
        yield
    except sa_exc.DBAPIError as exc:
        if verdict(exc) not in (Verdict.REFUSED, Verdict.TIMEOUT):
            raise
        raise NeedsSavepoints from exc


@dataclass(frozen=True, slots=True)
class SqlBatch:
    """What a batch's items share: its connection (one transaction) and ledger view."""

    connection: Connection
    ledger: BatchLedger
    careful: bool
    """Each item in its own savepoint (else none: built-in steps only)."""
    locks: RecordLocks
    """The record locks of the batch (:mod:`participants.sql._holds`)."""
    rows: BatchRows | None = None
    """Not careful: the batch's copy of the rows its steps touch."""
    holds: BatchHolds | None = None
    """Not careful: the batch's copy of those records' holds."""
    settled: dict[str, list[Report]] = field(default_factory=dict)
    """The commit decisions settled in the database, by transaction (their events)."""


class SqlStorage(LedgerStorage[SqlSession, SqlBatch]):
    """A participant's SQL database: its target tables and its ledger, changed together.

    ``url`` is an SQLAlchemy URL; ``postgresql://`` (and ``postgres://``) mean
    psycopg 3. ``targets`` are the tables steps may touch (the allow-list); each
    must exist, in ``schema`` when given, with a single-column primary key.
    The ledger lives in ``ledger_table`` in the same schema and is created by
    :meth:`setup` when absent, with the holds table ``<ledger_table>_holds``
    (:mod:`participants.sql._holds`). Participants whose steps touch the same tables
    must share the ledger table (several may): their holds are then one table, and a
    step of one sees the holds of the other.

    ``handlers`` runs custom actions: either the mapping of action name to
    :class:`~participants.Handler` that :func:`~participants.load_handlers`
    returns (a handler named like a built-in action replaces it), or any
    :class:`~participants.Actions`, which gets every action that is not built in.
    Without handlers a custom action is a business rejection. Handlers receive a
    :class:`SqlSession` as ``native``.

    :meth:`execute` acts on every item in order, repeats included (a repeat
    re-reports its step's status); dropping repeats is the caller's choice.
    """

    driver_errors = (sa_exc.DBAPIError, sa_exc.DisconnectionError, sa_exc.TimeoutError)
    atomic_batch = True

    def __init__(
        self,
        name: str,
        url: str,
        targets: Iterable[str],
        *,
        schema: str | None = None,
        ledger_table: str = "saga_ledger",
        handlers: Actions[Any] | Mapping[str, Handler] | None = None,
        faults: Faults = NO_FAULTS,
    ) -> None:
        super().__init__(faults=faults)
        if not isinstance(name, str) or not 0 < len(name) <= 128:
            raise ConfigurationError(f"participant name {name!r} must be 1-128 characters")
        self.name = name
        self.targets = frozenset(targets)
        for target in sorted(self.targets):
            check_identifier(target, "target table")
        check_identifier(ledger_table, "ledger table")
        if len(ledger_table) > 50:
            raise ConfigurationError(
                f"ledger table name {ledger_table!r} is too long (at most 50 characters)"
            )
        if ledger_table in self.targets:
            raise ConfigurationError(
                f"the ledger table {ledger_table!r} cannot also be a target: steps would "
                "be able to rewrite the ledger"
            )
        if f"{ledger_table}_holds" in self.targets:
            raise ConfigurationError(
                f"the holds table {ledger_table}_holds cannot also be a target: steps would "
                "be able to rewrite the holds of other sagas"
            )
        if schema is not None:
            check_identifier(schema, "schema")
        self.schema = schema
        self.url = mysql.driver_url(sqlalchemy_url(url))
        on_mysql = mysql.is_mysql_url(self.url)
        self.database = mysql.describe(self.url) if on_mysql else describe(self.url)
        self.where = self.database
        self._engine = mysql.make_engine(self.url) if on_mysql else make_engine(self.url)
        self._metadata = MetaData(schema=schema)
        self.ledger_table = define_ledger(self._metadata, ledger_table)
        self.holds_table = define_holds(self._metadata, ledger_table)
        # MySQL and MariaDB: the batch's locks are rows of <ledger>_locks (participants.sql._mysql).
        self.locks_table = (
            mysql.define_locks(self._metadata, ledger_table, self.targets) if on_mysql else None
        )
        self._tables: dict[str, Table] = {}
        self._lock_transactions = self._engine.dialect.name == "postgresql"
        self._pipeline = can_pipeline(self._engine)
        self.actions = DriverErrors(combine(SqlActions(self.targets), handlers))
        # Without handlers every action is built in, and batches may skip savepoints.
        self._builtin_only = not handlers

    # -- lifecycle

    def prepare(self) -> None:
        """Create the ledger if absent and reflect the target tables; idempotent.

        Raises :class:`ConfigurationError` naming what to fix when the schema or a
        target table is missing, a target has no single-column primary key, or
        the ledger table exists with another shape; :class:`TransientError` when
        the database is unreachable.
        """
        with self.boundary("set up its ledger and tables"):
            with self._engine.connect() as connection:
                self._check_schema(connection)
            self._create_ledger()
            reflected = MetaData(schema=self.schema)
            tables: dict[str, Table] = {}
            with self._engine.connect() as connection:
                for name in sorted(self.targets):
                    tables[name] = self._reflect(connection, reflected, name)
        self._tables = tables

    def close(self) -> None:
        self._engine.dispose()

    # -- work

    @contextmanager
    def open_batch(self, items: Sequence[WorkItem], attempt: int) -> Iterator[SqlBatch]:
        """One database transaction; its ledger entries read first and written last.

        With built-in actions only, the first run of a batch has no savepoints (a
        rejected built-in step has changed nothing, see :class:`SqlActions`); should
        an action meet a database error anyway (which aborts a PostgreSQL
        transaction), the batch is rolled back and run again *carefully*: each item
        in its own savepoint and each effect in another, as custom handlers always
        run. The ledger entries of the batch's transactions are read in one
        statement and the changed ones written in two, before the commit. Without
        savepoints the rows the batch's increments touch are read (and locked) in one
        statement per table after the ledger, and written in one per table before it
        (:mod:`participants._sql_rows`); should the database refuse that write, the
        batch runs again carefully, where the step it refuses fails alone.

        A :class:`TransientError` (the database unavailable, a lost conflict) means
        nothing of the batch took effect (or, when the connection broke during the
        commit itself, all of it did); retrying is safe either way because the retry
        finds the ledger entries and re-reports them.
        """
        careful = attempt > 0 or not self._builtin_only
        with self._engine.begin() as connection:
            tx_ids = {item.tx_id for item in items}
            ledger = BatchLedger(self.name, self.ledger_table, connection)
            if self._pipeline:
                with pipelined(connection) as driver:
                    if tx_ids:
                        connection.execute(tx_locks(self.name, tx_ids))
                    read = ledger.load_pipelined(driver, tx_ids)
                read()
            else:
                if self._lock_transactions and tx_ids:
                    connection.execute(tx_locks(self.name, tx_ids))
                elif self.locks_table is not None and tx_ids:
                    connection.execute(mysql.tx_locks(self.locks_table, self.name, tx_ids))
                ledger.load(tx_ids)
            pg = self._lock_transactions
            locks = RecordLocks(connection, self.holds_table, postgresql=pg, rows=self.locks_table)
            escrow = None
            if not careful and self._pipeline:
                escrow = EscrowCommits(self.name, items, ledger, self._tables, self.holds_table)
            keys = batch_keys(
                escrow.others(items) if escrow else items, ledger.entries, self._tables
            )
            while escrow and escrow.keep_apart(keys.records):  # the rows' copy must not hold them
                keys = batch_keys(escrow.others(items), ledger.entries, self._tables)
            rows = holds = None
            if careful:
                locks.take(keys.creating)
            else:
                rows = BatchRows(connection, self._tables, postgresql=pg)
                holds = BatchHolds(connection, self.holds_table, locks)
                with _careful_if_refused():
                    self._preload(connection, keys, rows, holds, escrow)
            settled = {} if escrow is None else escrow.reports
            yield SqlBatch(connection, ledger, careful, locks, rows, holds, settled)
            if rows is not None and holds is not None and self._pipeline:
                # A refusal of the rows' write or of the ledger's (another worker's
                # entry): the careful run, one statement at a time, tells which.
                with _careful_if_refused(), pipelined(connection) as driver:
                    rows.flush()
                    holds.flush()
                    ledger.flush()
                    # A statement, not driver.commit(): that would wait for the
                    # writes before the pipeline's own end waits again.
                    driver.execute("COMMIT")
                return
            if rows is not None and holds is not None:
                with _careful_if_refused():
                    rows.flush()
                    holds.flush()
            ledger.flush()

    def _preload(
        self,
        connection: Connection,
        keys: BatchKeys,
        rows: BatchRows,
        holds: BatchHolds,
        escrow: EscrowCommits | None = None,
    ) -> None:
        """Lock and read what the batch's built-in steps touch: first the record locks of
        rows a step may create (they have no row lock yet), then the rows (locked), then
        their holds (read once the rows are locked, so they are the latest). Through
        psycopg, in one pipeline: one wait for the server, which also settles the
        ``escrow`` commits (:mod:`participants.sql._escrow`)."""
        if not keys.records and not escrow:
            return
        if self._pipeline:  # (escrow commits only come with it)
            settle = read_rows = None
            with pipelined(connection) as driver:
                if escrow:
                    settle = escrow.send(driver, connection.dialect)
                if keys.records:
                    holds.locks.take(keys.creating)
                    read_rows = rows.load_pipelined(driver, keys.rows)
                    if read_rows is not None:
                        read_holds = holds.load_pipelined(driver, keys.records)
            if settle is not None:
                settle()
            if read_rows is not None:
                read_rows()
                read_holds()
                return
            if not keys.records:
                return
        holds.locks.take(keys.creating)
        rows.preload(keys.rows)
        holds.preload(keys.records)

    def settled(self, batch: SqlBatch) -> Mapping[str, list[Report]]:
        return batch.settled

    def open_unit(
        self, batch: SqlBatch, item: WorkItem, previous: Unit[SqlSession] | None
    ) -> SqlUnit:
        connection = batch.connection
        if not batch.careful:
            session = SqlSession(
                connection, self._tables, savepoints=False, rows=batch.rows, holds=batch.holds
            )
            return SqlUnit(batch.ledger, session, connection)
        session = SqlSession(connection, self._tables)
        session.holds = DirectHolds(self.holds_table, batch.locks, session.execute)
        return SqlUnit(batch.ledger, session, connection, connection.begin_nested())

    # -- reading the ledger

    def ledger(self, tx_id: str | None = None) -> list[LedgerEntry]:
        c = self.ledger_table.c
        query = select(self.ledger_table).where(c.participant == self.name, c.step >= 0)
        if tx_id is not None:
            query = query.where(c.tx_id == tx_id)
        query = query.order_by(c.tx_id, c.step)
        with self.boundary("read its ledger"), self._engine.connect() as connection:
            return [entry_of_row(row) for row in connection.execute(query).mappings()]

    def in_flight_sequential(self) -> set[str]:
        """Sequential transactions in which a step of this participant may still need a
        neighbour's event: one waiting for its predecessor to be applied, or one applied
        or failed and not decided yet (its rollback may wait for its successor's
        compensation, and the predecessor's event, read again after a crash, reports it
        again). A commit leaves an applied step as it is (nothing to confirm), so a
        committed sequential saga stays listed until its entries are pruned."""
        c = self.ledger_table.c
        waiting = c.status == str(LedgerStatus.WAITING)
        may_wait = c.status.in_((str(LedgerStatus.APPLIED), str(LedgerStatus.FAILED)))
        query = (
            select(c.tx_id)
            .where(c.participant == self.name, c.step >= 0, c.mode == str(Mode.SEQUENTIAL))
            .where(waiting | may_wait)
            .distinct()
        )
        with self.boundary("read its ledger"), self._engine.connect() as connection:
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
        if self.locks_table is not None:  # MySQL: no LIMIT in a subquery of IN, but on DELETE
            statement = mysql.limited(delete(self.ledger_table).where(due), limit)
        with self.boundary("prune its ledger"), self._engine.begin() as connection:
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
        """Create the ledger and its holds table when absent (a ledger of a version before
        isolation gets its holds table here), and upgrade an older ledger in place."""
        created = [self.ledger_table, self.holds_table]
        if self.locks_table is not None:
            created.append(self.locks_table)
        try:
            self._metadata.create_all(self._engine, tables=created, checkfirst=True)
        except (sa_exc.IntegrityError, sa_exc.ProgrammingError, sa_exc.OperationalError):
            # Two participants starting together both saw no ledger and raced to
            # create it; the loser finds it there now.
            inspector = inspect(self._engine)
            if not all(inspector.has_table(t.name, schema=self.schema) for t in created):
                raise
        if self.locks_table is not None:
            with self._engine.begin() as connection:
                mysql.fill_locks(connection, self.locks_table, self.name)
        with self._engine.connect() as connection:
            inspector = inspect(connection)
            names = {
                column["name"]
                for column in inspector.get_columns(self.ledger_table.name, schema=self.schema)
            }
            held = {
                column["name"]
                for column in inspector.get_columns(self.holds_table.name, schema=self.schema)
            }
        lacking = [name for name in HOLDS_COLUMNS if name not in held]
        if lacking:
            raise ConfigurationError(
                f"table {self._qualified(self.holds_table.name)} exists but is not the holds "
                f"table of a saga ledger (it lacks {', '.join(lacking)}); rename it, or "
                "choose another ledger table name"
            )
        missing = [name for name in LEDGER_COLUMNS if name not in names]
        if missing:
            raise ConfigurationError(
                f"table {self._qualified(self.ledger_table.name)} exists but is not a saga "
                f"ledger (it lacks {', '.join(missing)}); choose another ledger table name"
            )
        added = [name for name in ADDED_COLUMNS if name not in names]
        if added:
            upgrade_ledger(self._engine, self.ledger_table, added, self.schema)

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

    def translate(self, exc: BaseException, what: str) -> NoReturn:
        """The driver's errors in the saga error tree (see the module doc)."""
        if not isinstance(exc, sa_exc.DBAPIError):
            raise TransientError(
                f"participant {self.name!r} could not {what}: {self.database} is "
                f"unavailable ({detail(exc)}); retrying is safe"
            ) from exc
        prefix = f"participant {self.name!r} could not {what}"
        if is_auth_failure(exc):
            raise ConfigurationError(
                f"{prefix}: authentication failure: {self.database} refused the user "
                f"{self.url.username or '(none)'!r} ({detail(exc)}); fix the user name or "
                "password in the storage URL, or the server's pg_hba.conf"
            ) from exc
        if verdict(exc) is Verdict.REFUSED:
            if is_schema_error(exc):
                raise ConfigurationError(
                    f"{prefix}: {self.database} refused a statement ({detail(exc)}); check "
                    "the tables and the database user's privileges"
                ) from exc
            # Not one step's statement, but a value of the batch's: run one by one, the
            # runtime fails the item it belongs to.
            raise StoreRefused(
                f"{prefix}: {self.database} refused it ({detail(exc)}, {error_code(exc)})"
            ) from exc
        if is_conflict(exc):
            raise TransientError(
                f"{prefix}: it conflicted with a concurrent transaction on {self.database} "
                f"({detail(exc)}); retrying is safe"
            ) from exc
        raise TransientError(
            f"{prefix}: {self.database} is unavailable or failed ({detail(exc)}); retrying is safe"
        ) from exc


__all__ = ["SqlActions", "SqlSession", "SqlStorage", "define_ledger"]
