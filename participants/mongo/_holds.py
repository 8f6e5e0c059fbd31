"""Isolation on MongoDB documents: holds, reservations and recorded bounds (DESIGN §9).

Under ``read_committed`` a built-in step leaves the business fields of a document as
they are until its saga's commit is applied. What it holds or reserves is kept in the
store, in reserved fields of the document itself (names starting with ``_saga``, which
no step may write; a reader that wants the business fields only projects them away
with :data:`RESERVED_PROJECTION`):

* ``_saga_hold`` (:class:`Hold`): the saga holding the record (``tx``), its steps that
  hold it (``steps``, step ids ``participant:tx_id:step``), the record as those steps
  leave it (``doc``: Extended JSON text of its fields, ``null`` for *absent*) and, in
  a shadow document, the bounds its increments relied on (``bounds``, written with the
  record at commit). ``insert``, ``put``, ``update`` and
  ``delete`` hold; so does an ``increment`` of a record its own saga holds, folded into
  ``doc`` (later steps of a saga see what its earlier steps intend: same-saga steps are
  compatible, and one commit writes what they intend, in step order).
* ``_saga_res`` (:class:`Reservation`): the open escrow reservations of ``increment``
  steps, grouped by field: ``_saga_res.<field>.<step id>`` holds the amount (both levels
  escaped, :func:`reservation_path`), and the step id names the saga. One number each,
  because a hot record carries hundreds of them and FerretDB's cost per command grows
  with the document (100 open reservations cost it 4.8 ms per read and write, against
  12.5 ms when each also kept its step, saga and field). Each is a field of its own, so
  that a commit adds its amount and drops its reservation in one update without reading
  the document first: ``$inc`` and ``$unset``, compare-and-set on the marker this
  process last recorded for the document and on the reservation being there (a miss,
  such as a document changed by another process, makes the step run again, reading).
  It is done so only for a reservation this process wrote and has not removed since,
  which is sure to be there, and only where the server checks the conditions before
  it writes: MongoDB, and FerretDB where it looks a filter naming ``_id`` and more up
  by ``_id`` (the build of ``infra/services.sh``). A stock FerretDB would decode the
  whole collection for such a filter, and checking after the write instead would let
  a reader see the amount added (twice, if the reservation was committed already)
  until it is put back; there a commit reads the document first. A
  reservation itself is made without a read the same way; what it must pass is kept in
  its intent, so one found done after such a death is undone, not recorded, when it
  does not pass. A commit or release made without a read may leave an empty group
  behind, which counts as no reservation.
* ``_saga_bounds``: per field, the tightest ``min``/``max`` a bounded increment (at
  either level) relied on; a ``none`` compensation never leaves the field outside them.

Another saga's step on a held record fails at once with a reason naming the holder
(:func:`held_reason`), and so does a hold on a record with another saga's open
reservation: no step waits, so no wait can span participants into a deadlock, and no
partition is blocked behind a long saga; the saga rolls back and may be submitted again.
Reservations of different sagas never conflict: the escrow check (:func:`check_increment`)
counts the committed value and every open reservation on the field in the direction
that could break the bound, so whichever of them commit or roll back, no bound breaks.

A record that does not exist yet (an ``insert``, or a ``put`` creating it) must not
appear to a reader of the target collection before commit, so its hold lives in a
**shadow document** of its own collection (the ledger collection's name plus
:data:`SHADOW_SUFFIX`), ``_id`` = ``"<target>/<i|s>:<key>"``, with the same
``_saga_hold`` and the target and key. Its ``_id`` is unique, so two holders can never
both create it. Every step that finds a record absent and could create it (``insert`` and
``put`` at either level, every ``read_committed`` step) reads the shadow document under
the record's lock (the record and its shadow share one lock), so no one creates a
record another saga holds.

Atomicity with the ledger. Every hold, reservation, commit and release is one staged
single-document write (:class:`~saga.participants.mongo._writes.DocumentWrite`) of the
business or shadow document, compare-and-set on the ``_saga`` marker it read, recorded
with the step's ledger entry by the package's write protocol (:mod:`saga.participants.mongo`):
inside a transaction where the server has them, else through an intent, so a crash
leaves each hold or reservation applied exactly once. A commit or release of a hold or
reservation kept in the document it changes needs no intent: the write removes the hold
or reservation together with its effect, so running it again finds nothing to do, and a
decision redelivered after a crash between that write and its ledger record only records
the step (so the records of a batch's decisions are made together, at its end). The
one write that changes two documents, the commit that creates a record held
in its shadow document, goes through an intent like an apply: it inserts the record, and
its step document names the shadow document (``purge``) until it is removed, exactly as
a delete names the document it marked (whoever next loads the step removes it). A shadow
document whose holders are all decided (what a crash can leave) is removed by whoever
finds it (:meth:`~saga.participants.mongo._recovery._UnitRecovery.hold_open`). Pruning
never removes the ledger of a step that still holds or reserves (its entry is not
finished, see :func:`~saga.participants.mongo._ledger._finished_ms`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from saga.participants.mongo._ledger import _split_step_id
from saga.participants.mongo._values import (
    MARKER_FIELD,
    Document,
    _add,
    _from_text,
    _show_number,
    _to_text,
)
from saga.streams import BusinessRejection

HOLD_FIELD: Final = "_saga_hold"
RESERVATIONS_FIELD: Final = "_saga_res"
BOUNDS_FIELD: Final = "_saga_bounds"
SHADOW_SUFFIX: Final = "_holds"
"""The shadow collection is the ledger collection's name plus this suffix."""

RESERVED_PROJECTION: Final = {
    MARKER_FIELD: 0,
    HOLD_FIELD: 0,
    RESERVATIONS_FIELD: 0,
    BOUNDS_FIELD: 0,
}
"""A projection that shows a reader a document's business fields only."""

Number = int | float


def fields_of(doc: Mapping[str, Any]) -> Document:
    """A document's business fields: without ``_id`` and the reserved ``_saga`` fields."""
    return {k: v for k, v in doc.items() if k != "_id" and not k.startswith(MARKER_FIELD)}


def _step_number(step_id: str) -> str:
    parts = _split_step_id(step_id)
    return str(parts[2]) if parts is not None else step_id


@dataclass(frozen=True, slots=True)
class Hold:
    """The saga holding a record, and the record as its steps leave it (see the module doc)."""

    tx_id: str
    steps: tuple[str, ...]
    intended: Document | None
    bounds: Document = field(default_factory=dict)

    @classmethod
    def of(cls, doc: Mapping[str, Any] | None) -> Hold | None:
        """The hold a (business or shadow) document carries, if any."""
        raw = None if doc is None else doc.get(HOLD_FIELD)
        if not isinstance(raw, Mapping):
            return None
        text = raw.get("doc")
        intended = None if text is None else dict(_from_text(text))
        bounds = raw.get("bounds")
        return cls(
            str(raw.get("tx")),
            tuple(str(s) for s in raw.get("steps") or ()),
            intended,
            dict(bounds) if isinstance(bounds, Mapping) else {},
        )

    def to_bson(self) -> Document:
        return {
            "tx": self.tx_id,
            "steps": list(self.steps),
            "doc": None if self.intended is None else _to_text(self.intended),
            "bounds": dict(self.bounds),
        }

    def joined(self, step_id: str, intended: Document | None, bounds: Document) -> Hold:
        """This hold with one more step of its saga, which leaves the record ``intended``."""
        steps = self.steps if step_id in self.steps else (*self.steps, step_id)
        return Hold(self.tx_id, steps, intended, bounds)

    @property
    def step(self) -> str:
        """The first holding step's number, for messages."""
        return _step_number(self.steps[0]) if self.steps else "?"


@dataclass(frozen=True, slots=True)
class Reservation:
    """An open escrow reservation of ``by`` on ``field`` by step ``step_id`` of ``tx_id``,
    kept at ``path`` in its document (see :func:`reservation_path`)."""

    step_id: str
    tx_id: str
    field: str
    by: Number
    path: str = ""

    def to_bson(self) -> Document:
        """The reservation as an intent keeps it (what a write made without a read must
        pass, see :func:`fits_reservation`); the document keeps only ``by``."""
        return {"step": self.step_id, "tx": self.tx_id, "field": self.field, "by": self.by}


def _escaped(name: str) -> str:
    """``name`` as one level of a dotted path: ``%``, ``.`` and ``$`` escaped."""
    return name.replace("%", "%25").replace(".", "%2E").replace("$", "%24")


def _unescaped(key: str) -> str:
    return key.replace("%2E", ".").replace("%24", "$").replace("%25", "%")


def reservation_path(step_id: str, name: str) -> str:
    """The (dotted) field holding the amount step ``step_id`` reserves on field ``name``:
    ``_saga_res.<name>.<step id>``, each level escaped (a field name may not contain a
    dot). One number per reservation, grouped by field: a hot record carries hundreds
    of them, and each command on it costs FerretDB in proportion to its size."""
    return f"{RESERVATIONS_FIELD}.{_escaped(name)}.{_escaped(step_id)}"


def legacy_reservation_path(step_id: str) -> str:
    """Where an earlier version kept step ``step_id``'s reservation (see :func:`reservations`)."""
    return f"{RESERVATIONS_FIELD}.{_escaped(step_id)}"


def _amount(value: Any) -> Number | None:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def reservations(doc: Mapping[str, Any] | None) -> list[Reservation]:
    """The open reservations a document carries.

    Besides ``_saga_res.<field>.<step id>: by``, the shape an earlier version wrote is
    read too (``_saga_res.<step id>: {"step", "tx", "field", "by"}``), so reservations
    open across an upgrade are committed or released where they are. The two never
    collide: a step id is ``participant:tx_id:step``, never ``step``, which an earlier
    reservation always holds (as a string)."""
    raw = None if doc is None else doc.get(RESERVATIONS_FIELD)
    found: list[Reservation] = []
    for key, item in raw.items() if isinstance(raw, Mapping) else ():
        if not isinstance(item, Mapping):
            continue
        if isinstance(item.get("step"), str):  # the earlier shape
            by = _amount(item.get("by"))
            if by is not None:
                path = f"{RESERVATIONS_FIELD}.{key}"
                found.append(
                    Reservation(item["step"], str(item["tx"]), str(item["field"]), by, path)
                )
            continue
        name = _unescaped(str(key))
        for step_key, value in item.items():
            by = _amount(value)
            if by is None:
                continue
            step_id = _unescaped(str(step_key))
            parts = _split_step_id(step_id)
            tx_id = parts[1] if parts is not None else step_id
            path = f"{RESERVATIONS_FIELD}.{key}.{step_key}"
            found.append(Reservation(step_id, tx_id, name, by, path))
    return found


# ---------------------------------------------------------------- bounds


def bounds_of(recorded: Mapping[str, Any] | None, name: str) -> tuple[Number | None, Number | None]:
    """The tightest ``(min, max)`` recorded for field ``name``."""
    raw = None if recorded is None else recorded.get(name)
    if not isinstance(raw, Mapping):
        return None, None
    return raw.get("min"), raw.get("max")


def tightened(
    recorded: Mapping[str, Any] | None, name: str, low: Number | None, high: Number | None
) -> Document:
    """The recorded bounds once ``[low, high]`` on ``name`` is added (an absent bound is
    left out, never stored as null)."""
    old_low, old_high = bounds_of(recorded, name)
    lows = [b for b in (old_low, low) if b is not None]
    highs = [b for b in (old_high, high) if b is not None]
    bounds = {**({"min": max(lows)} if lows else {}), **({"max": min(highs)} if highs else {})}
    return {**(recorded or {}), name: bounds} if bounds else dict(recorded or {})


def bound_ops(name: str, low: Number | None, high: Number | None) -> Document:
    """The update operators that record ``[low, high]`` on field ``name`` in a document's
    bounds, keeping the tightest (``$max`` of the minimums, ``$min`` of the maximums;
    neither needs the document read first)."""
    ops: Document = {}
    if low is not None:
        ops["$max"] = {f"{BOUNDS_FIELD}.{name}.min": low}
    if high is not None:
        ops["$min"] = {f"{BOUNDS_FIELD}.{name}.max": high}
    return ops


def check_increment(
    where: str,
    name: str,
    committed: Number,
    by: Number,
    low: Number | None,
    high: Number | None,
    others: Iterable[Reservation],
) -> Number:
    """Escrow: raise :class:`BusinessRejection` unless ``committed + by`` stays within
    ``[low, high]`` whatever the open reservations ``others`` on the field do (each counted
    in the direction that could break the bound); return ``committed + by``."""
    others = list(others)
    result = _add(committed, by, f"{where} {name}")
    down: Number = 0
    up: Number = 0
    for reservation in others:
        if reservation.by < 0:
            down = _add(down, reservation.by, f"{where} {name}")
        else:
            up = _add(up, reservation.by, f"{where} {name}")
    lowest = _add(result, down, f"{where} {name}")
    highest = _add(result, up, f"{where} {name}")
    if low is not None and lowest < low:
        raise BusinessRejection(
            f"{where} {name} would be {_show_number(lowest)}{_counting(down)}, below the "
            f"minimum {_show_number(low)}"
        )
    if high is not None and highest > high:
        raise BusinessRejection(
            f"{where} {name} would be {_show_number(highest)}{_counting(up)}, above the "
            f"maximum {_show_number(high)}"
        )
    return result


def fits_reservation(doc: Mapping[str, Any], spec: Mapping[str, Any]) -> bool:
    """Whether the reservation ``spec`` (``step``, ``field``, ``by``, ``min``, ``max``)
    passes what a reservation made after a read checks, on ``doc`` (with or without
    the reservation itself): no hold, a number in the field, escrow."""
    name = str(spec["field"])
    value = doc.get(name)
    if Hold.of(doc) is not None or not isinstance(value, int | float) or isinstance(value, bool):
        return False
    others = [r for r in reservations(doc) if r.field == name and r.step_id != spec["step"]]
    try:
        check_increment("", name, value, spec["by"], spec.get("min"), spec.get("max"), others)
    except BusinessRejection:
        return False
    return True


def _counting(amount: Number) -> str:
    if not amount:
        return ""
    return f" once the open reservations of other sagas ({_show_number(amount)}) commit"


# ---------------------------------------------------------------- wording

RETRY: Final = "retry after it"
NOT_RESTORED: Final = "not restored (a replayed rollback tries again)"


def held_reason(where: str, hold: Hold, then: str = RETRY) -> str:
    return f"{where} is held by saga {hold.tx_id} (step {hold.step}) until its decision; {then}"


def reserved_reason(where: str, reservation: Reservation, then: str = RETRY) -> str:
    return (
        f"{where} has an open reservation of saga {reservation.tx_id} "
        f"(step {_step_number(reservation.step_id)}) until its decision; {then}"
    )
