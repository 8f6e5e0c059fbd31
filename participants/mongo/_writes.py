"""Staged writes: the one document write a step makes, its marker, and the removal of a
document a recorded delete marked (see *Effects are staged* in :mod:`saga.participants.mongo`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from pymongo import errors as mongo_errors
from pymongo.collection import Collection

from saga.participants.mongo._cas import _SERVER_CAS, _Cas
from saga.participants.mongo._holds import fits_reservation
from saga.participants.mongo._values import MARKER_FIELD, Document, _from_text, _to_text

log = logging.getLogger("saga.participant.mongo")


DELETED: Final = "!deleted"
"""Ends the marker of a delete: the document is removed once the ledger records the step."""
FENCED: Final = "!fenced"
"""Ends a marker set by fencing: the write it names did not happen and never will."""


@dataclass(frozen=True, slots=True)
class DocumentWrite:
    """One single-document write, run when the step's ledger entry is written.

    ``kind``: ``insert`` (``document``, fails when the key exists), ``update``
    (``set`` and ``unset`` field names), ``replace`` (the whole ``document``) or
    ``delete``. Every kind but ``insert`` applies only while the document's
    ``_saga`` field still equals ``expect`` (``None``: absent) and it matches
    ``guard`` (extra equality conditions), so a change made in between makes the
    write miss instead of overwrite it. The write sets ``_saga`` to the step's
    marker; ``_id`` and ``_saga`` must not appear in ``document``/``set``.

    ``then_remove`` (``{"target", "key", "marker"}``) names another document to remove
    once the step is recorded (the shadow document of a record a commit creates); the
    step document names it until then, as a delete's names its own document.
    ``idempotent``: running the write again after it took effect changes nothing (it
    removes, in the document it changes, what it acts on: a hold or a reservation), so
    it needs no intent (see :mod:`saga.participants.mongo._holds`). ``ops``: more
    update operators (``$inc``, ``$max``, ``$min``: field -> operand). ``optimistic``:
    ``expect`` is what this process last knew of the document, not what the step read;
    a miss means run the step again, reading.
    ``reserve``: the reservation an optimistic write makes (see
    :func:`~saga.participants.mongo._holds.fits_reservation`), which the document as it
    was must pass (client-side compare-and-set only, see
    :class:`~saga.participants.mongo._cas._Cas`); kept in the intent, so that a write
    found done after a crash is undone instead of recorded when it does not pass.
    ``reserves``: the step whose reservation the write makes; ``drops``: the steps whose
    reservations it removes (see ``SharedState.reserved``). ``filtered``: the conditions
    join the server's filter even where compare-and-set is otherwise checked client-side
    (FerretDB), so that a write that would miss is never made; only where the server
    narrows such a filter by ``_id`` (``MongoStorage.narrows_by_id``). Never kept in an
    intent: only an idempotent write, which has none, is filtered.
    """

    target: str
    key: Any
    kind: Literal["insert", "update", "replace", "delete"]
    expect: Any = None
    document: Mapping[str, Any] = field(default_factory=dict)
    set: Mapping[str, Any] = field(default_factory=dict)
    unset: Sequence[str] = ()
    guard: Mapping[str, Any] = field(default_factory=dict)
    then_remove: Mapping[str, Any] | None = None
    idempotent: bool = False
    ops: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    optimistic: bool = False
    reserve: Mapping[str, Any] | None = None
    reserves: str | None = None
    drops: tuple[str, ...] = ()
    filtered: bool = False

    def run(
        self,
        collection: Collection[Document],
        marker: str,
        session: Any,
        cas: _Cas = _SERVER_CAS,
    ) -> bool:
        """Run the write; whether it took effect (``False``: the document changed meanwhile).

        A ``delete`` only marks the document (``marker`` ends with ``!deleted``);
        :func:`_purge` removes it once the ledger records the step.
        """
        if self.kind == "insert":
            try:
                collection.insert_one(
                    {"_id": self.key, **self.document, MARKER_FIELD: marker}, session=session
                )
            except mongo_errors.DuplicateKeyError:
                return False
            return True
        expect = {MARKER_FIELD: self.expect, **self.guard}
        if self.kind == "replace":
            replacement = {**self.document, MARKER_FIELD: marker}
            return cas.replace(collection, self.key, expect, replacement, session)
        change = self._change(marker)
        if self.filtered:
            return _SERVER_CAS.update(collection, self.key, expect, change, session)
        return cas.update(collection, self.key, expect, change, session, self.check())

    def _change(self, marker: str) -> Document:
        change: Document = {"$set": {MARKER_FIELD: marker}}
        if self.kind == "update":
            change["$set"] = {**self.set, MARKER_FIELD: marker}
            if self.unset:
                change["$unset"] = dict.fromkeys(self.unset, "")
            for operator, operands in self.ops.items():
                change[operator] = dict(operands)
        return change

    def filtered_update(self, marker: str) -> tuple[Document, Document]:
        """A ``filtered`` update as one filter and one change (for a bulk write)."""
        assert self.filtered and self.kind == "update"
        expect = {MARKER_FIELD: self.expect, **self.guard}
        return _SERVER_CAS.where(self.key, expect), self._change(marker)

    def check(self) -> Callable[[Document], bool] | None:
        """What the document as it was must pass (see ``reserve``)."""
        spec = self.reserve
        return None if spec is None else lambda doc: fits_reservation(doc, spec)

    def happened(self, current: Document | None, marker: str) -> bool:
        """Whether this write (with ``marker``) is what ``current`` shows."""
        return current is not None and current.get(MARKER_FIELD) == marker

    def to_bson(self) -> Document:
        return {
            "target": self.target,
            "key": self.key,
            "kind": self.kind,
            "expect": self.expect,
            "document": _to_text(dict(self.document)),
            "set": _to_text(dict(self.set)),
            "unset": list(self.unset),
            "guard": _to_text(dict(self.guard)),
            "then_remove": None if self.then_remove is None else dict(self.then_remove),
            "ops": _to_text(dict(self.ops)),
            "reserve": None if self.reserve is None else dict(self.reserve),
        }

    @classmethod
    def from_bson(cls, doc: Mapping[str, Any]) -> DocumentWrite:
        return cls(
            target=doc["target"],
            key=doc["key"],
            kind=doc["kind"],
            expect=doc.get("expect"),
            document=_from_text(doc.get("document")) or {},
            set=_from_text(doc.get("set")) or {},
            unset=tuple(doc.get("unset") or ()),
            guard=_from_text(doc.get("guard")) or {},
            then_remove=doc.get("then_remove"),
            ops=_from_text(doc.get("ops")) or {},
            reserve=doc.get("reserve"),
        )


def _purge(
    collection: Collection[Document], key: Any, marker: str, session: Any, cas: _Cas
) -> None:
    """Remove a document a recorded delete marked (gone already is fine)."""
    if not cas.delete(collection, key, {MARKER_FIELD: marker}, session):
        log.debug("%s/%r was removed already", collection.name, key)


def _purge_field(write: DocumentWrite, marker: str) -> Document:
    """What the step document of a delete (or of a write with ``then_remove``) holds until
    the document it names is removed."""
    if write.kind == "delete":
        return {"purge": {"target": write.target, "key": write.key, "marker": marker}}
    if write.then_remove is not None:
        return {"purge": dict(write.then_remove)}
    return {}


def _doc_id(target: str, key: Any) -> str:
    """A string naming one document of the database (for locks and refusals)."""
    kind = "i" if isinstance(key, int) else "s"
    return f"{target}/{kind}:{key}"


def _new_marker(step_id: str, rev: int, write: DocumentWrite) -> str:
    """``<step id>#<rev>.<nonce>`` (``!deleted`` appended for a delete): unique per write."""
    marker = f"{step_id}#{rev}.{os.urandom(4).hex()}"
    return marker + DELETED if write.kind == "delete" else marker


def _marker_names(marker: Any) -> tuple[str, int] | None:
    """The step id and rev a marker names; ``None`` for no marker, a fenced or a foreign one."""
    if not isinstance(marker, str) or marker.endswith(FENCED):
        return None
    step_id, sep, rest = marker.removesuffix(DELETED).rpartition("#")
    rev = rest.split(".", 1)[0]
    if not sep or not rev.isdigit():
        return None
    return step_id, int(rev)
