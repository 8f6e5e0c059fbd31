"""Custom SQL actions with and without a ``confirm``, for tests (``--handlers
tests.confirm_handlers``).

Both credit ``accounts.balance`` of ``args["key"]`` by ``args["by"]`` and undo that on
cancel; ``credit_confirmed`` also adds ``args["bonus"]`` (default 1000) when the saga
commits, so a test sees whether the confirmation ran, and how often.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from saga.participants import Handler

_ADD = sa.text("UPDATE accounts SET balance = balance + :by WHERE id = :key")


def _credit(native: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    native.execute(_ADD, {"by": args["by"], "key": args["key"]})
    return {}


def _debit(native: Any, args: Mapping[str, Any], before: Any) -> None:
    native.execute(_ADD, {"by": -args["by"], "key": args["key"]})


def _bonus(native: Any, args: Mapping[str, Any]) -> None:
    native.execute(_ADD, {"by": args.get("bonus", 1000), "key": args["key"]})


HANDLERS = {
    "credit_confirmed": Handler(try_=_credit, cancel=_debit, confirm=_bonus),
    "credit": Handler(try_=_credit, cancel=_debit),
}
