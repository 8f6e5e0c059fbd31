"""One work item's view of the MongoDB ledger: its lifecycle, the document locks, the
transaction and step documents it knows, and the compare-and-set writes of ledger
documents (the base of :class:`~saga.participants.mongo._unit._MongoUnit`).

The layers of a unit, each a module: this base (what a unit sees and how it changes one
ledger document), :mod:`~saga.participants.mongo._recovery` (the staged writes and the
recovery of unfinished ones) and :mod:`~saga.participants.mongo._unit` (the write
protocol of a step). Loading a step resolves the unfinished write it finds, so the base
names the three recovery methods it calls (:meth:`_UnitBase._resolve_creation`,
:meth:`_UnitBase._resolve_step`, :meth:`_UnitBase._purge_named`) and the recovery layer
implements them.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pymongo import errors as mongo_errors
from pymongo.client_session import ClientSession

from saga.participants._barrier import LedgerEntry
from saga.participants._storage import Unit
from saga.participants.mongo._cas import _changed
from saga.participants.mongo._errors import _Conflict, _Speculation, _Stale
from saga.participants.mongo._ledger import (
    _check_tx_id,
    _entry_of,
    _find_step,
    _pending_key,
    _tx_doc_id,
    _TxView,
)
from saga.participants.mongo._session import MongoSession
from saga.participants.mongo._values import Document
from saga.participants.mongo._writes import _doc_id
from saga.streams import BusinessRejection

if TYPE_CHECKING:
    from saga.participants.mongo._adapter import MongoStorage

Lock = tuple[str, str, str]


class _UnitBase(Unit[MongoSession]):
    """One work item's reads and writes; see :mod:`saga.participants.mongo` for the write
    protocol.

    The unit sees each transaction's ledger documents through a :class:`_TxView`
    (remembered by the storage, or read). Every ledger write is a compare-and-set
    on the ``rev`` it saw (an insert when the document is absent): a worker that
    lost a race gets a :class:`TransientError`, never overwrites the other's record.
    ``speculate``: a request for a transaction the storage does not remember is
    run as new without reading the ledger (see the package doc). ``refused``: the
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
        self._batch = storage.batch
        self._ledger = storage.ledger_collection
        self._txs = storage.tx_collection
        self._cas = storage.cas
        self._shared = storage.shared
        self._views: dict[tuple[str, str], _TxView] = {}
        self._held: list[Lock] = []
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
        nothing, nor a failed speculation, which read nothing it remembers, nor an
        optimistic write that missed, which only knew the document wrong)."""
        if error is not None and not isinstance(error, BusinessRejection | _Speculation | _Stale):
            self.forget()

    def forget(self) -> None:
        """Make the storage forget what this unit saw: after a failure it reads again."""
        for participant, tx_id in self._views:
            if participant == self.storage.name:
                self.storage.tx_cache.pop(tx_id)

    def _lock_name(self, target: str, key: Any) -> Lock:
        """The lock of a document: one per business record, shared by its shadow document
        (see :mod:`saga.participants.mongo._holds`), whose key names the record."""
        if target == self.storage.shadow_collection.name and isinstance(key, str):
            return (self.storage.lock_scope, key.partition("/")[0], key)
        return (self.storage.lock_scope, target, _doc_id(target, key))

    def lock(self, target: str, key: Any) -> None:
        """Lock the document for this unit. A document an intent of this storage's batch
        holds (see *Batched intents* in :mod:`saga.participants.mongo`), or a lock taken
        elsewhere while such intents hold theirs, first has the batch's intents run:
        no step reads a document before its pending write, and no unit waits while
        holding the locks of intents it would have to run."""
        name = self._lock_name(target, key)
        locks = self._shared.locks
        if not self._batch.intents_pending():
            locks.acquire(name)
        elif self._batch.intent_holds(name) or not locks.acquire(name, blocking=False):
            self._batch.flush_pending()
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
        if self._batch.intent_for(tx_id):
            self._batch.flush_intents()  # its transaction document is not inserted yet
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
                self._batch.record_now(view.step_id(step))
                doc = self._find_step(view.step_id(step))
            view.steps[step] = doc
        return view.steps[step]

    def _find_step(self, step_id: str) -> Document | None:
        """Step document ``step_id`` as stored, with its decision document applied
        (:func:`~saga.participants.mongo._ledger._decided`)."""
        return _find_step(self._ledger, step_id, self.transaction_session())

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

    def _created(self, view: _TxView, step: int, fields: Mapping[str, Any]) -> Document:
        return {
            "_id": view.step_id(step),
            "participant": view.participant,
            "tx_id": view.tx_id,
            "step": step,
            "rev": 1,
            **fields,
        }

    def _insert_step(self, created: Document, entry: LedgerEntry, session: Any) -> None:
        try:
            self._ledger.insert_one(created, session=session)
        except mongo_errors.DuplicateKeyError as exc:
            raise self._raced(entry.tx_id, entry.step) from exc

    def _update_step(
        self, view: _TxView, entry: LedgerEntry | tuple[str, int], change: Document
    ) -> Document:
        """Compare-and-set the step document on the ``rev`` last seen; the new document."""
        tx_id, step = (entry.tx_id, entry.step) if isinstance(entry, LedgerEntry) else entry
        current = view.steps[step]
        assert current is not None
        self._batch.record_now(current["_id"])
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

    # -- recovery (implemented by the next layer, see the module doc)

    @abstractmethod
    def _resolve_creation(self, view: _TxView, step: int, intent: Document) -> Document | None:
        """Finish or undo the write that was to create ``step``'s document."""

    @abstractmethod
    def _resolve_step(self, view: _TxView, step: int, doc: Document) -> Document:
        """Finish or undo the write recorded as ``pending`` in step document ``doc``."""

    @abstractmethod
    def _purge_named(self, view: _TxView, step: int, doc: Document) -> Document:
        """Remove the document a recorded step's ``purge`` names, then the ``purge``."""

    @abstractmethod
    def settle(self, target: str, key: Any, doc: Document | None) -> Document | None:
        """``doc`` as read under its lock, once the write whose marker it carries is recorded."""

    @abstractmethod
    def hold_open(self, step_ids: list[str]) -> bool:
        """Whether a step among ``step_ids`` (a hold's holders) is still undecided."""

    @abstractmethod
    def known_marker(self, target: str, key: Any) -> str | None:
        """The marker this process last recorded for the document (``None``: not known)."""
