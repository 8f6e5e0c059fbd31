"""The built-in actions on Redis hash records (see :mod:`participants.redis._adapter`),
at both isolation levels (the side hash: :mod:`participants.redis._isolation`)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any, Final

from saga.participants._actions import (
    BuiltinAction,
    BuiltinActions,
    Delete,
    Increment,
    Insert,
    Key,
    Put,
    RecordOps,
    Update,
)
from saga.participants._storage import StepScope
from saga.participants.redis._isolation import (
    BOUND_TAIL,
    COUNTED,
    HOLDER,
    Side,
    canonical,
    committed,
    counter_field,
    held_reason,
    hold_field,
    hold_text,
    plus,
    reservation_field,
    reserved_reason,
    show,
    tighter,
    view,
)
from saga.participants.redis._session import RedisSession
from saga.streams import BusinessRejection

_INTEGER_TEXT: Final = re.compile(r"[+-]?[0-9]+")
_NUMBER_TEXT: Final = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


class RedisActions(BuiltinActions[RedisSession]):
    """The built-in actions on hash records (``native`` must be a :class:`RedisSession`).

    Before-images (``none``): ``put`` and ``delete`` keep the whole old hash (``put`` of
    a new key: ``None``), ``update`` the old text of each field it sets (``None``: the
    field was absent), ``increment`` the old text of its field. Compensations restore
    exactly that: ``put`` rewrites the whole hash. Under ``read_committed`` the record
    is left alone until the commit; the side hash holds what the step holds.
    """

    def record(self, native: RedisSession, action: BuiltinAction) -> RecordOps:
        return _Record(native, action.target, action.key)


class _Record:
    """One hash record, addressed by the step's target and key, with its side hash.

    Both are read together, watched, once per step (:meth:`_load`); every write is
    queued for the step's ``MULTI``/``EXEC``.
    """

    def __init__(self, session: RedisSession, target: str, key: Key) -> None:
        self.session = session
        self.target = target
        self.key = key
        self.name = session.key(target, key)
        self.side_name = session.side_key(target, key)
        self.where = f"{target}/{key}"
        self._loaded: tuple[dict[str, str] | None, Side] | None = None

    def _load(self) -> tuple[dict[str, str] | None, Side]:
        if self._loaded is None:
            record, side = self.session.read_with_side(self.target, self.key)
            self._loaded = (record, Side(side))
        return self._loaded

    def _read(self) -> dict[str, str] | None:
        return self._load()[0]

    def _existing(self) -> dict[str, str]:
        record = self._read()
        if record is None:
            raise BusinessRejection(f"{self.where} does not exist")
        return record

    def _free(self, tx_id: str | None, *, hold: bool) -> None:
        """Refuse when another saga than ``tx_id`` holds the record (and, for a ``hold``,
        when another saga has a reservation on it)."""
        side = self._load()[1]
        holder = side.holder()
        if holder is not None and holder[0] != tx_id:
            raise BusinessRejection(held_reason(self.where, *holder))
        if hold:
            other = side.other_reservation(tx_id)
            if other is not None:
                raise BusinessRejection(reserved_reason(self.where, *other))

    def _write(self, current: Mapping[str, str], values: Mapping[str, str | None]) -> None:
        """Queue the change of ``values`` (``None``: remove the field) on ``current``."""
        after = {k: v for k, v in {**current, **values}.items() if v is not None}
        if not after:
            raise BusinessRejection(self._empty())
        self._change(current, values)

    def _empty(self) -> str:
        return (
            f"{self.where} would have no fields left; a Redis record needs at least one "
            "field that is not null"
        )

    def _change(self, current: Mapping[str, str], values: Mapping[str, str | None]) -> None:
        kept = [
            item for name, value in values.items() if value is not None for item in (name, value)
        ]
        removed = [name for name, value in values.items() if value is None and name in current]
        if kept:
            self.session.queue("HSET", self.name, *kept)
        if removed:
            self.session.queue("HDEL", self.name, *removed)

    def _replace(self, image: Mapping[str, str]) -> None:
        self.session.queue("DEL", self.name)
        self.session.queue("HSET", self.name, *[item for pair in image.items() for item in pair])

    # -- actions, level none

    def insert(self, fields: Mapping[str, Any]) -> None:
        values = _texts(fields)
        self._free(None, hold=True)
        if self._read() is not None:
            raise BusinessRejection(f"{self.where} already exists")
        self._write({}, values)

    def put(self, fields: Mapping[str, Any]) -> dict[str, str] | None:
        values = _texts(fields)
        self._free(None, hold=True)
        current = self._read()
        self._write(current or {}, values)
        return current

    def update(self, fields: Mapping[str, Any]) -> dict[str, str | None]:
        values = _texts(fields)
        self._free(None, hold=True)
        current = self._existing()
        self._write(current, values)
        return {name: current.get(name) for name in values}

    def delete(self) -> dict[str, str]:
        self._free(None, hold=True)
        current = self._existing()
        self.session.queue("DEL", self.name)
        return current

    def increment(self, action: Increment) -> dict[str, str]:
        self._free(None, hold=False)
        current = self._existing()
        old = self._number(current, action.field)
        result = _add(old, action.by)
        side = self._load()[1]
        low = side.counter(action.field, True) if action.min is not None else None
        high = side.counter(action.field, False) if action.max is not None else None
        self._check_bounds(
            action,
            result if low is None else plus(result, low),
            low is not None,
            result if high is None else plus(result, high),
            high is not None,
        )
        self.session.queue("HSET", self.name, action.field, result)
        self._record_bounds(action)
        return {action.field: old}

    def _check_bounds(
        self, action: Increment, low: str, low_counted: bool, high: str, high_counted: bool
    ) -> None:
        """Refuse when ``low`` is below ``action.min`` or ``high`` above ``action.max``
        (each the value the check counts; ``*_counted``: it counts open reservations)."""
        head = f"{self.where} {action.field} would be "
        if action.min is not None and _decimal(low) < _decimal_of(action.min):
            raise BusinessRejection(
                f"{head}{low}{COUNTED if low_counted else ''}, below the minimum "
                f"{_show_number(action.min)}"
            )
        if action.max is not None and _decimal(high) > _decimal_of(action.max):
            raise BusinessRejection(
                f"{head}{high}{COUNTED if high_counted else ''}, above the maximum "
                f"{_show_number(action.max)}"
            )

    def _record_bounds(self, action: Increment) -> None:
        """Keep the tightest bound a bounded increment of the field relied on."""
        side = self._load()[1]
        for low, bound in ((True, action.min), (False, action.max)):
            if bound is None:
                continue
            text = tighter(side.bound(action.field, low), bound, low)
            if text is not None:
                name = f"{'min' if low else 'max'}:{action.field}"
                self.session.queue("HSET", self.side_name, name, text)

    # -- compensations, level none

    def guard(self, action: BuiltinAction, before: Any) -> None:
        """Refuse a ``none`` compensation that would overwrite another saga's work (see
        :class:`participants._actions.RecordOps`); the compensation itself reports a
        record that is gone or a before-image that is missing."""
        if isinstance(action, Increment):
            self._guard_increment(action)
            return
        record = self._read()
        self._free(None, hold=True)
        if isinstance(action, Insert | Put):
            image: dict[str, str] | None = None
            if isinstance(action, Put) and before is not None:
                if not isinstance(before, Mapping):
                    return  # restore_put says the before-image is missing
                image = {str(k): str(v) for k, v in before.items()}
            if record is not None:
                self._unchanged(record, committed(image, "put", _texts(action.value)) or {})
        elif isinstance(action, Update) and record is not None:
            values = _texts(action.set)
            self._unchanged({n: v for n, v in record.items() if n in values}, values)

    def _unchanged(self, record: Mapping[str, str], wrote: Mapping[str, str | None]) -> None:
        for name in sorted(set(record) | set(wrote)):
            if record.get(name) != wrote.get(name):
                raise BusinessRejection(
                    f"{self.where} changed since this step wrote it: {name} is "
                    f"{show(record.get(name))}, not {show(wrote.get(name))}; not restored"
                )

    def _guard_increment(self, action: Increment) -> None:
        record, side = self._load()
        text = None if record is None else record.get(action.field)
        if text is None or not _NUMBER_TEXT.fullmatch(text) or action.by == 0:
            return  # increment_back says what is wrong
        post = _add(text, -action.by)
        low = action.by > 0  # the compensation lowers the value
        bound = side.bound(action.field, low)
        if bound is None:
            return
        counter = side.counter(action.field, low)
        value = post if counter is None else plus(post, counter)
        if (_decimal(value) < _decimal(bound)) if low else (_decimal(value) > _decimal(bound)):
            side_word = "below the minimum" if low else "above the maximum"
            raise BusinessRejection(
                f"{self.where} {action.field} would be {value}{COUNTED if counter else ''}, "
                f"{side_word} {bound}{BOUND_TAIL}"
            )

    def remove(self) -> None:
        # Already gone is fine: the compensation wants the key absent.
        self.session.queue("DEL", self.name)

    def restore_put(self, before: Any) -> None:
        if before is None:
            self.remove()
            return
        self._replace(_image(before, f"the before-image of {self.where} is missing"))

    def restore_fields(self, before: Any) -> None:
        if not isinstance(before, Mapping):
            raise BusinessRejection(
                f"the before-image of {self.where} is missing; the update cannot be undone"
            )
        current = self._read()
        if current is None:
            raise BusinessRejection(
                f"{self.where} no longer exists, so its update cannot be undone"
            )
        values = {str(k): None if v is None else str(v) for k, v in before.items()}
        self._write(current, values)

    def reinsert(self, before: Any) -> None:
        image = _image(before, f"the before-image of {self.where} is missing")
        if self._read() is not None:
            raise BusinessRejection(
                f"{self.where} exists again, so the deleted record cannot be restored"
            )
        self._replace(image)

    def increment_back(self, action: Increment, before: Any) -> None:
        current = self._read()
        if current is None:
            raise BusinessRejection(
                f"{self.where} no longer exists, so its increment of {action.field} "
                "cannot be undone"
            )
        now = self._number(current, action.field)
        result = _add(now, -action.by)
        old = before.get(action.field) if isinstance(before, Mapping) else None
        if (
            isinstance(old, str)
            and _NUMBER_TEXT.fullmatch(old)
            and _decimal(old) == _decimal(result)
        ):
            result = old  # the old spelling exactly ("10.50", "100" rather than "100.0")
        self.session.queue("HSET", self.name, action.field, result)

    def _number(self, record: Mapping[str, str], name: str) -> str:
        text = record.get(name)
        if text is None:
            raise BusinessRejection(f"{self.where} has no value in {name}")
        if not _NUMBER_TEXT.fullmatch(text):
            raise BusinessRejection(f"{self.where} {name} is not a number ({text[:40]!r})")
        return text

    # -- read_committed: holds and escrow

    def _view(self, scope: StepScope) -> dict[str, str] | None:
        """The record as ``scope``'s step sees it: committed, with its saga's holds of
        earlier steps on top (in the order their commits write)."""
        record, side = self._load()
        mine = [h for h in side.holds() if h.tx_id == scope.tx_id and h.step < scope.step]
        return view(record, mine)

    def hold(self, scope: StepScope, action: Insert | Put | Update | Delete) -> None:
        self._free(scope.tx_id, hold=True)
        current = self._view(scope)
        kind, values = _change_of(action)
        if isinstance(action, Insert) and current is not None:
            raise BusinessRejection(f"{self.where} already exists")
        if isinstance(action, Update | Delete) and current is None:
            raise BusinessRejection(f"{self.where} does not exist")
        if kind != "delete" and committed(current, kind, values) is None:
            raise BusinessRejection(self._empty())
        field = hold_field(scope.tx_id, scope.step)
        text = hold_text(kind, values)
        self.session.queue("HSET", self.side_name, field, text, HOLDER, scope.tx_id)

    def reserve(self, scope: StepScope, action: Increment) -> None:
        self._free(scope.tx_id, hold=False)
        current = self._view(scope)
        if current is None:
            raise BusinessRejection(f"{self.where} does not exist")
        old = self._number(current, action.field)
        side = self._load()[1]
        low = side.counter(action.field, True) if action.min is not None else None
        high = side.counter(action.field, False) if action.max is not None else None
        by = _by_text(action.by)
        self._check_bounds(
            action,
            plus(old, low or "0", by if action.by < 0 else "0"),
            low is not None,
            plus(old, high or "0", by if action.by > 0 else "0"),
            high is not None,
        )
        field = reservation_field(scope.tx_id, scope.step)
        self.session.queue("HSET", self.side_name, field, f"{action.field}:{by}")
        self._count(action.field, action.by)
        self._record_bounds(action)

    def _count(self, field: str, by: int | float, *, drop: bool = False) -> None:
        """Add a reservation of ``by`` to the field's sum of reservations in its
        direction (``drop``: take it away)."""
        if by == 0:
            return
        name = counter_field(field, by)
        change = _by_text(-by if drop else by)
        total = Decimal(plus(self._load()[1].fields.get(name) or "0", change))
        if total == 0:
            self.session.queue("HDEL", self.side_name, name)
        else:
            self.session.queue("HSET", self.side_name, name, canonical(total))

    def commit(self, scope: StepScope, action: BuiltinAction) -> None:
        """Write what the step held or reserved; nothing when it is gone already (the
        commit was applied) — never fails (a record removed behind the product's back
        takes no reservation)."""
        record, side = self._load()
        if isinstance(action, Increment):
            name = reservation_field(scope.tx_id, scope.step)
            if name not in side.fields:
                return
            text = None if record is None else record.get(action.field)
            if text is not None and _NUMBER_TEXT.fullmatch(text):
                self.session.queue("HSET", self.name, action.field, _add(text, action.by))
            self.session.queue("HDEL", self.side_name, name)
            self._count(action.field, action.by, drop=True)
            return
        name = hold_field(scope.tx_id, scope.step)
        held = side.fields.get(name)
        if held is None:
            return
        data = json.loads(held)
        kind, values = str(data["action"]), dict(data["fields"])
        after = committed(record, kind, values)
        if after is None:
            if record is not None:
                self.session.queue("DEL", self.name)
        else:
            self._change(record or {}, values)
        if kind == "delete":
            bounds = [f for f in side.fields if f.startswith(("min:", "max:"))]
            if bounds:
                self.session.queue("HDEL", self.side_name, *bounds)
        self._drop_hold(scope, side)

    def release(self, scope: StepScope, action: BuiltinAction) -> None:
        """Drop what the step held or reserved (nothing when it is gone already)."""
        side = self._load()[1]
        if isinstance(action, Increment):
            name = reservation_field(scope.tx_id, scope.step)
            if name in side.fields:
                self.session.queue("HDEL", self.side_name, name)
                self._count(action.field, action.by, drop=True)
            return
        if hold_field(scope.tx_id, scope.step) in side.fields:
            self._drop_hold(scope, side)

    def _drop_hold(self, scope: StepScope, side: Side) -> None:
        name = hold_field(scope.tx_id, scope.step)
        others = [h for h in side.holds() if h.tx_id == scope.tx_id and h.step != scope.step]
        dropped = [name] if others or side.fields.get(HOLDER) != scope.tx_id else [name, HOLDER]
        self.session.queue("HDEL", self.side_name, *dropped)


def _change_of(action: Insert | Put | Update | Delete) -> tuple[str, dict[str, str | None]]:
    """What a hold keeps: the action's name and the field texts its commit writes."""
    if isinstance(action, Insert):
        return "insert", _texts(action.value)
    if isinstance(action, Put):
        return "put", _texts(action.value)
    if isinstance(action, Update):
        return "update", _texts(action.set)
    return "delete", {}


def _by_text(by: int | float) -> str:
    return str(by) if isinstance(by, int) else repr(by)


# ---------------------------------------------------------------- values


def value_text(value: Any) -> str | None:
    """A JSON scalar as hash-field text; ``None`` for null (the field is removed)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _texts(fields: Mapping[str, Any]) -> dict[str, str | None]:
    return {name: value_text(value) for name, value in fields.items()}


def _decimal(text: str) -> Decimal:
    return Decimal(text)


def _decimal_of(number: int | float) -> Decimal:
    return Decimal(repr(number)) if isinstance(number, float) else Decimal(number)


def _add(text: str, by: int | float) -> str:
    """``text + by`` as text: integers stay integers, otherwise exact decimal arithmetic."""
    if _INTEGER_TEXT.fullmatch(text) and isinstance(by, int):
        return str(int(text) + by)
    try:
        total = Decimal(text) + _decimal_of(by)
    except InvalidOperation as exc:  # pragma: no cover - the pattern admits only numbers
        raise BusinessRejection(f"{text!r} is not a number") from exc
    return format(total, "f")


def _show_number(value: int | float) -> str:
    return str(value) if isinstance(value, int) else repr(value)


def _image(image: Any, missing: str) -> dict[str, str]:
    if not isinstance(image, Mapping) or not image:
        raise BusinessRejection(missing)
    return {str(k): str(v) for k, v in image.items()}
