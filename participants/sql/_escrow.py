"""Commit decisions of ``read_committed`` increments, settled in the database: escrow's common case.

Under ``read_committed`` an increment only reserves at apply; its commit removes the
reservation from the holds table and adds ``by`` to the field
(:meth:`~participants.sql._isolation.IsolatedRecord.commit`). Through the per-step
path that commit reads the row locked and its holds into the batch, plans it in
Python and writes both back. On PostgreSQL, a batch without savepoints settles the
common case in one statement per ``(table, field)`` instead, sent in the pipeline
that reads the rest of the batch's rows::

    WITH k AS (the steps: record, tx_id, step)
    , gone AS (DELETE FROM ledger_holds ... each step's reservation, by primary key)
    , changed AS (UPDATE accounts SET balance = balance + v.by
                  FROM (each key's sum, computed here) AS v
                  WHERE ... AND balance IS NOT NULL AND (SELECT count(*) FROM gone) = <steps>
                  RETURNING id)
    SELECT (SELECT count(*) FROM gone), ARRAY(SELECT id FROM changed)

A row that is gone, or whose field is ``NULL``, gets nothing, and the log says so, as on
the per-step path. A reservation gone already (a decision replayed) must add nothing:
then the statement adds nothing at all, and the batch runs again carefully, where the
per-step path tells which. Escrow checked every bound and the column's range when the
step reserved, so the addition can break neither.

Which decisions: a ``commit`` whose transaction has no other item in the batch and
whose every step here is an ``applied`` ``read_committed`` ``increment`` of an integer
or exact numeric column (floats stay on the per-step path, which adds them one by
one), on records no other item of the batch touches (the batch's copy of the rows
must not hold a value read before the addition). Everything else, a careful batch
included, takes the per-step path. Their ledger entries become ``committed`` in the
batch's view and their ``committed`` events are reported, as the per-step path does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import Column, Table
from sqlalchemy.engine import Dialect
from sqlalchemy.sql import sqltypes

from saga.participants._barrier import LedgerEntry, LedgerStatus, isolation_of
from saga.participants._storage import (
    DecisionArrived,
    Report,
    StepScope,
    WorkItem,
)
from saga.participants.sql._actions import NeedsSavepoints
from saga.participants.sql._holds import Record
from saga.participants.sql._isolation import nothing_to_write
from saga.participants.sql._ledger import BatchLedger
from saga.participants.sql._rows import bulk_rows, sql_type
from saga.participants.sql._values import coerce, record_text
from saga.streams import BusinessRejection, Isolation, Outcome, StepStatus

if TYPE_CHECKING:  # psycopg is PostgreSQL's driver: SQLite runs without it
    import psycopg

_STATEMENT: Final = (
    "WITH k AS (SELECT * FROM json_to_recordset(CAST(%(steps)s AS json)) "
    "AS k(saga_record text, saga_tx text, saga_step integer, saga_now bigint)), "
    "gone AS (DELETE FROM {holds} WHERE ctid = ANY(ARRAY(SELECT h.ctid FROM k CROSS JOIN LATERAL "
    "(SELECT r.ctid FROM {holds} AS r WHERE r.target = %(target)s AND r.record = k.saga_record "
    "AND r.field = %(field)s AND r.tx_id = k.saga_tx AND r.step = k.saga_step OFFSET 0) AS h)) "
    "RETURNING 1), "
    "changed AS (UPDATE {table} AS t SET {field} = t.{field} + v.saga_by "
    "FROM json_to_recordset(CAST(%(rows)s AS json)) AS v(saga_key {key_type}, saga_by {by_type}) "
    "WHERE t.{pk} = v.saga_key AND t.{pk} = ANY(CAST(%(keys0)s AS {key_type}[])) "
    "AND t.{field} IS NOT NULL AND (SELECT count(*) FROM gone) = %(count)s "
    "RETURNING t.{pk} AS saga_key), "
    "done AS (UPDATE {ledger} AS t SET status = 'committed', updated_ms = v.saga_now, "
    "finished_ms = GREATEST(t.deadline_ms, v.saga_now) FROM (SELECT k.saga_now, e.saga_row "
    "FROM k CROSS JOIN LATERAL (SELECT r.ctid AS saga_row FROM {ledger} AS r "
    "WHERE r.participant = %(participant)s AND r.tx_id = k.saga_tx AND r.step = k.saga_step "
    "OFFSET 0) AS e) AS v WHERE t.ctid = v.saga_row) "
    "SELECT (SELECT count(*) FROM gone), ARRAY(SELECT saga_key FROM changed)"
)
"""One ``(table, field)``'s commits: each step's reservation removed (found by the holds'
primary key), then, when every one was there, each row's sum added, and each step's
ledger entry marked ``committed`` (as :func:`~participants._barrier.finished_ms` says:
finished at the later of its deadline and now; the batch holds it locked). Names come from the
reflected tables and are quoted by the dialect; every value is bound (psycopg's parameter
style). The rows are found as :func:`~participants.sql._rows.bulk_statement` finds them
(``= ANY`` of their keys bound as an array): joined to sums computed in the statement,
which the planner took for one row, it scanned the key's index once per row and key
(found by the bench: PostgreSQL's CPU per saga tripled). It returns how many
reservations it removed and the keys of the rows it added to."""


@dataclass(frozen=True, slots=True)
class _Step:
    """One step's reservation to commit."""

    entry: LedgerEntry
    table: Table
    column: Column[Any]
    record: str
    key: Any
    by: Any


class EscrowCommits:
    """The commit decisions of one batch that the database settles (see the module doc)."""

    def __init__(
        self,
        participant: str,
        items: Sequence[WorkItem],
        ledger: BatchLedger,
        tables: Mapping[str, Table],
        holds: Table,
    ) -> None:
        self._participant = participant
        self._ledger = ledger
        self._holds = holds
        self._now: dict[str, int] = {}
        self._steps: dict[str, list[_Step]] = {}
        self.reports: dict[str, list[Report]] = {}
        """By transaction: the events of the decisions settled here (filled by :meth:`send`'s
        call)."""
        per_tx = Counter(item.tx_id for item in items)
        for item in items:
            if (
                isinstance(item, DecisionArrived)
                and item.outcome is Outcome.COMMIT
                and per_tx[item.tx_id] == 1
            ):
                steps = _reservations(ledger.entries(item.tx_id), tables)
                if steps:
                    self._steps[item.tx_id] = steps
                    self._now[item.tx_id] = item.now_ms

    def __bool__(self) -> bool:
        return bool(self._steps)

    def others(self, items: Iterable[WorkItem]) -> list[WorkItem]:
        """``items`` less the decisions settled here."""
        return [
            item
            for item in items
            if not (isinstance(item, DecisionArrived) and item.tx_id in self._steps)
        ]

    def keep_apart(self, records: set[Record]) -> bool:
        """Leave to the per-step path the decisions that touch ``records`` (the other items'
        records); whether any was left."""
        touching = [
            tx_id
            for tx_id, steps in self._steps.items()
            if any((s.table.name, s.record) in records for s in steps)
        ]
        for tx_id in touching:
            del self._steps[tx_id]
        return bool(touching)

    def send(self, driver: psycopg.Connection[Any], dialect: Dialect) -> Callable[[], None]:
        """Send the statements into the pipeline ``driver`` is in; the returned call, made
        after the pipeline, logs the steps that found nothing to write and marks every
        settled step ``committed`` in the batch's ledger view."""
        groups: dict[tuple[str, str], list[_Step]] = {}
        for steps in self._steps.values():
            for step in steps:
                groups.setdefault((step.table.name, step.column.name), []).append(step)
        cursors = []
        holds = dialect.identifier_preparer.format_table(self._holds)
        ledger = dialect.identifier_preparer.format_table(self._ledger.table)
        quote = dialect.identifier_preparer.quote
        for (_, field), steps in sorted(groups.items()):
            table, column = steps[0].table, steps[0].column
            pk = next(iter(table.primary_key.columns))
            sql = _STATEMENT.format(
                key_type=sql_type(pk, dialect),
                by_type=sql_type(column, dialect),
                holds=holds,
                ledger=ledger,
                table=dialect.identifier_preparer.format_table(table),
                field=quote(field),
                pk=quote(pk.name),
            )
            sums: dict[Any, Any] = {}
            for step in steps:
                sums[step.key] = sums.get(step.key, 0) + step.by
            rows = [{"saga_key": key, "saga_by": by} for key, by in sums.items()]
            reserved = [
                {
                    "saga_record": s.record,
                    "saga_tx": s.entry.tx_id,
                    "saga_step": s.entry.step,
                    "saga_now": self._now[s.entry.tx_id],
                }
                for s in steps
            ]
            params = {
                **bulk_rows(rows, ("saga_key",)),
                "steps": bulk_rows(reserved)["rows"],
                "target": table.name,
                "field": column.name,
                "count": len(steps),
                "participant": self._participant,
            }
            cursor = driver.cursor()
            cursor.execute(sql, params)
            cursors.append((cursor, pk, steps))

        def read() -> None:
            for cursor, pk, steps in cursors:
                with cursor:
                    removed, changed = cursor.fetchone() or (0, [])
                if removed != len(steps):
                    # A reservation gone already (a decision replayed): the per-step path
                    # tells which, and adds nothing for it.
                    raise NeedsSavepoints
                # as read back (a char(n) key padded, a numeric one with its scale's zeros)
                added = {*changed, *(record_text(pk, key) for key in changed)}
                for step in steps:
                    if step.key not in added and step.record not in added:
                        scope = StepScope(
                            step.entry.tx_id, step.entry.step, Isolation.READ_COMMITTED
                        )
                        nothing_to_write(scope, f"{step.table.name}/{step.record}")
            for tx_id, steps in self._steps.items():
                now = self._now[tx_id]
                reports = []
                for step in steps:
                    committed = replace(step.entry, status=LedgerStatus.COMMITTED, updated_ms=now)
                    self._ledger.stored(committed)
                    reports.append(Report(tx_id, step.entry.step, StepStatus.COMMITTED))
                self.reports[tx_id] = reports

        return read


def _reservations(entries: list[LedgerEntry], tables: Mapping[str, Table]) -> list[_Step] | None:
    """The reservations that commit the transaction whose step entries are ``entries``,
    or ``None`` when one of them is not such a reservation (the per-step path decides).

    The entries were applied here by the built-in increment (a batch without savepoints
    has no custom handler), which checked their arguments and confirms under
    ``read_committed``; what is checked again is only what this path relies on."""
    steps: list[_Step] = []
    for entry in entries:
        args = entry.args
        if (
            entry.status is not LedgerStatus.APPLIED
            or entry.action != "increment"
            or not isinstance(args, Mapping)
            or isolation_of(entry.before) is not Isolation.READ_COMMITTED
        ):
            return None
        target, key, field, by = (args.get(n) for n in ("target", "key", "field", "by"))
        table = tables.get(target) if isinstance(target, str) else None
        if (
            table is None
            or not isinstance(field, str)
            or not isinstance(key, str | int)
            or not isinstance(by, int | float)
            or isinstance(key, bool)
            or isinstance(by, bool)
        ):
            return None
        pk = next(iter(table.primary_key.columns))
        column = table.c.get(field)
        if column is None or column is pk or not _exact(column):
            return None
        try:
            coerced, amount = coerce(pk, key, "key"), coerce(column, by, "the increment")
        except BusinessRejection:
            return None
        if coerced is None or amount is None:
            return None
        steps.append(_Step(entry, table, column, record_text(pk, coerced), coerced, amount))
    return steps or None


def _exact(column: Column[Any]) -> bool:
    """An integer or exact numeric column (whose sum does not depend on the order of the
    additions)."""
    kind = column.type
    if isinstance(kind, sqltypes.Integer):
        return True
    return isinstance(kind, sqltypes.Numeric) and bool(kind.asdecimal)


__all__ = ["EscrowCommits"]
