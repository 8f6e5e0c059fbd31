"""One work item's reads and writes on MongoDB: the write protocol of
:mod:`participants._mongo` (its module doc describes it) and the recovery of
unfinished writes.

Why this module is longer than 600 lines: it is one class, :class:`_MongoUnit`,
whose writes and recovery are one protocol that calls itself both ways: reading
a step or a document resolves the unfinished write it finds (roll forward or
back), which records through the same compare-and-set writes a new step uses,
under the same document locks and the same view of the ledger. Split in two, each
half would reach into a dozen private methods of the other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pymongo import errors as mongo_errors
from pymongo.client_session import ClientSession

from saga.participants._barrier import LedgerEntry
from saga.participants._ledger import MARKER_STEP, SEEN_STEP
from saga.participants._storage import Unit
from saga.participants.mongo._actions import MongoSession
from saga.participants.mongo._cas import ABSENT, _changed
from saga.participants.mongo._errors import (
    _Conflict,
    _detail,
    _is_transient,
    _Refused,
    _Speculation,
)
from saga.participants.mongo._ledger import (
    _check_tx_id,
    _entry_fields,
    _entry_of,
    _now_ms,
    _pending_key,
    _seen_doc,
    _split_step_id,
    _tx_doc_id,
    _TxView,
)
from saga.participants.mongo._shared import _StepRecord
from saga.participants.mongo._values import MARKER_FIELD, Document
from saga.participants.mongo._writes import (
    DELETED,
    FENCED,
    DocumentWrite,
    _doc_id,
    _marker_names,
    _new_marker,
    _purge,
    _purge_field,
)
from saga.streams import BusinessRejection

if TYPE_CHECKING:
    from saga.participants.mongo._adapter import MongoStorage


log = logging.getLogger("saga.participant.mongo")


@dataclass(frozen=True, slots=True, eq=False)
class _DeferredIntent:
    """A new step whose transaction document (with its creation intent) waits for the
    batch's ``insert_many``; its write and record run after that (see *Batched intents*
    in :mod:`participants._mongo`). ``locks``: the document lock, as often as the unit
    held it, released once the write is done or given up."""

    unit: _MongoUnit
    view: _TxView
    entry: LedgerEntry
    staged: DocumentWrite
    marker: str
    fields: Document
    doc: Document
    locks: list[tuple[str, str, str]]


class _MongoUnit(Unit[MongoSession]):
    """One work item's reads and writes; see the module doc for the write protocol.

    The unit sees each transaction's ledger documents through a :class:`_TxView`
    (remembered by the storage, or read). Every ledger write is a compare-and-set
    on the ``rev`` it saw (an insert when the document is absent): a worker that
    lost a race gets a :class:`TransientError`, never overwrites the other's record.
    ``speculate``: a request for a transaction the storage does not remember is
    run as new without reading the ledger (see the module doc). ``refused``: the
    staged writes the server refused in earlier attempts of the item (document ->
    the reason), so that this attempt fails the step instead.
    """

    def __init__(
        self,
        storage: MongoStorage,
        refused: dict[tuple[str, str], str],
        *,
        speculate: bool = False,
    ) -> None:
        self.storage = storage
        self.refused = refused
        self.native = MongoSession(self)
        self._ledger = storage.ledger_collection
        self._txs = storage.tx_collection
        self._cas = storage.cas
        self._shared = storage.shared
        self._views: dict[tuple[str, str], _TxView] = {}
        self._held: list[tuple[str, str, str]] = []
        self._session: ClientSession | None = None
        self._speculate = speculate and not storage.transactional

    # -- lifecycle

    def transaction_session(self) -> ClientSession | None:
        """The session whose transaction is open (transactional mode), opening one if needed."""
        if not self.storage.transactional:
            return None
        if self._session is None:
            self._session = self.storage.client.start_session()
        if not self._session.in_transaction:
            self._session.start_transaction()
        return self._session

    def close(self) -> None:
        """End the item: abort an unfinished transaction, release the document locks."""
        try:
            if self._session is not None:
                if self._session.in_transaction:
                    self._session.abort_transaction()
                self._session.end_session()
        finally:
            self._session = None
            self.release_locks()

    def finish(self, error: BaseException | None) -> None:
        """After a failure the storage forgets what this unit saw, so the next attempt
        reads the ledger again (not after a rejected confirmation, which changed
        nothing, nor a failed speculation, which read nothing it remembers)."""
        if error is not None and not isinstance(error, BusinessRejection | _Speculation):
            self.forget()

    def forget(self) -> None:
        """Make the storage forget what this unit saw: after a failure it reads again."""
        for participant, tx_id in self._views:
            if participant == self.storage.name:
                self.storage.tx_cache.pop(tx_id)

    def _lock_name(self, target: str, key: Any) -> tuple[str, str, str]:
        return (self.storage.lock_scope, target, _doc_id(target, key))

    def lock(self, target: str, key: Any) -> None:
        """Lock the document for this unit. A document an intent of this storage's batch
        holds (see *Batched intents* in :mod:`participants._mongo`), or a lock taken
        elsewhere while such intents hold theirs, first has the batch's intents run:
        no step reads a document before its pending write, and no unit waits while
        holding the locks of intents it would have to run."""
        name = self._lock_name(target, key)
        locks = self._shared.locks
        if not self.storage.intents_pending():
            locks.acquire(name)
        elif self.storage.intent_holds(name) or not locks.acquire(name, blocking=False):
            self.storage.flush_intents()
            locks.acquire(name)
        self._held.append(name)

    def holds(self, target: str, key: Any) -> bool:
        return self._lock_name(target, key) in self._held

    def unlock_last(self) -> None:
        self._shared.locks.release(self._held.pop())

    def release_locks(self) -> None:
        held, self._held = self._held, []
        for name in reversed(held):
            self._shared.locks.release(name)

    # -- views of the ledger

    def _remembered(self, tx_id: str) -> _TxView | None:
        if self.storage.intent_for(tx_id):
            self.storage.flush_intents()  # its transaction document is not inserted yet
        key = (self.storage.name, tx_id)
        view = self._views.get(key)
        if view is None and not self.storage.transactional:
            view = self.storage.tx_cache.get(tx_id)
            if view is not None:
                self._views[key] = view
        return view

    def _keep(self, view: _TxView) -> None:
        self._views[(view.participant, view.tx_id)] = view
        own = view.participant == self.storage.name
        if own and not view.speculative and not self.storage.transactional:
            self.storage.tx_cache.put(view.tx_id, view)

    def _view(self, tx_id: str, participant: str | None = None) -> _TxView:
        """The transaction's ledger documents as known, reading its document if need be."""
        participant = participant or self.storage.name
        if participant == self.storage.name:
            view = self._remembered(tx_id)
        else:
            view = self._views.get((participant, tx_id))
        if view is not None and not view.speculative:
            return view
        session = self.transaction_session()
        doc = self._txs.find_one({"_id": _tx_doc_id(participant, tx_id)}, session=session)
        if view is not None:
            if doc is not None:
                raise _Speculation(tx_id)
            view.speculative = False
            return view
        view = _TxView(participant, tx_id, doc)
        self._keep(view)
        return view

    def _entry_view(self, tx_id: str) -> _TxView:
        """As :meth:`_view`, but speculating that an unknown transaction is new."""
        view = self._remembered(tx_id)
        if view is not None:
            return view
        if self._speculate:
            view = _TxView(self.storage.name, tx_id, None, speculative=True)
            self._views[(self.storage.name, tx_id)] = view
            return view
        return self._view(tx_id)

    def _read_step(self, view: _TxView, step: int) -> Document | None:
        """The step document as stored (``None``: absent), without resolving anything."""
        if step not in view.steps:
            doc = None
            if view.listed(step):  # a step is listed before its document is created
                session = self.transaction_session()
                doc = self._ledger.find_one({"_id": view.step_id(step)}, session=session)
            view.steps[step] = doc
        return view.steps[step]

    def _step(self, view: _TxView, step: int) -> Document | None:
        """The step document (``None``: absent) once its unfinished write is resolved."""
        doc = self._read_step(view, step)
        if doc is None:
            intent = view.creation(step)
            if intent is not None:
                doc = self._resolve_creation(view, step, intent)
        elif doc.get("pending") is not None:
            doc = self._resolve_step(view, step, doc)
        if doc is not None and doc.get("purge") is not None:
            doc = self._purge_named(view, step, doc)
        return doc

    # -- reads

    def entry(self, tx_id: str, step: int) -> LedgerEntry | None:
        _check_tx_id(tx_id)
        doc = self._step(self._entry_view(tx_id), step)
        return None if doc is None or "status" not in doc else _entry_of(doc)

    def entries(self, tx_id: str) -> list[LedgerEntry]:
        _check_tx_id(tx_id)
        view = self._view(tx_id)
        if view.doc is None:
            return []
        docs = [self._step(view, step) for step in sorted(view.doc.get("steps", ()))]
        return [_entry_of(doc) for doc in docs if doc is not None and "status" in doc]

    def tx_rolled_back(self, tx_id: str) -> bool:
        view = self._entry_view(tx_id)
        return view.doc is not None and bool(view.doc.get("rolled_back"))

    def known_fingerprint(self, tx_id: str) -> str | None:
        _check_tx_id(tx_id)
        view = self._entry_view(tx_id)  # a speculated-new transaction has none
        fingerprint = None if view.doc is None else view.doc.get("fingerprint")
        return fingerprint if isinstance(fingerprint, str) else None

    # -- writes

    def write(self, entry: LedgerEntry) -> None:
        """Record ``entry`` with the write its action staged; the transaction-level
        markers (:data:`~participants._ledger.MARKER_STEP`,
        :data:`~participants._ledger.SEEN_STEP`) go into the transaction document."""
        staged = self.native.take_staged()
        try:
            if entry.step == MARKER_STEP:
                self._mark_rolled_back(self._view(entry.tx_id), entry)
            elif entry.step == SEEN_STEP:
                self._mark_seen(self._view(entry.tx_id), entry)
            else:
                view = self._views.get((self.storage.name, entry.tx_id)) or self._view(entry.tx_id)
                current = self._step(view, entry.step)
                if self.storage.transactional:
                    self._write_in_transaction(view, entry, current, staged)
                else:
                    self._write_through_intent(view, entry, current, staged)
            self._commit()
        finally:
            self.release_locks()

    def _mark_rolled_back(self, view: _TxView, marker: LedgerEntry) -> None:
        """Set ``rolled_back`` in the transaction document (inserted if absent)."""
        now_ms = marker.updated_ms
        rolled_back = {"reason": marker.reason, "updated_ms": now_ms}
        if view.doc is None:
            doc = {
                "_id": view.doc_id,
                "participant": view.participant,
                "tx_id": view.tx_id,
                "rev": 1,
                "steps": [],
                "rolled_back": rolled_back,
                "finished_ms": now_ms,
            }
            try:
                self._txs.insert_one(doc, session=self.transaction_session())
            except mongo_errors.DuplicateKeyError as exc:
                raise self._tx_raced(view.tx_id) from exc
            view.doc = doc
            self._keep(view)
        elif not view.doc.get("rolled_back"):
            rev = int(view.doc["rev"])
            change: Document = {"rolled_back": rolled_back, "rev": rev + 1}
            if not view.doc.get("steps"):
                change["finished_ms"] = max(int(view.doc.get("finished_ms") or 0), now_ms)
            self._update_tx(view, {"rev": rev}, {"$set": change})

    def _mark_seen(self, view: _TxView, marker: LedgerEntry) -> None:
        """Set ``seen`` and the fingerprint in the transaction document (inserted if absent),
        unless it knows a step or a fingerprint already."""
        seen = _seen_doc(view.participant, marker)
        if view.doc is None:
            try:
                self._txs.insert_one(seen, session=self.transaction_session())
            except mongo_errors.DuplicateKeyError as exc:
                raise self._tx_raced(view.tx_id) from exc
            view.doc = seen
            self._keep(view)
        elif not view.doc.get("steps") and not view.doc.get("fingerprint"):
            rev = int(view.doc["rev"])
            change = {k: seen[k] for k in ("seen", "fingerprint")}
            finished = max(int(view.doc.get("finished_ms") or 0), seen["finished_ms"])
            self._update_tx(
                view,
                {"rev": rev},
                {"$set": {**change, "finished_ms": finished, "rev": rev + 1}},
            )

    def rollback_effect(self) -> None:
        self.native.take_staged()
        if self._session is not None and self._session.in_transaction:
            # A custom handler may have written directly inside the transaction.
            self._session.abort_transaction()
        self.release_locks()

    def _commit(self) -> None:
        if self._session is not None and self._session.in_transaction:
            self._session.commit_transaction()

    def _created(self, view: _TxView, step: int, fields: Mapping[str, Any]) -> Document:
        return {
            "_id": view.step_id(step),
            "participant": view.participant,
            "tx_id": view.tx_id,
            "step": step,
            "rev": 1,
            **fields,
        }

    def _write_in_transaction(
        self,
        view: _TxView,
        entry: LedgerEntry,
        current: Document | None,
        staged: DocumentWrite | None,
    ) -> None:
        fields = _entry_fields(entry)
        if staged is not None:
            rev = 1 if current is None else int(current["rev"]) + 1
            marker = _new_marker(view.step_id(entry.step), rev, staged)
            self._run_staged(staged, marker)
            if staged.kind == "delete":
                collection = self.storage.db[staged.target]
                _purge(collection, staged.key, marker, self.transaction_session(), self._cas)
        if current is None:
            self._register(view, entry, None, self._created(view, entry.step, fields))
        else:
            rev = int(current["rev"])
            change = {"$set": {**fields, "rev": rev + 1}, "$unset": {"pending": ""}}
            self._update_step(view, entry, change)

    def _write_through_intent(
        self,
        view: _TxView,
        entry: LedgerEntry,
        current: Document | None,
        staged: DocumentWrite | None,
    ) -> None:
        """The module doc's protocol for one ledger entry and the write it records."""
        step = entry.step
        fields = _entry_fields(entry)
        if current is None:
            if staged is None:
                self._register(view, entry, None, self._created(view, step, fields))
                return
            marker = _new_marker(view.step_id(step), 1, staged)
            intent = self._intent(staged, marker, fields)
            if (
                view.doc is None
                and staged.kind != "delete"
                and self.storage.defers_intents()
                and self.holds(staged.target, staged.key)
            ):
                self._defer(view, entry, staged, marker, fields, self._tx_doc(view, entry, intent))
                return
            self._register(view, entry, intent, None)
            self._write_document(staged, marker, lambda: self._discard_creation(view, step, marker))
            self._finalise(view, entry, None, fields, staged, marker)
        else:
            rev = int(current["rev"])
            if staged is None:
                self._update_step(view, entry, {"$set": {**fields, "rev": rev + 1}})
                return
            marker = _new_marker(view.step_id(step), rev + 1, staged)
            intent = self._intent(staged, marker, fields)
            self._update_step(view, entry, {"$set": {"pending": intent, "rev": rev + 1}})
            discard = {"$set": {"rev": rev + 2}, "$unset": {"pending": ""}}
            self._write_document(staged, marker, lambda: self._update_step(view, entry, discard))
            self._finalise(view, entry, rev + 1, fields, staged, marker)

    def _defer(
        self,
        view: _TxView,
        entry: LedgerEntry,
        staged: DocumentWrite,
        marker: str,
        fields: Document,
        doc: Document,
    ) -> None:
        """Leave the new transaction document ``doc`` (holding the intent) to the batch's
        one ``insert_many``, and the write and its record to after it (see *Batched
        intents* in :mod:`participants._mongo`). The document's lock goes with it."""
        name = self._lock_name(staged.target, staged.key)
        held = [n for n in self._held if n == name]
        self._held = [n for n in self._held if n != name]
        deferred = _DeferredIntent(self, view, entry, staged, marker, fields, doc, held)
        self.storage.defer_intent(deferred)

    def run_deferred(self, deferred: _DeferredIntent) -> None:
        """The rest of :meth:`_write_through_intent` once ``deferred``'s transaction
        document is inserted: the write, then its record (with the next batch of records)."""
        view, entry, staged, marker = (
            deferred.view,
            deferred.entry,
            deferred.staged,
            deferred.marker,
        )
        view.doc = deferred.doc
        view.speculative = False
        self._keep(view)
        step = entry.step
        self._write_document(staged, marker, lambda: self._discard_creation(view, step, marker))
        self._finalise(view, entry, None, deferred.fields, staged, marker)

    def _intent(self, staged: DocumentWrite, marker: str, fields: Document) -> Document:
        return {
            "doc": _doc_id(staged.target, staged.key),
            "write": staged.to_bson(),
            "marker": marker,
            "entry": fields,
            "owner": self.storage.owner,
            "at_ms": _now_ms(),
        }

    def _register(
        self,
        view: _TxView,
        entry: LedgerEntry,
        intent: Document | None,
        created: Document | None,
    ) -> None:
        """List a new step in the transaction document (with its creation ``intent``), then
        insert its step document ``created`` if given; both by insert when the
        transaction is new."""
        step = entry.step
        session = self.transaction_session()
        if view.doc is None:
            doc = self._tx_doc(view, entry, intent)
            try:
                self._txs.insert_one(doc, session=session)
            except mongo_errors.DuplicateKeyError as exc:
                if view.speculative:
                    raise _Speculation(view.tx_id) from exc
                raise self._tx_raced(view.tx_id) from exc
            view.doc = doc
            view.speculative = False
            self._keep(view)
            if created is not None:
                self._insert_step(created, entry, session)
        else:
            rev = int(view.doc["rev"])
            change: Document = {"$set": {"rev": rev + 1}}
            expect: Document = {"rev": rev}
            if not view.listed(step):
                change["$addToSet"] = {"steps": step}
            if entry.fingerprint is not None and "fingerprint" not in view.doc:
                change["$set"]["fingerprint"] = entry.fingerprint
            if "finished_ms" in view.doc:
                change["$unset"] = {"finished_ms": ""}  # its steps decide from now on
            if intent is not None:
                change["$set"][f"pending.{_pending_key(step)}"] = intent
                expect[f"pending.{_pending_key(step)}"] = ABSENT
            self._update_tx(view, expect, change)
            if created is not None:
                self._insert_step(created, entry, session)
        if created is not None:
            view.steps[step] = created

    def _tx_doc(self, view: _TxView, entry: LedgerEntry, intent: Document | None) -> Document:
        """A new transaction document listing ``entry``'s step, with its creation ``intent``."""
        doc: Document = {
            "_id": view.doc_id,
            "participant": view.participant,
            "tx_id": view.tx_id,
            "rev": 1,
            "steps": [entry.step],
        }
        if entry.fingerprint is not None:
            doc["fingerprint"] = entry.fingerprint
        if intent is not None:
            doc["pending"] = {_pending_key(entry.step): intent}
        return doc

    def _insert_step(self, created: Document, entry: LedgerEntry, session: Any) -> None:
        try:
            self._ledger.insert_one(created, session=session)
        except mongo_errors.DuplicateKeyError as exc:
            raise self._raced(entry.tx_id, entry.step) from exc

    def _finalise(
        self,
        view: _TxView,
        entry: LedgerEntry,
        rev: int | None,
        fields: Document,
        staged: DocumentWrite,
        marker: str,
    ) -> None:
        """Record the entry once the write with ``marker`` took effect: create the step
        document (``rev`` ``None``), or set the entry and drop the intent.

        A new step's document is inserted with the storage's next batch of records
        (see :class:`_Unrecorded`), a delete's at once (the document is removed after).
        """
        fields = {**fields, **_purge_field(staged, marker)}
        if rev is not None:
            change = {"$set": {**fields, "rev": rev + 1}, "$unset": {"pending": ""}}
            self._update_step(view, entry, change)
        else:
            created = self._created(view, entry.step, fields)
            view.steps[entry.step] = created
            if staged.kind != "delete":
                lock = self._lock_name(staged.target, staged.key)
                self.storage.defer(_StepRecord(self.storage, created, lock, marker))
                return
            self._insert_step(created, entry, None)
        self._recorded(view, entry.step, staged, marker)

    def _update_step(
        self, view: _TxView, entry: LedgerEntry | tuple[str, int], change: Document
    ) -> Document:
        """Compare-and-set the step document on the ``rev`` last seen; the new document."""
        tx_id, step = (entry.tx_id, entry.step) if isinstance(entry, LedgerEntry) else entry
        current = view.steps[step]
        assert current is not None
        self.storage.record_now(current["_id"])
        ok = self._cas.update(
            self._ledger,
            current["_id"],
            {"rev": current["rev"]},
            change,
            self.transaction_session(),
        )
        if not ok:
            view.steps.pop(step, None)
            raise self._raced(tx_id, step)
        updated = _changed(current, change)
        view.steps[step] = updated
        return updated

    def _update_tx(self, view: _TxView, expect: Mapping[str, Any], change: Document) -> None:
        assert view.doc is not None
        ok = self._cas.update(self._txs, view.doc_id, expect, change, self.transaction_session())
        if not ok:
            raise self._tx_raced(view.tx_id)
        view.doc = _changed(view.doc, change)

    def _discard_creation(self, view: _TxView, step: int, marker: str) -> None:
        assert view.doc is not None
        rev = int(view.doc["rev"])
        key = f"pending.{_pending_key(step)}"
        self._update_tx(
            view,
            {"rev": rev, f"{key}.marker": marker},
            {"$set": {"rev": rev + 1}, "$unset": {key: ""}},
        )

    def _raced(self, tx_id: str, step: int) -> _Conflict:
        return _Conflict(
            f"participant {self.storage.name!r}: another worker recorded {tx_id} step "
            f"{step} at the same time; the batch will be retried"
        )

    def _tx_raced(self, tx_id: str) -> _Conflict:
        return _Conflict(
            f"participant {self.storage.name!r}: another worker recorded {tx_id} at the same "
            "time; the batch will be retried"
        )

    def _write_document(
        self, staged: DocumentWrite, marker: str, discard: Callable[[], Any]
    ) -> None:
        try:
            self._run_staged(staged, marker)
        except (_Refused, _Conflict):
            discard()
            raise

    def _run_staged(self, staged: DocumentWrite, marker: str) -> None:
        collection = self.storage.db[staged.target]
        try:
            done = staged.run(collection, marker, self.transaction_session(), self._cas)
        except mongo_errors.DocumentTooLarge as exc:
            reason = f"{staged.target}/{staged.key} would be too large a document ({exc})"
            raise _Refused(staged.target, staged.key, reason) from exc
        except mongo_errors.WriteError as exc:
            if _is_transient(exc):
                raise
            reason = f"{staged.target}/{staged.key}: the server refused the write ({_detail(exc)})"
            raise _Refused(staged.target, staged.key, reason) from exc
        if not done:
            raise _Conflict(
                f"participant {self.storage.name!r}: {staged.target}/{staged.key} changed while "
                "a step was writing it; the batch will be retried"
            )

    def _recorded(self, view: _TxView, step: int, staged: DocumentWrite, marker: str) -> None:
        """Step ``step`` records the write with ``marker``: remember that; after a delete,
        remove the document (see :meth:`_purge_named`)."""
        self._shared.settled.put(self._lock_name(staged.target, staged.key), marker)
        doc = view.steps.get(step)
        if doc is not None and doc.get("purge") is not None:
            self._purge_named(view, step, doc)

    def _purge_named(self, view: _TxView, step: int, doc: Document) -> Document:
        """Remove the document a recorded delete marked, then the step's ``purge`` naming it.

        A delete's step document names the document until it is removed, so that a
        crash in between leaves the removal to whoever next loads the step.
        """
        purge = doc["purge"]
        collection = self.storage.db[purge["target"]]
        _purge(collection, purge["key"], purge["marker"], self.transaction_session(), self._cas)
        return self._update_step(
            view,
            (view.tx_id, step),
            {"$set": {"rev": int(doc["rev"]) + 1}, "$unset": {"purge": ""}},
        )

    # -- recovery

    def settle(self, target: str, key: Any, doc: Document | None) -> Document | None:
        """``doc`` as read under its lock, once the write whose marker it carries is recorded.

        A document a recorded delete marked is removed here and reads as absent.
        """
        if doc is None:
            return None
        marker = doc.get(MARKER_FIELD)
        names = _marker_names(marker)
        if names is None:
            return doc
        assert isinstance(marker, str)
        name = self._lock_name(target, key)
        record = self._shared.unrecorded.get(name)
        if record is not None:
            self._make_durable(record)
        if self._shared.settled.get(name) != marker:
            self._ensure_recorded(names[0], marker)
            self._shared.settled.put(name, marker)
        if marker.endswith(DELETED):
            collection = self.storage.db[target]
            _purge(collection, key, marker, self.transaction_session(), self._cas)
            return None
        return doc

    def _make_durable(self, record: _StepRecord) -> None:
        if record.owner is self.storage:
            self.storage.flush_records()  # this storage's whole batch, in one insert
        else:
            self._shared.insert_records(self._ledger, [record])

    def _ensure_recorded(self, step_id: str, marker: str) -> None:
        """Finish the intent with ``marker`` if it is unresolved (its write happened)."""
        parts = _split_step_id(step_id)
        if parts is None:
            return
        participant, tx_id, step = parts
        view = self._view(tx_id, participant)
        if step not in view.steps:  # read even if unlisted: the marker says it was written
            session = self.transaction_session()
            view.steps[step] = self._ledger.find_one({"_id": step_id}, session=session)
        doc = view.steps[step]
        if doc is not None:
            pending = doc.get("pending")
            if pending is not None and pending.get("marker") == marker:
                self._resolve_step(view, step, doc)
            return
        intent = view.creation(step)
        if intent is not None and intent.get("marker") == marker:
            self._resolve_creation(view, step, intent)
            return
        log.warning("a document carries the marker %s, which no ledger record names", marker)

    def _live(self, intent: Mapping[str, Any]) -> bool:
        return intent.get("owner") != self.storage.owner and (
            _now_ms() - int(intent.get("at_ms", 0)) < self.storage.intent_lease_ms
        )

    def _in_progress(self, view: _TxView, step: int, staged: DocumentWrite) -> _Conflict:
        return _Conflict(
            f"participant {self.storage.name!r}: {staged.target}/{staged.key} has a "
            f"write of {view.tx_id} step {step} in progress by another worker; the batch "
            "will be retried"
        )

    def _resolve_creation(self, view: _TxView, step: int, intent: Document) -> Document | None:
        """Finish or undo the write that was to create ``step``'s document."""
        staged = DocumentWrite.from_bson(intent["write"])
        marker = intent["marker"]
        session = self.transaction_session()
        self.lock(staged.target, staged.key)
        try:
            record = self._shared.unrecorded.get(self._lock_name(staged.target, staged.key))
            if record is not None and record.marker == marker:
                self._make_durable(record)  # written by a live storage of this process
                view.steps[step] = record.doc
                return record.doc
            if self._live(intent):
                raise self._in_progress(view, step, staged)
            collection = self.storage.db[staged.target]
            current = collection.find_one({"_id": staged.key}, session=session)
            if staged.happened(current, marker):
                created = self._created(
                    view, step, {**intent["entry"], **_purge_field(staged, marker)}
                )
                try:
                    self._ledger.insert_one(created, session=session)
                except mongo_errors.DuplicateKeyError:
                    # Recorded meanwhile by someone else: take theirs.
                    view.steps.pop(step, None)
                    view.steps[step] = self._ledger.find_one({"_id": created["_id"]})
                    return self._step(view, step)
                view.steps[step] = created
                self._recorded(view, step, staged, marker)
                log.info("finished the interrupted write of %s", view.step_id(step))
                return view.steps[step]
            self._fence(staged, current, marker)
            self._discard_creation(view, step, marker)
            view.steps[step] = None
            log.info("undid the interrupted write of %s", view.step_id(step))
            return None
        finally:
            self.unlock_last()

    def _resolve_step(self, view: _TxView, step: int, doc: Document) -> Document:
        """Finish or undo the write recorded as ``pending`` in step document ``doc``."""
        pending = doc["pending"]
        staged = DocumentWrite.from_bson(pending["write"])
        marker = pending["marker"]
        self.lock(staged.target, staged.key)
        try:
            if self._live(pending):
                raise self._in_progress(view, step, staged)
            collection = self.storage.db[staged.target]
            current = collection.find_one({"_id": staged.key}, session=self.transaction_session())
            rev = int(doc["rev"])
            if staged.happened(current, marker):
                fields = {**pending["entry"], **_purge_field(staged, marker)}
                change = {"$set": {**fields, "rev": rev + 1}, "$unset": {"pending": ""}}
                self._update_step(view, (view.tx_id, step), change)
                self._recorded(view, step, staged, marker)
                log.info("finished the interrupted write of %s", doc["_id"])
                updated = view.steps[step]
                assert updated is not None
                return updated
            self._fence(staged, current, marker)
            change = {"$set": {"rev": rev + 1}, "$unset": {"pending": ""}}
            updated = self._update_step(view, (view.tx_id, step), change)
            log.info("undid the interrupted write of %s", doc["_id"])
            return updated
        finally:
            self.unlock_last()

    def _fence(self, staged: DocumentWrite, current: Document | None, marker: str) -> None:
        """Make a write that did not happen miss for good, should a paused worker still run it."""
        if staged.kind == "insert" or current is None:
            return  # an insert misses once the document exists; nothing to fence on absence
        if current.get(MARKER_FIELD) != staged.expect:
            return  # changed since the intent was written: the write can no longer match
        self._cas.update(
            self.storage.db[staged.target],
            staged.key,
            {MARKER_FIELD: staged.expect},
            {"$set": {MARKER_FIELD: marker + FENCED}},
            self.transaction_session(),
        )
