"""Column values: a step's JSON scalars as the column's Python values, and back.

Before-images, holds and reservations are JSON: ``Decimal`` as its exact string,
dates and times as ISO 8601, UUIDs as strings, bytes as hex; :func:`from_json`
converts them back by the column's type.
"""

from __future__ import annotations

import re
import uuid
from datetime import date, datetime, time
from decimal import Decimal, InvalidOperation
from typing import Any, Final

from sqlalchemy import Column
from sqlalchemy.sql import sqltypes

from saga.streams import BusinessRejection

_INTEGER_TEXT: Final = re.compile(r"[+-]?[0-9]+")


def coerce(column: Column[Any], value: Any, what: str) -> Any:
    """``value`` (a JSON scalar) as the Python value ``column`` stores, or a rejection."""
    if value is None:
        return None
    kind = column.type
    try:
        if isinstance(kind, sqltypes.Boolean):
            if isinstance(value, bool):
                return value
        elif isinstance(kind, sqltypes.Integer):
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, str) and _INTEGER_TEXT.fullmatch(value):
                return int(value)
        elif isinstance(kind, sqltypes.Numeric) and not kind.asdecimal:  # Float, usually
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value)
        elif isinstance(kind, sqltypes.Numeric):
            if isinstance(value, int | float | str) and not isinstance(value, bool):
                # str(float) is the shortest exact spelling: 0.1 stays 0.1, not
                # 0.1000000000000000055...
                number = Decimal(str(value))
                if number.is_finite():
                    return number
        elif isinstance(kind, sqltypes.String):
            if isinstance(value, str):
                return value
            if isinstance(value, int | float) and not isinstance(value, bool):
                return str(value)
        elif isinstance(kind, sqltypes.DateTime):
            if isinstance(value, str):
                return datetime.fromisoformat(value)
        elif isinstance(kind, sqltypes.Date):
            if isinstance(value, str):
                return date.fromisoformat(value)
        elif isinstance(kind, sqltypes.Time):
            if isinstance(value, str):
                return time.fromisoformat(value)
        elif isinstance(kind, sqltypes.Uuid):
            if isinstance(value, str):
                parsed = uuid.UUID(value)
                return parsed if kind.as_uuid else str(parsed)
        else:
            return value  # a type this adapter does not know: the database decides
    except (ValueError, InvalidOperation):
        pass
    raise BusinessRejection(
        f"{what} is {value!r}, which does not fit column {column.table.name}.{column.name} ({kind})"
    )


def to_json(value: Any) -> Any:
    """A column value as JSON, for a before-image or a hold (see the module doc)."""
    if value is None or isinstance(value, bool | int | float | str | list | dict):
        return value
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    return str(value)


def from_json(column: Column[Any], value: Any) -> Any:
    """The inverse of :func:`to_json` for ``column``."""
    if not isinstance(value, str):
        return value
    kind = column.type
    if isinstance(kind, sqltypes.Numeric):
        return Decimal(value) if kind.asdecimal else float(value)
    if isinstance(kind, sqltypes.Integer):
        return int(value)
    if isinstance(kind, sqltypes.DateTime):
        return datetime.fromisoformat(value)
    if isinstance(kind, sqltypes.Date):
        return date.fromisoformat(value)
    if isinstance(kind, sqltypes.Time):
        return time.fromisoformat(value)
    if isinstance(kind, sqltypes.LargeBinary):
        return bytes.fromhex(value)
    if isinstance(kind, sqltypes.Uuid) and kind.as_uuid:
        return uuid.UUID(value)
    return value


def record_text(pk: Column[Any], key: Any) -> str:
    """A record's key (as :func:`coerce` made it for primary key ``pk``) as the text the
    holds table keys it by: one text for every spelling the database takes as that key
    (a ``char(n)`` key with or without its padding)."""
    if isinstance(key, str) and isinstance(pk.type, sqltypes.CHAR):
        return key.rstrip(" ")
    return str(to_json(key))


def column_range(column: Column[Any], dialect: str) -> tuple[Any, Any] | None:
    """The smallest and largest value ``column`` stores on ``dialect`` (``None``: no
    limit known here), so that an increment is refused when it is reserved rather than
    when its commit writes it."""
    kind = column.type
    mysql = dialect in ("mysql", "mariadb")
    if isinstance(kind, sqltypes.Integer):
        bits = 64
        if (dialect == "postgresql" or mysql) and not isinstance(kind, sqltypes.BigInteger):
            bits = 16 if isinstance(kind, sqltypes.SmallInteger) else 32
            # MySQL's TINYINT and MEDIUMINT (reflected as themselves, not as SMALLINT)
            bits = {"TINYINT": 8, "MEDIUMINT": 24}.get(type(kind).__name__, bits)
        if mysql and getattr(kind, "unsigned", False):
            return 0, 2**bits - 1
        return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if (
        (dialect == "postgresql" or mysql)
        and isinstance(kind, sqltypes.Numeric)
        and kind.asdecimal
        and kind.precision is not None
    ):
        scale = kind.scale or 0
        largest = Decimal(10) ** (kind.precision - scale) - Decimal(1).scaleb(-scale)
        return -largest, largest
    return None
