"""The native session MongoDB actions get (:class:`MongoSession`): reads under the
document's lock, and the one staged write of a step (see *Effects are staged* in
:mod:`saga.participants.mongo`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pymongo.client_session import ClientSession
from pymongo.collection import Collection
from pymongo.database import Database

from saga.participants._storage import StepScope
from saga.participants.mongo._ledger import _step_id
from saga.participants.mongo._values import Document
from saga.participants.mongo._writes import DocumentWrite, _doc_id, _purge
from saga.streams import BusinessRejection

if TYPE_CHECKING:
    from saga.participants.mongo._unitbase import _UnitBase


class MongoSession:
    """What actions get as ``native`` for one work item.

    ``db`` is the participant's :class:`~pymongo.database.Database`; ``session``
    the :class:`~pymongo.client_session.ClientSession` whose transaction holds the
    step when the server has transactions (``None`` otherwise): pass
    ``session=native.session`` to every call. For writes that are atomic with the
    ledger on every server, read with :meth:`read` and :meth:`stage` one
    :class:`DocumentWrite` per step instead of writing directly.
    """

    def __init__(self, unit: _UnitBase) -> None:
        self._unit = unit
        self.db: Database[Document] = unit.storage.db
        self._staged: DocumentWrite | None = None

    @property
    def session(self) -> ClientSession | None:
        return self._unit.transaction_session()

    @property
    def transactional(self) -> bool:
        """Whether writes made directly through ``db`` commit with the ledger record."""
        return self._unit.storage.transactional

    def collection(self, target: str) -> Collection[Document]:
        """The collection of ``target``, one of the participant's targets."""
        if target not in self._unit.storage.targets:
            allowed = ", ".join(sorted(self._unit.storage.targets)) or "empty"
            raise BusinessRejection(
                f"target {target!r} is not in this participant's allow-list ({allowed})"
            )
        return self.db[target]

    def read(self, target: str, key: Any) -> Document | None:
        """The document ``target/key`` (``None``: absent), locked for this step.

        Makes sure the write whose marker it carries is recorded first (see the package doc).
        """
        return self._read(self.collection(target), key)

    def stage(self, write: DocumentWrite) -> None:
        """Run ``write`` together with this step's ledger entry (one write per step)."""
        self.collection(write.target)
        self._stage(write)

    def take_staged(self) -> DocumentWrite | None:
        staged, self._staged = self._staged, None
        return staged

    # -- for the built-in actions (see participants.mongo._holds)

    def _read(self, collection: Collection[Document], key: Any) -> Document | None:
        self._unit.lock(collection.name, key)
        doc = collection.find_one({"_id": key}, session=self.session)
        return self._unit.settle(collection.name, key, doc)

    def _stage(self, write: DocumentWrite) -> None:
        refused = self._unit.refused.get((write.target, _doc_id(write.target, write.key)))
        if refused is not None:
            raise BusinessRejection(refused)
        if self._staged is not None:
            raise RuntimeError("a step may stage one document write; this one staged two")
        if not self._unit.holds(write.target, write.key):
            # A handler that writes without reading first still waits its turn.
            self._read(self.db[write.target], write.key)
        self._staged = write

    @property
    def shadow_name(self) -> str:
        """The collection of the shadow documents (pending records)."""
        return self._unit.storage.shadow_collection.name

    def step_id(self, scope: StepScope) -> str:
        """The id naming ``scope``'s step in holds and reservations."""
        return _step_id(self._unit.storage.name, scope.tx_id, scope.step)

    def read_shadow(self, target: str, key: Any) -> Document | None:
        """The shadow document of record ``target/key`` (``None``: none), locked and settled."""
        return self._read(self._unit.storage.shadow_collection, _doc_id(target, key))

    def stage_internal(self, write: DocumentWrite) -> None:
        """Stage a write of a built-in action (the shadow collection is not a target)."""
        self._stage(write)

    @property
    def checked_writes(self) -> bool:
        """Whether a write may carry a ``check`` (client-side compare-and-set, FerretDB)."""
        storage = self._unit.storage
        return not storage.transactional and not storage.cas.server_side

    def known_marker(self, target: str, key: Any) -> str | None:
        """Lock ``target/key`` without reading it; the marker this process last recorded for
        it (``None``: not known), for an optimistic write."""
        self._unit.lock(target, key)
        return self._unit.known_marker(target, key)

    @property
    def narrows_by_id(self) -> bool:
        """Whether the server looks a filter naming ``_id`` and more up by ``_id`` (see
        ``MongoStorage.narrows_by_id``)."""
        return self._unit.storage.narrows_by_id

    def reservation_sure(self, step_id: str) -> bool:
        """Whether this process wrote ``step_id``'s reservation and has not removed it."""
        return self._unit.storage.shared.reserved.get(step_id) is not None

    def hold_open(self, step_ids: list[str]) -> bool:
        """Whether a step among a hold's holders is still undecided (see
        :meth:`~saga.participants.mongo._recovery._UnitRecovery.hold_open`)."""
        return self._unit.hold_open(step_ids)

    def drop_shadow(self, key: str, marker: Any) -> None:
        """Remove a shadow document whose holders are all decided (a crash's leftover)."""
        shadow = self._unit.storage.shadow_collection
        _purge(shadow, key, marker, self.session, self._unit.storage.cas)
