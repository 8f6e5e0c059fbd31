"""Isolation on Redis: the side hash beside each record (DESIGN.md §9).

A record ``<prefix>:<target>:<key>`` is a plain hash that readers ``HGET``; what sagas
hold or reserve on it lives beside it, in ``<prefix>:ledger:+isolation:<target>:<key>``
(:func:`participants.redis._session.side_key`), a hash of::

    hold                the saga (tx id) that holds the record, while it has a hold
    h:<tx_id>:<step>    one hold: JSON {"action": ..., "fields": {name: text or null}},
                        the change its commit writes (delete: no fields)
    r:<tx_id>:<step>    one escrow reservation: "<field>:<by>"
    neg:<field>         the sum of the open negative reservations on the field (absent: 0)
    pos:<field>         the sum of the open positive reservations (absent: 0)
    min:<field>         the tightest minimum any bounded increment of the field relied on
    max:<field>         the tightest maximum

Every change to it is queued in the same ``MULTI``/``EXEC`` (or made by the same script
call) as the step's ledger entry, so a crash neither loses nor repeats one; pruning the
ledger never touches it (a hold or reservation goes only by its commit or release). The
counters and bounds are canonical integer text whenever their value is an integer, so
the batch script (which does exact arithmetic on integers only) keeps handling them;
a counter that reaches 0 is removed.

Texts the script builds too (:data:`participants.redis._script.SCRIPT`) are made here
by :func:`held_reason`; the batch path's parity tests compare the two.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Final

HOLDER: Final = "hold"
COUNTED: Final = " (counting open reservations)"
"""Said after a value that counts open reservations of other sagas."""
BOUND_TAIL: Final = " that a bounded increment relied on; not restored"
"""The end of a ``none`` compensation's refusal to cross a recorded bound."""


def hold_field(tx_id: str, step: int) -> str:
    return f"h:{tx_id}:{step}"


def reservation_field(tx_id: str, step: int) -> str:
    return f"r:{tx_id}:{step}"


def counter_field(field: str, by: Decimal | int | float) -> str:
    """Where a reservation of ``by`` on ``field`` is summed (``neg:`` or ``pos:``)."""
    return f"{'neg' if by < 0 else 'pos'}:{field}"


def held_reason(where: str, tx_id: str, step: int) -> str:
    return f"{where} is held by saga {tx_id} (step {step}) until its decision; retry after it"


def reserved_reason(where: str, tx_id: str, step: int) -> str:
    return (
        f"{where} has an open reservation of saga {tx_id} (step {step}) until its decision; "
        "retry after it"
    )


def canonical(value: Decimal) -> str:
    """A number as the side hash keeps it: integer text when integral, else plain decimal."""
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def number(value: int | float) -> Decimal:
    return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)


@dataclass(frozen=True, slots=True)
class Held:
    """One hold: the saga, its step and the change its commit writes."""

    tx_id: str
    step: int
    action: str
    fields: Mapping[str, str | None]


def hold_text(action: str, fields: Mapping[str, str | None]) -> str:
    return json.dumps({"action": action, "fields": dict(fields)}, separators=(",", ":"))


def _owner(name: str, head: str) -> tuple[str, int] | None:
    """``(tx_id, step)`` of a ``h:``/``r:`` field name with ``head``; ``None`` otherwise."""
    if not name.startswith(head):
        return None
    tx_id, _, step = name[len(head) :].rpartition(":")
    return (tx_id, int(step)) if tx_id and step.isdigit() else None


class Side:
    """A side hash as read (under ``WATCH``): who holds and reserves what."""

    def __init__(self, fields: Mapping[str, str]) -> None:
        self.fields = dict(fields)

    def holds(self) -> list[Held]:
        """Every hold, by saga and step."""
        found: list[Held] = []
        for name, text in self.fields.items():
            owner = _owner(name, "h:")
            if owner is None:
                continue
            data = json.loads(text)
            found.append(Held(owner[0], owner[1], str(data["action"]), dict(data["fields"])))
        return sorted(found, key=lambda held: (held.tx_id, held.step))

    def holder(self) -> tuple[str, int] | None:
        """The holding saga and its lowest holding step (a ``hold`` without any ``h:``
        field of its saga is stale and ignored, as the script ignores it)."""
        tx_id = self.fields.get(HOLDER)
        if tx_id is None:
            return None
        steps = [held.step for held in self.holds() if held.tx_id == tx_id]
        return (tx_id, min(steps)) if steps else None

    def reservations(self) -> list[tuple[str, int]]:
        found = [_owner(name, "r:") for name in self.fields]
        return sorted(owner for owner in found if owner is not None)

    def other_reservation(self, tx_id: str | None) -> tuple[str, int] | None:
        """An open reservation of another saga than ``tx_id`` (the first one)."""
        return next((owner for owner in self.reservations() if owner[0] != tx_id), None)

    def counter(self, field: str, negative: bool) -> str | None:
        return self.fields.get(f"{'neg' if negative else 'pos'}:{field}")

    def bound(self, field: str, low: bool) -> str | None:
        return self.fields.get(f"{'min' if low else 'max'}:{field}")


def view(record: Mapping[str, str] | None, holds: list[Held]) -> dict[str, str] | None:
    """``record`` with ``holds`` committed on it in order (what a saga's later step sees)."""
    current = None if record is None else dict(record)
    for held in holds:
        current = committed(current, held.action, held.fields)
    return current


def committed(
    record: Mapping[str, str] | None, action: str, fields: Mapping[str, str | None]
) -> dict[str, str] | None:
    """What a hold's commit leaves of ``record`` (``None``: absent). Never fails: an
    update of an absent record changes nothing, a change leaving no field removes it."""
    if action == "delete" or (action == "update" and record is None):
        return None
    after = {k: v for k, v in {**(record or {}), **fields}.items() if v is not None}
    return after or None


def tighter(current: str | None, bound: int | float, low: bool) -> str | None:
    """The bound to record instead of ``current`` (``None``: ``current`` is as tight)."""
    new = number(bound)
    if current is not None:
        old = Decimal(current)
        if (new <= old) if low else (new >= old):
            return None
    return canonical(new)


def plus(*texts: str) -> str:
    """The sum of number texts: integer text when every one is, else exact decimal."""
    if all(_is_int(text) for text in texts):
        return str(sum(int(text) for text in texts))
    return format(sum((Decimal(text) for text in texts), Decimal(0)), "f")


def _is_int(text: str) -> bool:
    body = text[1:] if text[:1] in "+-" else text
    return body.isdigit() and body.isascii()


def show(value: Any) -> str:
    """A field's text for a reason: quoted, or ``absent``."""
    return "absent" if value is None else repr(value[:40] if isinstance(value, str) else value)
