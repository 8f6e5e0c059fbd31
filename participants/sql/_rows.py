"""The rows a batch of built-in increments touches: read once, decided in Python, written once.

A batch without savepoints (built-in actions only, see
:meth:`participants._sql.SqlStorage.open_batch`) used to run one guarded
``UPDATE`` per increment: one round trip per step. :class:`BatchRows` makes it
a constant number per batch and target table::

    SELECT * FROM accounts WHERE id IN (...) ORDER BY id FOR UPDATE   -- every row, locked
    -- each increment / its compensation, in batch order, on the rows in memory
    UPDATE accounts AS t SET balance = v.balance                      -- the final values
      FROM json_to_recordset(:rows) AS v(id bigint, balance numeric(12,2))
     WHERE t.id = v.id AND t.id = ANY(:keys0)

Why this is safe:

* the rows are locked (``FOR UPDATE``) before any step decides, and stay locked
  until the batch commits, so nobody changes them between the read and the write
  (SQLite has one writer at a time anyway);
* steps see each other in batch order: the second increment of a key reads the
  value the first one left in memory, and a rejected step (absent row, no value,
  a bound) changes nothing, as before;
* the values are cast to the column's own type (its reflected type, rendered by
  the dialect), so ``numeric(p, s)`` rounds as an ``UPDATE`` would (Python rounds
  the same way first, so later steps of the batch see the stored value);
* a value the database refuses (an integer out of range, a ``CHECK``, a trigger)
  fails the final ``UPDATE``, which aborts the transaction: the adapter then
  runs the batch again with savepoints and the old per-step statements, where
  that step alone is rejected (:class:`participants._sql_actions.NeedsSavepoints`);
* a key whose row the database matches but Python does not (``char(n)`` padding,
  a case-insensitive collation) is not cached: the action takes the per-step
  path for it, after the pending writes are flushed (:meth:`BatchRows.direct`);
  every statement that bypasses the cache does the same.

On PostgreSQL the write is one statement per table whatever the batch size (its
text does not change, so psycopg prepares it once); on MySQL and MariaDB one ``UPDATE
... CASE`` per table and 500 rows (:mod:`participants.sql._mysql`); elsewhere (SQLite)
one ``executemany``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from contextlib import suppress
from decimal import ROUND_HALF_UP, Context, Decimal
from enum import Enum
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Final, Literal

from sqlalchemy import (
    Column,
    ColumnElement,
    Connection,
    Dialect,
    Table,
    TextClause,
    any_,
    bindparam,
    select,
    text,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql import sqltypes

from saga.participants.sql._mysql import case_updates, is_mysql

if TYPE_CHECKING:  # psycopg is PostgreSQL's driver: SQLite runs without it
    import psycopg


class NotCached(Enum):
    """What :meth:`BatchRows.row` returns for a key the cache cannot hold (see the module doc)."""

    NOT_CACHED = "not cached"


NOT_CACHED: Final = NotCached.NOT_CACHED

_CHUNK: Final = 1000
# PostgreSQL's numeric is exact; Python's default context would round a sum to 28 digits.
_EXACT: Final = Context(prec=100_000, Emax=1_000_000, Emin=-1_000_000)


class BatchRows:
    """The batch's copy of the rows its increments touch (see the module doc).

    ``tables`` are the reflected targets by name; ``postgresql`` selects the one-
    statement write (else ``executemany``). Rows are keyed by ``(table, key)``
    with ``key`` the primary key value as the action coerced it.
    """

    def __init__(self, connection: Connection, tables: Mapping[str, Table], *, postgresql: bool):
        self._connection = connection
        self._tables = tables
        self._postgresql = postgresql
        self._rows: dict[tuple[str, Any], dict[str, Any] | None] = {}
        self._uncached: set[tuple[str, Any]] = set()
        self._dirty: dict[str, dict[Any, set[str]]] = {}  # table -> key -> changed columns

    # -- reads

    def preload(self, wanted: Mapping[str, Iterable[Any]]) -> None:
        """Read and lock the rows of ``wanted`` (table name -> keys): one statement per
        table (per thousand keys), tables in name order and rows in key order, so two
        batches lock in the same order."""
        for name in sorted(wanted):
            table = self._tables[name]
            keys = [k for k in set(wanted[name]) if (name, k) not in self._rows]
            with suppress(TypeError):  # mixed key types: the database orders the locks
                keys.sort()
            for start in range(0, len(keys), _CHUNK):
                self._read(table, keys[start : start + _CHUNK])

    def row(self, table: Table, key: Any) -> dict[str, Any] | Literal[NotCached.NOT_CACHED] | None:
        """The row of ``key`` as the batch has left it (``None``: absent), read and locked
        on first use; :data:`NOT_CACHED` when the cache cannot hold this key."""
        at = (table.name, key)
        if at in self._uncached:
            return NOT_CACHED
        if at not in self._rows:
            self._read(table, [key])
            if at in self._uncached:
                return NOT_CACHED
        return self._rows[at]

    def load_pipelined(
        self, driver: psycopg.Connection[Any], wanted: Mapping[str, Iterable[Any]]
    ) -> Callable[[], None] | None:
        """:meth:`preload` on PostgreSQL, sent inside a pipeline (:func:`pipelined`) with the
        statements before and after it; the returned call, made after the pipeline, reads
        what it found. ``None`` (nothing sent) when a key column's type cannot be named
        in SQL: then :meth:`preload`."""
        from psycopg.rows import dict_row

        dialect = self._connection.dialect
        quote = dialect.identifier_preparer.quote
        queries: list[tuple[Table, list[Any], str]] = []
        for name in sorted(wanted):
            table = self._tables[name]
            pk = _pk(table)
            try:
                kind = sql_type(pk, dialect)
            except sa_exc.CompileError:
                return None
            keys = [k for k in set(wanted[name]) if (name, k) not in self._rows]
            with suppress(TypeError):
                keys.sort()
            target = dialect.identifier_preparer.format_table(table)
            sql = (
                f"SELECT * FROM {target} WHERE {quote(pk.name)} = "  # noqa: S608
                f"ANY(CAST(%(keys)s AS {kind}[])) ORDER BY {quote(pk.name)} FOR UPDATE"
            )
            queries.extend(
                (table, keys[start : start + _CHUNK], sql) for start in range(0, len(keys), _CHUNK)
            )
        cursors = []
        for table, keys, sql in queries:
            cursor = driver.cursor(row_factory=dict_row)
            cursor.execute(sql, {"keys": keys})
            cursors.append((cursor, table, keys))

        def read() -> None:
            for cursor, table, keys in cursors:
                with cursor:
                    types = {d.name: d.type_code for d in cursor.description or ()}
                    found = cursor.fetchall()
                # As SQLAlchemy would hand them over: its result processors per column.
                convert = {
                    name: table.c[name].type.dialect_impl(dialect).result_processor(dialect, code)
                    or _same
                    for name, code in types.items()
                }
                converted = [{n: convert[n](v) for n, v in row.items()} for row in found]
                self._found(table, keys, converted)

        return read

    def _read(self, table: Table, keys: list[Any]) -> None:
        pk = _pk(table)
        match = one_of(pk, keys, postgresql=self._postgresql)
        query = select(table).where(match).order_by(pk).with_for_update()
        self._found(table, keys, self._connection.execute(query).mappings())

    def _found(self, table: Table, keys: list[Any], rows: Iterable[Mapping[Any, Any]]) -> None:
        pk = _pk(table)
        wanted = set(keys)
        # A char(n) key comes back padded: two spellings of one key may be in the batch,
        # and the row would be found under one only. Such keys are never cached.
        padded = strangers = isinstance(pk.type, sqltypes.CHAR)
        for found in rows:
            value = found[pk.name]
            if value in wanted and not padded:
                self._rows[(table.name, value)] = dict(found)
            else:
                strangers = True  # the database's equality is not Python's for this key
        for key in keys:
            if (table.name, key) not in self._rows:
                if strangers:
                    self._uncached.add((table.name, key))
                else:
                    self._rows[(table.name, key)] = None

    # -- writes

    def set(self, table: Table, key: Any, column: Column[Any], value: Any) -> None:
        """Change ``column`` of the (present, cached) row of ``key`` to ``value``."""
        row = self._rows[(table.name, key)]
        assert row is not None, "set() follows a row() that found the row"
        row[column.name] = as_stored(column, value)
        self._dirty.setdefault(table.name, {}).setdefault(key, set()).add(column.name)

    def direct(self, table: Table, key: Any) -> None:
        """A statement is about to change ``key`` behind the cache: write what is pending,
        and read the row again when it is next needed."""
        self.flush()
        self._rows.pop((table.name, key), None)

    def forget_absent(self, table: Table, key: Any) -> None:
        """Read ``key`` again when it is next needed, if the batch found it absent (another
        batch may have created it since; an absent row has nothing pending to write)."""
        at = (table.name, key)
        if at in self._rows and self._rows[at] is None:
            del self._rows[at]

    def flush(self) -> None:
        """Write every changed row: one statement per table (see the module doc).

        Raises the driver's error when the database refuses a value; on PostgreSQL that
        has aborted the transaction (the caller runs the batch again carefully).
        """
        dirty, self._dirty = self._dirty, {}
        for name in sorted(dirty):
            table = self._tables[name]
            changed = dirty[name]
            columns = sorted(set().union(*changed.values()))
            statement = self._bulk_update(table, columns) if self._postgresql else None
            if statement is not None:
                pk = _pk(table).name
                values = [
                    {pk: key, **{column: self._value(name, key, column) for column in columns}}
                    for key in changed
                ]
                self._connection.execute(statement, bulk_rows(values, (pk,)))
            elif is_mysql(self._connection.dialect):
                key = _pk(table)
                values = [
                    {key.name: k, **{column: self._value(name, k, column) for column in columns}}
                    for k in changed
                ]
                for each in case_updates(table, key, columns, values):
                    self._connection.execute(each)
            else:
                many, rows = _many_update(table, columns)
                self._connection.execute(
                    many,
                    [
                        {
                            rows[0]: key,
                            **{
                                rows[i + 1]: self._value(name, key, column)
                                for i, column in enumerate(columns)
                            },
                        }
                        for key in changed
                    ],
                )

    def _value(self, name: str, key: Any, column: str) -> Any:
        row = self._rows[(name, key)]
        assert row is not None
        return row[column]

    def _bulk_update(self, table: Table, columns: list[str]) -> TextClause | None:
        return bulk_statement(self._connection.dialect, table, (_pk(table).name,), tuple(columns))


@lru_cache(maxsize=256)
def bulk_statement(
    dialect: Dialect,
    table: Table,
    keys: tuple[str, ...],
    columns: tuple[str, ...],
    *,
    insert: bool = False,
    by_row_id: bool = False,
) -> TextClause | None:
    """PostgreSQL: one statement for any number of rows, bound as one JSON array of
    objects (:func:`bulk_rows`) that ``json_to_recordset`` turns into rows of the
    columns' own types. ``insert``: ``INSERT ... SELECT`` of ``keys`` and ``columns``;
    else ``UPDATE ... FROM`` setting ``columns`` where every key column matches. Built
    once per table and columns (the text is the same whatever the number of rows, so
    psycopg prepares it). ``None`` when a column's type cannot be named in SQL (the
    caller uses ``executemany``).

    ``by_row_id`` (the product's own tables, never partitioned, whose rows the batch
    holds locked): the update finds each row through the primary key, one lookup per
    row, and writes it by its ``ctid``. Matching the key columns with ``= ANY`` lets
    the planner scan an index that leads with a column every row shares (the ledger's
    ``participant``): on a ledger whose statistics are older than its rows it read
    every entry of the participant to update a batch's few (so does :func:`bulk_delete`).

    One JSON text rather than an array per column: psycopg quotes array elements one
    by one in Python, where ``json.dumps`` runs in C."""
    quote = dialect.identifier_preparer.quote
    names = (*keys, *columns)
    if (recordset := _recordset(dialect, table, names)) is None:
        return None
    rows, types = recordset
    # Names come from the reflected table and are quoted by the dialect; values are
    # bound: nothing of a step's arguments becomes SQL text.
    target = dialect.identifier_preparer.format_table(table)
    listed = ", ".join(quote(name) for name in names)
    if insert:
        return text(f"INSERT INTO {target} ({listed}) SELECT {listed} FROM {rows}")  # noqa: S608
    sets = ", ".join(f"{quote(c)} = v.{quote(c)}" for c in columns)
    if by_row_id:
        found = _row_ids(target, rows, keys, quote)
        return text(f"UPDATE {target} AS t SET {sets} FROM {found} WHERE t.ctid = v.saga_row")  # noqa: S608
    match = " AND ".join(f"t.{quote(k)} = v.{quote(k)}" for k in keys)
    # The planner guesses 100 rows for json_to_recordset and would scan the whole table
    # to join them; each key column's values as an array (:keys0, ...) let it find the
    # rows through the primary key's index.
    lookup = " AND ".join(
        f"t.{quote(k)} = ANY(CAST(:keys{i} AS {types[i]}[]))" for i, k in enumerate(keys)
    )
    return text(f"UPDATE {target} AS t SET {sets} FROM {rows} WHERE {match} AND {lookup}")  # noqa: S608


@lru_cache(maxsize=32)
def bulk_delete(dialect: Dialect, table: Table, keys: tuple[str, ...]) -> TextClause | None:
    """PostgreSQL: delete any number of rows of one of the product's own tables by key,
    bound as one JSON text (:func:`bulk_rows`); ``None`` when a key's type cannot be
    named in SQL.

    Each row is found through the primary key and deleted by its ``ctid``: a join of
    the table with ``json_to_recordset`` (which the planner guesses at 100 rows) was
    planned as a scan of the whole table, whose cost grew with its rows (found on the
    holds table, whose ``bounds`` rows stay for good). ``OFFSET 0`` keeps the lookup a
    subquery, run once per row, instead of being flattened into that join.
    """
    if (recordset := _recordset(dialect, table, keys)) is None:
        return None
    target = dialect.identifier_preparer.format_table(table)
    found = _row_ids(target, recordset[0], keys, dialect.identifier_preparer.quote)
    return text(f"DELETE FROM {target} WHERE ctid = ANY(ARRAY(SELECT v.saga_row FROM {found}))")  # noqa: S608


def _recordset(
    dialect: Dialect, table: Table, names: tuple[str, ...]
) -> tuple[str, list[str]] | None:
    """``json_to_recordset`` of the bound ``:rows`` as rows ``v`` of the columns ``names``
    in their own SQL types, and those types; ``None`` when a type cannot be named."""
    try:
        types = [sql_type(table.c[name], dialect) for name in names]
    except sa_exc.CompileError:
        return None
    quote = dialect.identifier_preparer.quote
    record = ", ".join(f"{quote(n)} {t}" for n, t in zip(names, types, strict=True))
    return f"json_to_recordset(CAST(:rows AS json)) AS v({record})", types


def _row_ids(target: str, rows: str, keys: tuple[str, ...], quote: Callable[[str], str]) -> str:
    """``rows`` with the ``ctid`` of each one's row in ``target`` (as ``saga_row``),
    looked up by the primary key ``keys``, one index lookup per row."""
    match = " AND ".join(f"r.{quote(k)} = v.{quote(k)}" for k in keys)
    return (
        f"(SELECT k.saga_row, v.* FROM {rows} CROSS JOIN LATERAL "  # noqa: S608
        f"(SELECT r.ctid AS saga_row FROM {target} AS r WHERE {match} OFFSET 0) AS k) AS v"
    )


def bulk_rows(rows: list[dict[str, Any]], keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """The parameters of a :func:`bulk_statement`: ``rows`` (column name -> value) as
    JSON, and for an update the values of each of its ``keys`` columns. ``None`` is SQL
    ``NULL`` (in a JSON column too, as ``JSON(none_as_null=True)`` stores it); decimals,
    UUIDs and times go as their text, which the column's type reads exactly."""
    params: dict[str, Any] = {"rows": json.dumps(rows, default=str, separators=(",", ":"))}
    for i, key in enumerate(keys):
        params[f"keys{i}"] = sorted({row[key] for row in rows}, key=str)
    return params


def one_of(column: Column[Any], values: list[Any], *, postgresql: bool) -> ColumnElement[bool]:
    """``column IN values``; on PostgreSQL ``column = ANY(:array::type[])``, whose
    text does not change with the number of values (so psycopg prepares it once)."""
    if not postgresql:
        return column.in_(values)
    array = ARRAY(column.type)
    return column == any_(bindparam(None, values, type_=array))  # psycopg casts it


def _same(value: Any) -> Any:
    return value


def _pk(table: Table) -> Column[Any]:
    return next(iter(table.primary_key.columns))


def sql_type(column: Column[Any], dialect: Any) -> str:
    """The SQL name of ``column``'s type on ``dialect`` (a :class:`CompileError` when it
    has none: a type reflection did not know)."""
    kind = column.type
    if isinstance(kind, sqltypes.NullType):
        raise sa_exc.CompileError(f"no type known for {column.name}")
    return str(kind.compile(dialect=dialect))


def _many_update(table: Table, columns: list[str]) -> tuple[Any, list[str]]:
    """``UPDATE table SET columns WHERE pk = ?`` for ``executemany``, and its parameter
    names (the key's first); names chosen not to clash with any column's."""
    taken = set(table.c.keys())
    prefix = "p"
    while any(name.startswith(prefix) for name in taken):
        prefix += "_"
    names = [f"{prefix}{i}" for i in range(len(columns) + 1)]
    statement = (
        update(table)
        .where(_pk(table) == bindparam(names[0]))
        .values({column: bindparam(names[i + 1]) for i, column in enumerate(columns)})
    )
    return statement, names


def as_stored(column: Column[Any], value: Any) -> Any:
    """``value`` as the column will hold it: a ``numeric(p, s)`` rounds to ``s`` places,
    half away from zero, as PostgreSQL does."""
    kind = column.type
    if isinstance(value, Decimal) and isinstance(kind, sqltypes.Numeric) and kind.scale is not None:
        step = Decimal(1).scaleb(-kind.scale)
        return value.quantize(step, rounding=ROUND_HALF_UP, context=_EXACT)
    return value


def add(current: Any, by: Any) -> Any:
    """``current + by`` exactly (decimals in an unbounded context, as SQL ``numeric``)."""
    if isinstance(current, Decimal) or isinstance(by, Decimal):
        return _EXACT.add(Decimal(current), Decimal(by))
    return current + by


def subtract(current: Any, by: Any) -> Any:
    """``current - by``, as :func:`add`."""
    if isinstance(current, Decimal) or isinstance(by, Decimal):
        return _EXACT.subtract(Decimal(current), Decimal(by))
    return current + -by
