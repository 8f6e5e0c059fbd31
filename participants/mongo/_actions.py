"""The native session MongoDB actions get, and the built-in actions on documents.

Every write is a :class:`~participants._mongo_writes.DocumentWrite` staged for the
step's ledger write (see *Effects are staged* in :mod:`participants._mongo`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pymongo.client_session import ClientSession
from pymongo.collection import Collection
from pymongo.database import Database

from saga.participants._actions import (
    INT64_MAX,
    INT64_MIN,
    BuiltinAction,
    BuiltinActions,
    Increment,
    Key,
    RecordOps,
)
from saga.participants.mongo._values import (
    _CANONICAL_INT,
    MARKER_FIELD,
    Document,
    _add,
    _image,
    _is_number,
    _restored,
    _show,
    _show_number,
)
from saga.participants.mongo._writes import DocumentWrite, _doc_id
from saga.streams import BusinessRejection

if TYPE_CHECKING:
    from saga.participants.mongo._unit import _MongoUnit


class MongoSession:
    """What actions get as ``native`` for one work item.

    ``db`` is the participant's :class:`~pymongo.database.Database`; ``session``
    the :class:`~pymongo.client_session.ClientSession` whose transaction holds the
    step when the server has transactions (``None`` otherwise): pass
    ``session=native.session`` to every call. For writes that are atomic with the
    ledger on every server, read with :meth:`read` and :meth:`stage` one
    :class:`DocumentWrite` per step instead of writing directly.
    """

    def __init__(self, unit: _MongoUnit) -> None:
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

        Makes sure the write whose marker it carries is recorded first (see the module doc).
        """
        collection = self.collection(target)
        self._unit.lock(target, key)
        doc = collection.find_one({"_id": key}, session=self.session)
        return self._unit.settle(target, key, doc)

    def stage(self, write: DocumentWrite) -> None:
        """Run ``write`` together with this step's ledger entry (one write per step)."""
        collection = self.collection(write.target)
        refused = self._unit.refused.get((write.target, _doc_id(write.target, write.key)))
        if refused is not None:
            raise BusinessRejection(refused)
        if self._staged is not None:
            raise RuntimeError("a step may stage one document write; this one staged two")
        if not self._unit.holds(write.target, write.key):
            # A handler that writes without reading first still waits its turn.
            self._unit.lock(write.target, write.key)
            found = collection.find_one({"_id": write.key}, session=self.session)
            self._unit.settle(write.target, write.key, found)
        self._staged = write

    def take_staged(self) -> DocumentWrite | None:
        staged, self._staged = self._staged, None
        return staged


# ---------------------------------------------------------------- built-in actions


class MongoActions(BuiltinActions[MongoSession]):
    """The built-in actions on documents, in a :class:`MongoSession`.

    ``put`` sets the given fields and keeps the others; its compensation puts the
    whole old document back (or deletes a created one). ``update``'s before-image
    is ``{"fields": {old values}, "absent": [fields it added]}``. ``increment``
    checks the bounds on the value it read and writes the result with that value
    as a guard; its compensation subtracts ``by`` without bounds. Every write is a
    :class:`DocumentWrite` staged for the ledger write.
    """

    def record(self, native: MongoSession, action: BuiltinAction) -> RecordOps:
        return _Record(native, action.target, action.key)


def canonical_key(key: Key) -> int | str:
    """The ``_id`` a step's key addresses: canonical decimal integer strings become integers."""
    if isinstance(key, str) and _CANONICAL_INT.fullmatch(key):
        number = int(key)
        if INT64_MIN <= number <= INT64_MAX:
            return number
    return key


class _Record:
    """One document of a target collection, addressed by the step's key."""

    def __init__(self, session: MongoSession, target: str, key: Key) -> None:
        self.session = session
        self.target = target
        self.key = canonical_key(key)
        self.where = f"{target}/{key}"

    def _read(self) -> Document | None:
        return self.session.read(self.target, self.key)

    def _existing(self) -> Document:
        doc = self._read()
        if doc is None:
            raise BusinessRejection(f"{self.where} does not exist")
        return doc

    def _stage(self, kind: Literal["insert", "update", "replace", "delete"], **parts: Any) -> None:
        self.session.stage(DocumentWrite(self.target, self.key, kind, **parts))

    def _fields(self, fields: Mapping[str, Any], what: str, *, key_allowed: bool) -> Document:
        values: Document = {}
        for name, value in fields.items():
            if name.startswith(MARKER_FIELD):
                raise BusinessRejection(
                    f"{what} of {self.where} may not set {name!r}: names starting with "
                    f"{MARKER_FIELD!r} are reserved for the saga marker"
                )
            if name == "_id":
                # The key is the document's identity: it may be repeated, never changed.
                if not key_allowed or canonical_key(value) != self.key:
                    raise BusinessRejection(
                        f"{what} of {self.where} may not change the key field '_id'"
                    )
                continue
            values[name] = value
        return values

    # -- actions

    def insert(self, fields: Mapping[str, Any]) -> None:
        values = self._fields(fields, "insert", key_allowed=True)
        if self._read() is not None:
            raise BusinessRejection(f"{self.where} already exists")
        self._stage("insert", document=values)

    def put(self, fields: Mapping[str, Any]) -> Any:
        values = self._fields(fields, "put", key_allowed=True)
        doc = self._read()
        if doc is None:
            self._stage("insert", document=values)
            return None
        self._stage("update", expect=doc.get(MARKER_FIELD), set=values)
        return _image(doc)

    def update(self, fields: Mapping[str, Any]) -> Any:
        values = self._fields(fields, "update", key_allowed=False)
        doc = self._existing()
        self._stage("update", expect=doc.get(MARKER_FIELD), set=values)
        present = {name: doc[name] for name in values if name in doc}
        absent = sorted(name for name in values if name not in doc)
        return {"fields": _image(present), "absent": absent}

    def delete(self) -> Any:
        doc = self._existing()
        self._stage("delete", expect=doc.get(MARKER_FIELD))
        return _image(doc)

    def increment(self, action: Increment) -> Any:
        name = self._counter(action.field)
        doc = self._existing()
        current = self._number(doc, name)
        result = _add(current, action.by, f"{self.where} {name}")
        if action.min is not None and result < action.min:
            raise BusinessRejection(
                f"{self.where} {name} would be {_show_number(result)}, below the minimum "
                f"{_show_number(action.min)}"
            )
        if action.max is not None and result > action.max:
            raise BusinessRejection(
                f"{self.where} {name} would be {_show_number(result)}, above the maximum "
                f"{_show_number(action.max)}"
            )
        self._stage(
            "update", expect=doc.get(MARKER_FIELD), set={name: result}, guard={name: current}
        )
        return {name: current}

    # -- compensations

    def remove(self) -> None:
        doc = self._read()
        if doc is not None:  # already gone is fine: the compensation wants the key absent
            self._stage("delete", expect=doc.get(MARKER_FIELD))

    def restore_put(self, before: Any) -> None:
        if before is None:
            self.remove()
            return
        image = _restored(before, f"the before-image of {self.where} is missing")
        doc = self._read()
        if doc is None:
            self._stage("insert", document=image)
        else:
            self._stage("replace", expect=doc.get(MARKER_FIELD), document=image)

    def restore_fields(self, before: Any) -> None:
        if not isinstance(before, Mapping) or not isinstance(before.get("fields"), Mapping):
            raise BusinessRejection(
                f"the before-image of {self.where} is missing; the update cannot be undone"
            )
        doc = self._read()
        if doc is None:
            raise BusinessRejection(
                f"{self.where} no longer exists, so its update cannot be undone"
            )
        self._stage(
            "update",
            expect=doc.get(MARKER_FIELD),
            set=_restored(before["fields"], ""),
            unset=[str(name) for name in before.get("absent", ())],
        )

    def reinsert(self, before: Any) -> None:
        image = _restored(
            before, f"the before-image of {self.where} is missing; it cannot be restored"
        )
        if self._read() is not None:
            raise BusinessRejection(
                f"{self.where} exists again, so the deleted document cannot be restored"
            )
        self._stage("insert", document=image)

    def increment_back(self, action: Increment, before: Any) -> None:
        name = self._counter(action.field)
        doc = self._read()
        if doc is None:
            raise BusinessRejection(
                f"{self.where} no longer exists, so its increment of {name} cannot be undone"
            )
        current = self._number(doc, name)
        result = _add(current, -action.by, f"{self.where} {name}")
        old = before.get(name) if isinstance(before, Mapping) else None
        if _is_number(old) and old == result:
            result = old  # the old value exactly, type included (an int stays an int)
        self._stage(
            "update", expect=doc.get(MARKER_FIELD), set={name: result}, guard={name: current}
        )

    def _counter(self, name: str) -> str:
        if name == "_id" or name.startswith(MARKER_FIELD):
            raise BusinessRejection(f"increment may not change the field {name!r}")
        return name

    def _number(self, doc: Document, name: str) -> int | float:
        value = doc.get(name)
        if value is None:
            raise BusinessRejection(f"{self.where} has no value in {name}")
        if not _is_number(value):
            raise BusinessRejection(f"{self.where} {name} is not a number ({_show(value)})")
        number: int | float = value
        return number
