"""What one MongoDB storage's batch leaves to do together: the transaction documents of
its new transactions (*Batched intents* in :mod:`saga.participants.mongo`), the step
documents of its new steps (:class:`~saga.participants.mongo._shared._Unrecorded`) and
the records of its decisions that wrote idempotently (:meth:`BatchWrites.defer_decision`).

Units hand their deferred work to the storage's :class:`BatchWrites`; the storage
flushes it when the batch ends, and units flush it earlier whenever something would
look past it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from pymongo import UpdateOne
from pymongo import errors as mongo_errors
from pymongo.collection import Collection

from saga.participants._barrier import LedgerEntry
from saga.participants._storage import RunBatchAgain
from saga.participants.mongo._errors import (
    _DUPLICATE_KEY,
    _Conflict,
    _detail,
    _Refused,
    _Stale,
)
from saga.participants.mongo._ledger import DECISION_SUFFIX, _TxView
from saga.participants.mongo._shared import SharedState, _Lru, _StepRecord
from saga.participants.mongo._values import Document
from saga.participants.mongo._writes import DocumentWrite

if TYPE_CHECKING:
    from saga.participants.mongo._unit import _MongoUnit

log = logging.getLogger("saga.participant.mongo")

Lock = tuple[str, str, str]


@dataclass(frozen=True, slots=True, eq=False)
class _DeferredIntent:
    """A new step whose transaction document (with its creation intent) waits for the
    batch's ``insert_many``; its write and record run after that (see *Batched intents*
    in :mod:`saga.participants.mongo`). ``locks``: the document lock, as often as the
    unit held it, released once the write is done or given up."""

    unit: _MongoUnit
    view: _TxView
    entry: LedgerEntry
    staged: DocumentWrite
    marker: str
    fields: Document
    doc: Document
    locks: list[Lock]


@dataclass(frozen=True, slots=True, eq=False)
class _DeferredWrite:
    """A ``filtered`` idempotent write (the commit of a reservation this process knows,
    see ``MongoActions._settle_reservation``) left to the batch's bulk update
    (:meth:`BatchWrites.flush_writes`); ``locks``: the document lock, released once the
    write is done or given up."""

    unit: _MongoUnit
    tx_id: str
    staged: DocumentWrite
    marker: str
    lock: Lock
    locks: list[Lock]


WRITES_PER_BULK: Final = 32
"""Statements per bulk update. FerretDB v1 keeps each statement's query open until the
whole command ends, each on a connection of its own, and its SQLite pool has 100: one
bulk of 100 updates once waited for ever."""


class BatchWrites:
    """The deferred work of one storage's batch.

    ``deferring``: whether a new transaction's document may wait for the batch's
    ``insert_many`` (a first attempt without transactions, set by the storage).
    """

    def __init__(
        self,
        name: str,
        tx_collection: Collection[Document],
        ledger_collection: Collection[Document],
        shared: SharedState,
        tx_cache: _Lru[str, _TxView],
    ) -> None:
        self.name = name
        self.tx_collection = tx_collection
        self.ledger_collection = ledger_collection
        self.shared = shared
        self.tx_cache = tx_cache
        self.deferring = False
        self._intents: list[_DeferredIntent] = []
        self._intent_locks: set[Lock] = set()
        self._intent_txs: set[str] = set()
        self._unrecorded: dict[str, _StepRecord] = {}
        self._decisions: dict[str, tuple[str, Document]] = {}
        self._writes: list[_DeferredWrite] = []
        self._write_locks: set[Lock] = set()

    # -- batched intents

    def intents_pending(self) -> bool:
        """Whether the batch holds document locks for writes still to run (its pending
        intents and its deferred writes)."""
        return bool(self._intents) or bool(self._writes)

    def intent_holds(self, lock: Lock) -> bool:
        """Whether a pending intent or deferred write of the batch holds the document
        lock ``lock``."""
        return lock in self._intent_locks or lock in self._write_locks

    def flush_pending(self) -> None:
        """Run the pending intents, then the deferred writes."""
        try:
            self.flush_intents()
        finally:
            self.flush_writes()

    def intent_for(self, tx_id: str) -> bool:
        """Whether a pending intent of the batch belongs to transaction ``tx_id``."""
        return tx_id in self._intent_txs

    def defer_intent(self, deferred: _DeferredIntent) -> None:
        self._intents.append(deferred)
        self._intent_locks.add(deferred.locks[0])
        self._intent_txs.add(deferred.view.tx_id)

    def flush_intents(self) -> None:
        """Insert the pending transaction documents in one ``insert_many``, then run the
        writes of those inserted, in batch order; their records join the next batch of
        records. Every pending document lock is released at the end, whatever happened.

        A document found already there (the transaction is known: the request ran on a
        guess, or another worker got there first), a write the server refused or one
        that found its document changed (its intent is discarded, as on the one-by-one
        path; an optimistic write that missed is one) make the batch run again
        (:class:`RunBatchAgain`), once the others are done: the second attempt runs item
        by item and reads what it needs.
        """
        group = self._take_intents()
        if not group:
            return
        try:
            again = False
            skipped: set[int] = set()
            try:
                self.tx_collection.insert_many([d.doc for d in group], ordered=False)
            except mongo_errors.BulkWriteError as exc:
                errors = exc.details.get("writeErrors") or []
                if not errors or any(error.get("code") != _DUPLICATE_KEY for error in errors):
                    raise
                skipped = {int(error["index"]) for error in errors}
                again = True
            for index, deferred in enumerate(group):
                if index in skipped:
                    continue
                try:
                    deferred.unit.run_deferred(deferred)
                except (_Refused, _Conflict, _Stale):
                    deferred.unit.forget()
                    again = True
        finally:
            self._release(group)
        if again:
            raise RunBatchAgain

    def drop_intents(self) -> None:
        """Give up the pending intents after a failure: nothing of them was written."""
        self._release(self._take_intents())

    def _take_intents(self) -> list[_DeferredIntent]:
        group, self._intents = self._intents, []
        self._intent_locks.clear()
        self._intent_txs.clear()
        return group

    def _release(self, group: list[_DeferredIntent]) -> None:
        for deferred in group:
            for name in reversed(deferred.locks):
                self.shared.locks.release(name)

    # -- deferred writes

    def defer_write(self, deferred: _DeferredWrite) -> None:
        self._writes.append(deferred)
        self._write_locks.add(deferred.lock)

    def flush_writes(self) -> None:
        """Run the deferred writes, in bulks of :data:`WRITES_PER_BULK` updates by
        ``_id`` (each with its conditions in its filter, which the server checks before
        it writes); every document lock they hold is released at the end.

        A write that missed (its document is not as this process knew it) or a bulk the
        server refused make the batch run again (:class:`RunBatchAgain`): the second
        attempt runs item by item, each write at once, and reads what it needs. The
        writes that took effect are idempotent: run again, they find nothing to do.
        """
        group, self._writes = self._writes, []
        self._write_locks.clear()
        if not group:
            return
        try:
            missed = self._bulk(group)
        except BaseException:
            for deferred in group:  # which of them took effect is not known
                self.shared.settled.pop(deferred.lock)
            raise
        finally:
            for deferred in group:
                for name in reversed(deferred.locks):
                    self.shared.locks.release(name)
        for deferred in group:
            if deferred in missed:
                self.shared.settled.pop(deferred.lock)
                deferred.unit.forget()
            else:
                self.shared.settled.put(deferred.lock, deferred.marker)
        if missed:
            raise RunBatchAgain

    def _bulk(self, group: list[_DeferredWrite]) -> list[_DeferredWrite]:
        """Run ``group``'s writes; those that did not take effect."""
        database = self.tx_collection.database
        missed: list[_DeferredWrite] = []
        targets: dict[str, list[_DeferredWrite]] = {}
        for deferred in group:
            targets.setdefault(deferred.staged.target, []).append(deferred)
        for target, writes in targets.items():
            collection = database[target]
            for at in range(0, len(writes), WRITES_PER_BULK):
                chunk = writes[at : at + WRITES_PER_BULK]
                ops = [UpdateOne(*d.staged.filtered_update(d.marker)) for d in chunk]
                try:
                    done = collection.bulk_write(ops, ordered=False).matched_count
                except mongo_errors.BulkWriteError as exc:
                    log.info("participant %r: a bulk update was refused (%s)", self.name, exc)
                    done = -1
                if done != len(chunk):
                    for d in chunk:
                        found = collection.find_one({"_id": d.staged.key})
                        if not d.staged.happened(found, d.marker):
                            missed.append(d)
        return missed

    def drop_writes(self) -> None:
        """Give the deferred writes up after a failure (none of them was run): their
        decisions run again, and what the storage remembered of them is forgotten."""
        group, self._writes = self._writes, []
        self._write_locks.clear()
        for deferred in group:
            for name in reversed(deferred.locks):
                self.shared.locks.release(name)
        self._forget(deferred.tx_id for deferred in group)

    # -- deferred step documents

    def defer(self, record: _StepRecord) -> None:
        """Insert ``record`` with the next batch of records (see :class:`_Unrecorded`)."""
        self._unrecorded[record.doc["_id"]] = record
        self.shared.unrecorded.add(record)

    def record_now(self, step_id: str) -> None:
        """Make sure the step document ``step_id`` is inserted, and its deferred decision
        record, before it is read or changed."""
        if step_id in self._unrecorded:
            self.flush_records()
        if step_id in self._decisions:
            self.flush_decisions()

    def flush_records(self, *, quietly: bool = False) -> None:
        """Insert the step documents deferred so far, in one ``insert_many``.

        ``quietly``: a failure is logged, not raised (another error is on its way);
        the records stay registered, so they are inserted by the next flush or by
        whoever touches their documents first, and their intents cover a crash.
        """
        if not self._unrecorded:
            return
        records = list(self._unrecorded.values())
        try:
            self.shared.insert_records(self.ledger_collection, records)
        except mongo_errors.PyMongoError as exc:
            if not quietly:
                raise
            log.warning(
                "participant %r could not record %d applied steps yet (%s); they are recorded "
                "later, or recovered from their intents",
                self.name,
                len(records),
                _detail(exc),
            )
            return
        for record in records:
            self._unrecorded.pop(record.doc["_id"], None)

    # -- deferred decision records

    def defer_decision(self, tx_id: str, decision: Document) -> None:
        """Insert the decision document ``decision`` (see
        :func:`~saga.participants.mongo._ledger._decision_doc`) with the batch's others.

        For a decision whose write is idempotent (see :mod:`saga.participants.mongo._holds`):
        until its document is inserted, its step reads as still applied in the store, and
        the decision, should it come again after a crash, finds nothing left to write and
        records itself. The decision documents of a batch are inserted together at its
        end, in one ``insert_many`` (see :meth:`flush_decisions`), where updating each step
        document would cost FerretDB a command per step.
        """
        self._decisions[decision["_id"][: -len(DECISION_SUFFIX)]] = (tx_id, decision)

    def flush_decisions(self) -> None:
        """Insert the deferred decision documents, after the deferred writes they record."""
        self.flush_writes()
        decisions, self._decisions = self._decisions, {}
        if not decisions:
            return
        try:
            try:
                self.ledger_collection.insert_many(
                    [doc for _, doc in decisions.values()], ordered=False
                )
            except mongo_errors.BulkWriteError as exc:
                # One already there was recorded by an earlier run of the same decision.
                errors = exc.details.get("writeErrors") or []
                if not errors or any(error.get("code") != _DUPLICATE_KEY for error in errors):
                    raise
        except BaseException:
            self._forget(tx_id for tx_id, _ in decisions.values())
            raise

    def drop_decisions(self) -> None:
        """Give the deferred decision records up after a failure: their decisions run again
        (and find nothing left to write), and what the storage remembered of them is
        forgotten."""
        decisions, self._decisions = self._decisions, {}
        self._forget(tx_id for tx_id, _ in decisions.values())

    def _forget(self, tx_ids: Iterable[str]) -> None:
        for tx_id in tx_ids:
            self.tx_cache.pop(tx_id)
