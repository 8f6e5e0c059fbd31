"""A document of a target collection as a built-in step sees it: read once under its
lock, its shadow document (the record held before it exists), who else holds it, and
the staged write the step makes (see :mod:`~saga.participants.mongo._holds`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal

from saga.participants._actions import INT64_MAX, INT64_MIN, Key
from saga.participants.mongo._holds import (
    RESERVATIONS_FIELD,
    RETRY,
    Hold,
    held_reason,
    reservations,
    reserved_reason,
)
from saga.participants.mongo._session import MongoSession
from saga.participants.mongo._values import (
    _CANONICAL_INT,
    MARKER_FIELD,
    Document,
    _is_number,
    _show,
)
from saga.participants.mongo._writes import DocumentWrite, _doc_id
from saga.streams import BusinessRejection

Kind = Literal["insert", "update", "replace", "delete"]


def canonical_key(key: Key) -> int | str:
    """The ``_id`` a step's key addresses: canonical decimal integer strings become integers."""
    if isinstance(key, str) and _CANONICAL_INT.fullmatch(key):
        number = int(key)
        if INT64_MIN <= number <= INT64_MAX:
            return number
    return key


_UNREAD: Final = object()


class _Document:
    """One document of a target collection, addressed by the step's key; its shadow
    document holds it while it does not exist yet (see :mod:`~saga.participants.mongo._holds`).

    The document is read once (under its lock, settled) and kept for the step.
    """

    def __init__(self, session: MongoSession, target: str, key: Key) -> None:
        self.session = session
        self.target = target
        self.key = canonical_key(key)
        self.where = f"{target}/{key}"
        self._doc: Any = _UNREAD

    def _read(self) -> Document | None:
        if self._doc is _UNREAD:
            self._doc = self.session.read(self.target, self.key)
        doc: Document | None = self._doc
        return doc

    def _existing(self) -> Document:
        doc = self._read()
        if doc is None:
            raise BusinessRejection(f"{self.where} does not exist")
        return doc

    def _stage(self, kind: Kind, **parts: Any) -> None:
        self.session.stage_internal(DocumentWrite(self.target, self.key, kind, **parts))

    def _stage_shadow(self, kind: Kind, **parts: Any) -> None:
        write = DocumentWrite(self.session.shadow_name, self._shadow_key, kind, **parts)
        self.session.stage_internal(write)

    @property
    def _shadow_key(self) -> str:
        return _doc_id(self.target, self.key)

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

    # -- who else holds the record

    def _free(
        self, doc: Document, tx_id: str | None, then: str = RETRY, *, escrow: bool = False
    ) -> Hold | None:
        """Raise unless no other saga holds ``doc`` (nor, unless ``escrow``, has a
        reservation on it); return the hold of ``tx_id``'s saga, if any."""
        hold = Hold.of(doc)
        if hold is not None and hold.tx_id != tx_id:
            raise BusinessRejection(held_reason(self.where, hold, then))
        if not escrow:
            for reservation in reservations(doc):
                if reservation.tx_id != tx_id:
                    raise BusinessRejection(reserved_reason(self.where, reservation, then))
        return hold

    def _shadow(self, tx_id: str | None, then: str = RETRY) -> Document | None:
        """The shadow document of the (absent) record when ``tx_id``'s saga holds it
        (``None``: nobody does); raise when another saga's open hold is in it."""
        doc = self.session.read_shadow(self.target, self.key)
        hold = Hold.of(doc)
        if doc is None or hold is None or hold.tx_id == tx_id:
            return doc if hold is not None else None
        if self.session.hold_open(list(hold.steps)):
            # Loading the holders may have finished a recorded commit that removes it.
            again = self.session.read_shadow(self.target, self.key)
            held = Hold.of(again)
            if held is not None and held.tx_id != tx_id:
                raise BusinessRejection(held_reason(self.where, held, then))
            return again if held is not None else None
        self.session.drop_shadow(self._shadow_key, doc.get(MARKER_FIELD))
        return None

    def _dropping(self, doc: Document, me: str) -> list[str]:
        """What to unset to drop ``me``'s reservation: its own field, or the field's group
        with the last reservation on that field, or the whole field with the last one."""
        found = reservations(doc)
        others = {r.path.rpartition(".")[0] for r in found if r.step_id != me}
        if not others:
            return [RESERVATIONS_FIELD]
        paths = []
        for mine in (r for r in found if r.step_id == me):
            group = mine.path.rpartition(".")[0]
            paths.append(mine.path if group in others or group == RESERVATIONS_FIELD else group)
        return paths

    # -- values

    def _counter(self, name: str) -> str:
        if name == "_id" or name.startswith(MARKER_FIELD):
            raise BusinessRejection(f"increment may not change the field {name!r}")
        return name

    def _number(self, doc: Mapping[str, Any], name: str) -> int | float:
        value = doc.get(name)
        if value is None:
            raise BusinessRejection(f"{self.where} has no value in {name}")
        if not _is_number(value):
            raise BusinessRejection(f"{self.where} {name} is not a number ({_show(value)})")
        number: int | float = value
        return number
