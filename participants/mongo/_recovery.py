"""The staged writes of a MongoDB unit and the recovery of unfinished ones: the second
layer of :class:`~saga.participants.mongo._unit._MongoUnit` (see
:mod:`~saga.participants.mongo._unitbase` for the layers).

Reading a document settles it: the write whose marker it carries is recorded first
(rolled forward from its intent if need be), and a document a recorded delete marked is
removed and reads as absent. An unfinished intent found by whoever loads its step is
finished when its write happened (the marker is on the document), else fenced and
discarded. The package doc (:mod:`saga.participants.mongo`) gives the whole protocol.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from pymongo import errors as mongo_errors

from saga.participants._barrier import LedgerStatus
from saga.participants.mongo._errors import (
    _Conflict,
    _detail,
    _is_transient,
    _Refused,
    _Stale,
)
from saga.participants.mongo._holds import (
    fits_reservation,
    legacy_reservation_path,
    reservation_path,
)
from saga.participants.mongo._ledger import _now_ms, _split_step_id, _TxView
from saga.participants.mongo._shared import _StepRecord
from saga.participants.mongo._unitbase import _UnitBase
from saga.participants.mongo._values import MARKER_FIELD, Document
from saga.participants.mongo._writes import (
    DELETED,
    FENCED,
    DocumentWrite,
    _marker_names,
    _purge,
    _purge_field,
)

log = logging.getLogger("saga.participant.mongo")


class _UnitRecovery(_UnitBase):
    """Runs staged writes, settles the documents a unit reads, and resolves the unfinished
    writes it finds (see the module doc)."""

    def _write_document(
        self, staged: DocumentWrite, marker: str, discard: Callable[[], Any]
    ) -> None:
        try:
            self._run_staged(staged, marker)
        except (_Refused, _Conflict, _Stale):
            discard()
            raise

    def _run_staged(self, staged: DocumentWrite, marker: str) -> None:
        collection = self.storage.db[staged.target]
        for step_id in staged.drops:  # before the write: after it, they may be gone
            self._shared.reserved.pop(step_id)
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
        if not done and staged.optimistic:
            self._shared.settled.pop(self._lock_name(staged.target, staged.key))
            raise _Stale(f"{staged.target}/{staged.key} is not as this process last knew it")
        if not done:
            raise _Conflict(
                f"participant {self.storage.name!r}: {staged.target}/{staged.key} changed while "
                "a step was writing it; the batch will be retried"
            )
        if staged.reserves is not None:
            self._shared.reserved.put(staged.reserves, True)

    def _recorded(self, view: _TxView, step: int, staged: DocumentWrite, marker: str) -> None:
        """Step ``step`` records the write with ``marker``: remember that; after a delete
        (or a commit that leaves a shadow document), remove it (see :meth:`_purge_named`)."""
        self._shared.settled.put(self._lock_name(staged.target, staged.key), marker)
        doc = view.steps.get(step)
        if doc is not None and doc.get("purge") is not None:
            self._purge_named(view, step, doc)

    def _purge_named(self, view: _TxView, step: int, doc: Document) -> Document:
        """Remove the document a recorded delete marked (or the shadow document a recorded
        commit of an insert left, see :mod:`saga.participants.mongo._holds`), then the
        step's ``purge`` naming it.

        A step document names the document until it is removed, so that a crash in
        between leaves the removal to whoever next loads the step.
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
        if record.owner is self._batch:
            self._batch.flush_records()  # this storage's whole batch, in one insert
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
            self._batch.record_now(step_id)
            view.steps[step] = self._find_step(step_id)
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
            if self._happened(staged, current, marker):
                created = self._created(
                    view, step, {**intent["entry"], **_purge_field(staged, marker)}
                )
                try:
                    self._ledger.insert_one(created, session=session)
                except mongo_errors.DuplicateKeyError:
                    # Recorded meanwhile by someone else: take theirs.
                    view.steps.pop(step, None)
                    view.steps[step] = self._find_step(created["_id"])
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
            if self._happened(staged, current, marker):
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

    def _happened(self, staged: DocumentWrite, current: Document | None, marker: str) -> bool:
        """Whether the interrupted write ``staged`` took effect and stands. A reservation
        made without a read whose check failed, when the process died before putting the
        document back, took effect but does not stand: it is undone here (and its marker
        fenced), so the step counts as never applied."""
        if not staged.happened(current, marker):
            return False
        spec = staged.reserve
        if spec is None or current is None or fits_reservation(current, spec):
            return True
        step_id = str(spec["step"])
        paths = (reservation_path(step_id, str(spec["field"])), legacy_reservation_path(step_id))
        undo: Document = {"$unset": dict.fromkeys(paths, "")}
        undo["$set"] = {MARKER_FIELD: marker + FENCED}
        collection = self.storage.db[staged.target]
        session = self.transaction_session()
        self._cas.update(collection, staged.key, {MARKER_FIELD: marker}, undo, session)
        log.info("undid an unread reservation of %s/%s that did not fit", staged.target, staged.key)
        return False

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

    # -- holds (see :mod:`saga.participants.mongo._holds`)

    def known_marker(self, target: str, key: Any) -> str | None:
        """The marker the document (locked by this unit) carried when this process last
        recorded a write of it; ``None``: not known."""
        name = self._lock_name(target, key)
        record = self._shared.unrecorded.get(name)
        if record is not None:
            self._make_durable(record)
        return self._shared.settled.get(name)

    def hold_open(self, step_ids: list[str]) -> bool:
        """Whether a step among ``step_ids`` (a hold's holders) is still applied and
        undecided. Loading each step finishes what a crash left of it, such as the removal
        of a shadow document its recorded commit names."""
        for step_id in step_ids:
            parts = _split_step_id(step_id)
            if parts is None:
                continue
            participant, tx_id, step = parts
            doc = self._step(self._view(tx_id, participant), step)
            if doc is not None and doc.get("status") == str(LedgerStatus.APPLIED):
                return True
        return False
