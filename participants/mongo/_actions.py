"""The built-in actions on MongoDB documents, at both isolation levels.

Every write is a :class:`~saga.participants.mongo._writes.DocumentWrite` staged for
the step's ledger write (see *Effects are staged* in :mod:`saga.participants.mongo`);
holds, reservations and bounds are described in :mod:`saga.participants.mongo._holds`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from saga.participants._actions import (
    BuiltinAction,
    BuiltinActions,
    Delete,
    Increment,
    Insert,
    Put,
    RecordOps,
    Update,
)
from saga.participants._storage import StepScope
from saga.participants.mongo._cas import ABSENT, INTEGER, _get, _same
from saga.participants.mongo._document import _Document
from saga.participants.mongo._holds import (
    BOUNDS_FIELD,
    HOLD_FIELD,
    NOT_RESTORED,
    RESERVATIONS_FIELD,
    Hold,
    Reservation,
    bound_ops,
    bounds_of,
    check_increment,
    fields_of,
    reservation_path,
    reservations,
    tightened,
)
from saga.participants.mongo._session import MongoSession
from saga.participants.mongo._values import (
    MARKER_FIELD,
    Document,
    _add,
    _image,
    _is_number,
    _restored,
    _show,
)
from saga.streams import BusinessRejection


class MongoActions(BuiltinActions[MongoSession]):
    """The built-in actions on documents, in a :class:`MongoSession`.

    At level ``none``: ``put`` sets the given fields and keeps the others; its
    compensation puts the whole old document back (or deletes a created one).
    ``update``'s before-image is ``{"fields": {old values}, "absent": [fields it
    added]}``. ``increment`` checks the bounds on the value it read (and the open
    reservations on the field) and writes the result with that value as a guard; its
    compensation subtracts ``by``, within the bounds recorded on the field. At level
    ``read_committed`` they hold and reserve (:mod:`saga.participants.mongo._holds`).
    """

    def record(self, native: MongoSession, action: BuiltinAction) -> RecordOps:
        return _Record(native, action.target, action.key)


class _Record(_Document):
    """What each built-in action does to one document, at each isolation level
    (:class:`~saga.participants._actions.RecordOps`)."""

    # -- level none: write at once

    def insert(self, fields: Mapping[str, Any]) -> None:
        values = self._fields(fields, "insert", key_allowed=True)
        if self._read() is not None:
            raise BusinessRejection(f"{self.where} already exists")
        self._shadow(None)
        self._stage("insert", document=values)

    def put(self, fields: Mapping[str, Any]) -> Any:
        values = self._fields(fields, "put", key_allowed=True)
        doc = self._read()
        if doc is None:
            self._shadow(None)
            self._stage("insert", document=values)
            return None
        self._free(doc, None)
        self._stage("update", expect=doc.get(MARKER_FIELD), set=values)
        return _image(doc)

    def update(self, fields: Mapping[str, Any]) -> Any:
        values = self._fields(fields, "update", key_allowed=False)
        doc = self._existing()
        self._free(doc, None)
        self._stage("update", expect=doc.get(MARKER_FIELD), set=values)
        present = {name: doc[name] for name in values if name in doc}
        absent = sorted(name for name in values if name not in doc)
        return {"fields": _image(present), "absent": absent}

    def delete(self) -> Any:
        doc = self._existing()
        self._free(doc, None)
        self._stage("delete", expect=doc.get(MARKER_FIELD))
        return _image(doc)

    def increment(self, action: Increment) -> Any:
        name = self._counter(action.field)
        doc = self._existing()
        self._free(doc, None, escrow=True)
        current = self._number(doc, name)
        on_field = [r for r in reservations(doc) if r.field == name]
        result = check_increment(
            self.where, name, current, action.by, action.min, action.max, on_field
        )
        self._stage(
            "update",
            expect=doc.get(MARKER_FIELD),
            set={name: result},
            guard={name: current},
            ops=bound_ops(name, action.min, action.max),
        )
        return {name: current}

    # -- level none: compensations

    def guard(self, action: BuiltinAction, before: Any) -> None:
        """Refuse a compensation that would overwrite another saga's work or break a bound
        a step relied on (see :class:`~saga.participants._actions.RecordOps`)."""
        doc = self._read()
        if isinstance(action, Delete):
            if doc is None:
                self._shadow(None, NOT_RESTORED)  # another saga's pending insert of the key
            return  # an existing document: the restore refuses ("exists again")
        if doc is None:
            if isinstance(action, Put) and before is not None:
                raise BusinessRejection(
                    f"{self.where} was deleted since this step wrote it; {NOT_RESTORED}"
                )
            return  # absent is what undoing an insert wants; the others say it is gone
        self._free(doc, None, NOT_RESTORED, escrow=isinstance(action, Increment))
        if isinstance(action, Insert | Put):
            self._unchanged(doc, self._fields(action.value, "put", key_allowed=True))
        elif isinstance(action, Update):
            self._unchanged(doc, self._fields(action.set, "update", key_allowed=False))
        elif isinstance(action, Increment):
            self._bounds_kept(doc, action)

    def _unchanged(self, doc: Document, wrote: Mapping[str, Any]) -> None:
        for name, value in wrote.items():
            actual = _get(doc, name)
            if actual is ABSENT or not _same(actual, value):
                now = "absent" if actual is ABSENT else f"{_show(actual)}"
                raise BusinessRejection(
                    f"{self.where} changed since this step wrote it ({name} is {now}, the "
                    f"step wrote {_show(value)}); {NOT_RESTORED}"
                )

    def _bounds_kept(self, doc: Document, action: Increment) -> None:
        name = self._counter(action.field)
        current = self._number(doc, name)
        low, high = bounds_of(doc.get(BOUNDS_FIELD), name)
        back = -action.by
        on_field = [r for r in reservations(doc) if r.field == name]
        try:
            check_increment(
                self.where,
                name,
                current,
                back,
                low if back < 0 else None,
                high if back > 0 else None,
                on_field,
            )
        except BusinessRejection as exc:
            raise BusinessRejection(
                f"{exc.reason} once this step is undone, a bound a step relied on; {NOT_RESTORED}"
            ) from exc

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
            kept = {BOUNDS_FIELD: doc[BOUNDS_FIELD]} if BOUNDS_FIELD in doc else {}
            self._stage("replace", expect=doc.get(MARKER_FIELD), document={**image, **kept})

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

    # -- level read_committed: hold, reserve, commit, release

    def hold(self, scope: StepScope, action: Insert | Put | Update | Delete) -> None:
        me = self.session.step_id(scope)
        doc = self._read()
        if doc is not None:
            own = self._free(doc, scope.tx_id)
            folded = [r for r in reservations(doc) if r.tx_id == scope.tx_id]
            current = own.intended if own is not None else self._folded(doc, folded)
            held = own or Hold(scope.tx_id, (), None)
            for reservation in folded:  # this saga's increments join the hold, in order
                held = held.joined(reservation.step_id, held.intended, held.bounds)
            held = held.joined(me, self._intended(action, current), held.bounds)
            self._stage(
                "update",
                expect=doc.get(MARKER_FIELD),
                set={HOLD_FIELD: held.to_bson()},
                unset=[RESERVATIONS_FIELD] if folded else [],
                drops=tuple(r.step_id for r in folded),
            )
            return
        shadow = self._shadow(scope.tx_id)
        own = Hold.of(shadow)
        intended = self._intended(action, None if own is None else own.intended)
        if shadow is None or own is None:
            fresh = Hold(scope.tx_id, (me,), intended)
            document = {"target": self.target, "key": self.key, HOLD_FIELD: fresh.to_bson()}
            self._stage_shadow("insert", document=document)
        else:
            held = own.joined(me, intended, own.bounds)
            self._stage_shadow(
                "update", expect=shadow.get(MARKER_FIELD), set={HOLD_FIELD: held.to_bson()}
            )

    def _folded(self, doc: Document, folded: list[Reservation]) -> Document:
        """The record's fields with this saga's own reservations added (they join its hold)."""
        fields = fields_of(doc)
        for reservation in folded:
            value = fields.get(reservation.field)
            if _is_number(value):
                fields[reservation.field] = _add(value, reservation.by, self.where)
        return fields

    def _intended(self, action: Insert | Put | Update | Delete, current: Document | None) -> Any:
        """The record once ``action`` is applied to ``current`` (``None``: absent)."""
        if isinstance(action, Insert):
            values = self._fields(action.value, "insert", key_allowed=True)
            if current is not None:
                raise BusinessRejection(f"{self.where} already exists")
            return values
        if isinstance(action, Put):
            return {**(current or {}), **self._fields(action.value, "put", key_allowed=True)}
        if isinstance(action, Update):
            values = self._fields(action.set, "update", key_allowed=False)
            if current is None:
                raise BusinessRejection(f"{self.where} does not exist")
            return {**current, **values}
        if current is None:
            raise BusinessRejection(f"{self.where} does not exist")
        return None

    def reserve(self, scope: StepScope, action: Increment) -> None:
        name = self._counter(action.field)
        me = self.session.step_id(scope)
        if self._reserve_unread(scope, action, name, me):
            return
        doc = self._read()
        if doc is None:
            shadow = self._shadow(scope.tx_id)
            own = Hold.of(shadow)
            if shadow is None or own is None:
                raise BusinessRejection(f"{self.where} does not exist")
            bounds = tightened(own.bounds, name, action.min, action.max)
            held = self._chain(own, me, action, name, bounds)
            self._stage_shadow(
                "update", expect=shadow.get(MARKER_FIELD), set={HOLD_FIELD: held.to_bson()}
            )
            return
        own = self._free(doc, scope.tx_id, escrow=True)
        change: Document = {}
        reserves = None
        if own is not None:  # its own saga holds the record: the increment joins the hold
            change[HOLD_FIELD] = self._chain(own, me, action, name, own.bounds).to_bson()
        else:
            current = self._number(doc, name)
            on_field = [r for r in reservations(doc) if r.field == name and r.step_id != me]
            check_increment(self.where, name, current, action.by, action.min, action.max, on_field)
            change[reservation_path(me, name)] = action.by
            reserves = me
        ops = bound_ops(name, action.min, action.max)
        marker = doc.get(MARKER_FIELD)
        self._stage("update", expect=marker, set=change, ops=ops, reserves=reserves)

    def _reserve_unread(self, scope: StepScope, action: Increment, name: str, me: str) -> bool:
        """Record the reservation in one update, without reading the document first, when
        the writes are checked client-side (FerretDB) and this process knows the marker it
        last recorded for the document; the document as it was must then pass what
        :meth:`reserve` checks after a read (no hold, a number, escrow), or the update is
        put back and the step runs again, reading, which says why."""
        if not self.session.checked_writes:
            return False
        marker = self.session.known_marker(self.target, self.key)
        if marker is None:
            return False

        reservation = Reservation(me, scope.tx_id, name, action.by).to_bson()
        spec = {**reservation, "min": action.min, "max": action.max}
        self._stage(
            "update",
            expect=marker,
            set={reservation_path(me, name): action.by},
            ops=bound_ops(name, action.min, action.max),
            reserve=spec,
            reserves=me,
            optimistic=True,
        )
        return True

    def _chain(self, own: Hold, me: str, action: Increment, name: str, bounds: Document) -> Hold:
        """``own`` with the increment ``action`` applied to the record it intends."""
        if own.intended is None:
            raise BusinessRejection(f"{self.where} does not exist")
        value = self._number(own.intended, name)
        result = check_increment(self.where, name, value, action.by, action.min, action.max, [])
        return own.joined(me, {**own.intended, name: result}, bounds)

    def commit(self, scope: StepScope, action: BuiltinAction) -> None:
        me = self.session.step_id(scope)
        if self._settle_reservation(action, me, commit=True):
            return
        doc = self._read()
        if doc is not None:
            marker = doc.get(MARKER_FIELD)
            hold = Hold.of(doc)
            if hold is not None and hold.tx_id == scope.tx_id:
                if hold.intended is None:
                    self._stage("delete", expect=marker, idempotent=True)
                    return
                now = fields_of(doc)
                wanted = hold.intended
                moved = {k: v for k, v in wanted.items() if k not in now or not _same(now[k], v)}
                gone = [k for k in now if k not in wanted]
                unset = [*gone, HOLD_FIELD]
                self._stage("update", expect=marker, set=moved, unset=unset, idempotent=True)
                return
            mine = [r for r in reservations(doc) if r.step_id == me]
            if mine:
                change: Document = {}
                value = doc.get(mine[0].field)
                if _is_number(value):
                    change[mine[0].field] = _add(value, mine[0].by, self.where)
                unset = self._dropping(doc, me)
                self._stage(
                    "update", expect=marker, set=change, unset=unset, idempotent=True, drops=(me,)
                )
                return
        shadow = self.session.read_shadow(self.target, self.key)
        hold = Hold.of(shadow)
        if shadow is None or hold is None or hold.tx_id != scope.tx_id:
            return  # committed already (by an earlier step of the saga, or before a crash)
        if doc is not None or hold.intended is None:
            # Nobody else may create a record held in its shadow: it is this commit's.
            self._stage_shadow("delete", expect=shadow.get(MARKER_FIELD), idempotent=True)
            return
        created = {**hold.intended, **({BOUNDS_FIELD: hold.bounds} if hold.bounds else {})}
        remove = {
            "target": self.session.shadow_name,
            "key": self._shadow_key,
            "marker": shadow.get(MARKER_FIELD),
        }
        self._stage("insert", document=created, then_remove=remove)

    def release(self, scope: StepScope, action: BuiltinAction) -> None:
        me = self.session.step_id(scope)
        if self._settle_reservation(action, me, commit=False):
            return
        doc = self._read()
        if doc is not None:
            marker = doc.get(MARKER_FIELD)
            hold = Hold.of(doc)
            if hold is not None and hold.tx_id == scope.tx_id:
                self._stage("update", expect=marker, unset=[HOLD_FIELD], idempotent=True)
                return
            if any(r.step_id == me for r in reservations(doc)):
                unset = self._dropping(doc, me)
                self._stage("update", expect=marker, unset=unset, idempotent=True, drops=(me,))
                return
        shadow = self.session.read_shadow(self.target, self.key)
        hold = Hold.of(shadow)
        if shadow is not None and hold is not None and hold.tx_id == scope.tx_id:
            self._stage_shadow("delete", expect=shadow.get(MARKER_FIELD), idempotent=True)

    def _settle_reservation(self, action: BuiltinAction, me: str, *, commit: bool) -> bool:
        """Commit (add the amount) or release ``me``'s reservation in one update, without
        reading the document, when this process wrote the reservation and has not removed
        it since (``SharedState.reserved``: so it is there, and a process dying before it
        could put back a write that missed leaves nothing wrong), knows the marker it last
        recorded for the document, and the amount is an integer (``$inc`` is exact on
        integers only; fractions are added in decimal, after a read). The update applies
        only if the document still carries that marker and the reservation, and the field
        holds an integer; else the step runs again, reading (see
        :mod:`~saga.participants.mongo._holds`). A commit is made so only where the
        server checks the conditions before it writes: MongoDB, or FerretDB when it looks
        such a filter up by ``_id`` (the write is then ``filtered``); a client-side check
        comes after the write, and readers must never see a business field written by a
        write that is then put back."""
        if not isinstance(action, Increment) or isinstance(action.by, float):
            return False
        checked = self.session.checked_writes
        if commit and checked and not self.session.narrows_by_id:
            # A client-side compare-and-set writes first and checks after: a commit that
            # missed would show its amount to readers until put back (added twice, when the
            # reservation was committed already). A commit changes business fields, so
            # there it reads first; a release changes reserved fields only.
            return False
        if not self.session.reservation_sure(me):
            return False
        marker = self.session.known_marker(self.target, self.key)
        if marker is None:
            return False
        name = self._counter(action.field)
        path = reservation_path(me, name)
        guard: Document = {path: action.by}
        ops: Document = {}
        if commit:
            guard[name] = INTEGER
            ops["$inc"] = {name: action.by}
        self._stage(
            "update",
            expect=marker,
            guard=guard,
            unset=[path],
            ops=ops,
            idempotent=True,
            optimistic=True,
            drops=(me,),
            filtered=commit and checked,
        )
        return True
