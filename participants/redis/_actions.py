"""The built-in actions on Redis hash records (see :mod:`participants._redis`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any, Final

from saga.participants._actions import BuiltinAction, BuiltinActions, Increment, Key, RecordOps
from saga.participants.redis._session import RedisSession
from saga.streams import BusinessRejection

_INTEGER_TEXT: Final = re.compile(r"[+-]?[0-9]+")
_NUMBER_TEXT: Final = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


class RedisActions(BuiltinActions[RedisSession]):
    """The built-in actions on hash records (``native`` must be a :class:`RedisSession`).

    Before-images: ``put`` and ``delete`` keep the whole old hash (``put`` of a new
    key: ``None``), ``update`` the old text of each field it sets (``None``: the
    field was absent), ``increment`` the old text of its field. Compensations
    restore exactly that: ``put`` rewrites the whole hash.
    """

    def record(self, native: RedisSession, action: BuiltinAction) -> RecordOps:
        return _Record(native, action.target, action.key)


class _Record:
    """One hash record, addressed by the step's target and key."""

    def __init__(self, session: RedisSession, target: str, key: Key) -> None:
        self.session = session
        self.target = target
        self.key = key
        self.name = session.key(target, key)
        self.where = f"{target}/{key}"

    def _read(self) -> dict[str, str] | None:
        return self.session.read(self.target, self.key)

    def _existing(self) -> dict[str, str]:
        record = self._read()
        if record is None:
            raise BusinessRejection(f"{self.where} does not exist")
        return record

    def _write(self, current: Mapping[str, str], values: Mapping[str, str | None]) -> None:
        """Queue the change of ``values`` (``None``: remove the field) on ``current``."""
        after = {k: v for k, v in {**current, **values}.items() if v is not None}
        if not after:
            raise BusinessRejection(
                f"{self.where} would have no fields left; a Redis record needs at least one "
                "field that is not null"
            )
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

    # -- actions

    def insert(self, fields: Mapping[str, Any]) -> None:
        values = _texts(fields)
        if self._read() is not None:
            raise BusinessRejection(f"{self.where} already exists")
        self._write({}, values)

    def put(self, fields: Mapping[str, Any]) -> dict[str, str] | None:
        values = _texts(fields)
        current = self._read()
        self._write(current or {}, values)
        return current

    def update(self, fields: Mapping[str, Any]) -> dict[str, str | None]:
        values = _texts(fields)
        current = self._existing()
        self._write(current, values)
        return {name: current.get(name) for name in values}

    def delete(self) -> dict[str, str]:
        current = self._existing()
        self.session.queue("DEL", self.name)
        return current

    def increment(self, action: Increment) -> dict[str, str]:
        current = self._existing()
        old = self._number(current, action.field)
        result = _add(old, action.by)
        value = _decimal(result)
        if action.min is not None and value < _decimal_of(action.min):
            raise BusinessRejection(
                f"{self.where} {action.field} would be {result}, below the minimum "
                f"{_show_number(action.min)}"
            )
        if action.max is not None and value > _decimal_of(action.max):
            raise BusinessRejection(
                f"{self.where} {action.field} would be {result}, above the maximum "
                f"{_show_number(action.max)}"
            )
        self.session.queue("HSET", self.name, action.field, result)
        return {action.field: old}

    # -- compensations

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
