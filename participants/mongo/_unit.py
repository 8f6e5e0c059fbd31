"""The write protocol of one MongoDB work item: a step's ledger entry recorded with the
one document write its action staged, in a transaction where the server has them, else
through an intent (see the package doc, :mod:`saga.participants.mongo`).

The top layer of :class:`_MongoUnit` (see :mod:`~saga.participants.mongo._unitbase` for
the layers).
"""

from __future__ import annotations

from pymongo import errors as mongo_errors

from saga.participants._barrier import LedgerEntry
from saga.participants._ledger import MARKER_STEP, SEEN_STEP
from saga.participants.mongo._batch import _DeferredIntent, _DeferredWrite
from saga.participants.mongo._cas import ABSENT
from saga.participants.mongo._errors import _Speculation
from saga.participants.mongo._ledger import (
    _decided,
    _decision_doc,
    _entry_fields,
    _may_be_decided,
    _now_ms,
    _pending_key,
    _seen_doc,
    _TxView,
)
from saga.participants.mongo._recovery import _UnitRecovery
from saga.participants.mongo._shared import _StepRecord
from saga.participants.mongo._values import Document
from saga.participants.mongo._writes import (
    DocumentWrite,
    _doc_id,
    _new_marker,
    _purge,
    _purge_field,
)


class _MongoUnit(_UnitRecovery):
    """One work item's reads and writes (the layers below: see the module doc)."""

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
            purge = _purge_field(staged, marker).get("purge")
            if purge is not None:  # in the same transaction: nothing is left to name it
                collection = self.storage.db[purge["target"]]
                session = self.transaction_session()
                _purge(collection, purge["key"], purge["marker"], session, self._cas)
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
                and self._batch.deferring
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
            if staged.idempotent:
                # Run again, it changes nothing: a crash before the record is healed by the
                # redelivered signal, which finds nothing left to do (see _holds). So the
                # write needs no intent, and its record may wait for the batch's end.
                if staged.filtered and self._batch.deferring:
                    self._defer_write(view, entry, current, fields, staged, marker)
                    return
                self._run_staged(staged, marker)
                if staged.kind == "delete":
                    _purge(self.storage.db[staged.target], staged.key, marker, None, self._cas)
                self._shared.settled.put(self._lock_name(staged.target, staged.key), marker)
                self._record_later(view, entry, current, fields)
                return
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
        intents* in :mod:`saga.participants.mongo`). The document's lock goes with it."""
        name = self._lock_name(staged.target, staged.key)
        held = [n for n in self._held if n == name]
        self._held = [n for n in self._held if n != name]
        deferred = _DeferredIntent(self, view, entry, staged, marker, fields, doc, held)
        self._batch.defer_intent(deferred)

    def _defer_write(
        self,
        view: _TxView,
        entry: LedgerEntry,
        current: Document,
        fields: Document,
        staged: DocumentWrite,
        marker: str,
    ) -> None:
        """Leave a ``filtered`` idempotent write (and its document lock) to the batch's
        bulk update, and its record to the batch's decision documents, which go in after
        it (``BatchWrites.flush_writes``): on FerretDB a bulk costs the server about half
        of one update per statement."""
        name = self._lock_name(staged.target, staged.key)
        held = [n for n in self._held if n == name]
        self._held = [n for n in self._held if n != name]
        for step_id in staged.drops:  # before the write: after it, they may be gone
            self._shared.reserved.pop(step_id)
        self._batch.defer_write(_DeferredWrite(self, view.tx_id, staged, marker, name, held))
        self._record_later(view, entry, current, fields)

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

    def _record_later(
        self, view: _TxView, entry: LedgerEntry, current: Document, fields: Document
    ) -> None:
        """Record a final entry in a decision document inserted with the batch's others
        (:func:`~saga.participants.mongo._ledger._decision_doc`); an entry that is not
        final, or of a step that is not applied, is recorded at once."""
        rev = int(current["rev"])
        finished = fields["finished_ms"]
        if finished is None or not _may_be_decided(current):
            self._update_step(view, entry, {"$set": {**fields, "rev": rev + 1}})
            return
        changed = {k: v for k, v in fields.items() if k != "finished_ms" and current.get(k) != v}
        known = current.get("finished_ms")
        if known is not None:
            finished = max(int(known), entry.updated_ms)
        decision = _decision_doc(current, changed, finished)
        view.steps[entry.step] = _decided(current, decision)
        self._batch.defer_decision(view.tx_id, decision)

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
                self._batch.defer(_StepRecord(self._batch, created, lock, marker))
                return
            self._insert_step(created, entry, None)
        self._recorded(view, entry.step, staged, marker)
