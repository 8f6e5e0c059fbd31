"""Values of the MongoDB storage: numbers, before-images and the ledger's JSON text.

Part of :mod:`saga.participants.mongo` (see its module doc, *Values*).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any, Final, TypeGuard

from bson import json_util
from bson.json_util import JSONMode, JSONOptions

from saga.participants._actions import INT64_MAX, INT64_MIN
from saga.streams import BusinessRejection

Document = dict[str, Any]


MARKER_FIELD: Final = "_saga"
"""The field of a business document naming the last saga write (see :func:`_new_marker`)."""


_CANONICAL_INT: Final = re.compile(r"-?(0|[1-9][0-9]{0,18})")
_RELAXED: Final = JSONOptions(json_mode=JSONMode.RELAXED)


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _add(current: int | float, by: int | float, what: str) -> int | float:
    """``current + by``: integers exactly; fractions in decimal on the shortest spelling."""
    if isinstance(current, int) and isinstance(by, int):
        result = current + by
        if not INT64_MIN <= result <= INT64_MAX:
            raise BusinessRejection(f"{what} would be {result}, which does not fit in 64 bits")
        return result
    total = Decimal(repr(current)) + Decimal(repr(by))
    return float(total)


def _show_number(value: int | float) -> str:
    return str(value) if isinstance(value, int) else repr(value)


def _show(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _image(doc: Mapping[str, Any]) -> Any:
    """A document's fields (not ``_id``, not the marker) as relaxed Extended JSON."""
    fields = {k: v for k, v in doc.items() if k != "_id" and not k.startswith(MARKER_FIELD)}
    return json.loads(json_util.dumps(fields, json_options=_RELAXED))


def _restored(image: Any, missing: str) -> Document:
    """The inverse of :func:`_image`."""
    if not isinstance(image, Mapping):
        raise BusinessRejection(missing)
    restored: Document = json_util.loads(json.dumps(image))
    return restored


def _to_text(value: Any) -> str:
    """A JSON value (or a BSON document) as Extended JSON text, for the ledger."""
    return json_util.dumps(value, json_options=_RELAXED)


def _from_text(text: Any) -> Any:
    if text is None:
        return None
    return json_util.loads(text)


def _plain(text: Any) -> Any:
    """Ledger text back to plain JSON values (what :class:`LedgerEntry` holds)."""
    if text is None:
        return None
    return json.loads(text)
