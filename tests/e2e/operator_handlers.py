"""Custom actions for the operator-command tests: a step that cannot be undone, one that
is always refused, and one that takes its time (so its saga stays pending)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from saga.participants import Handler, Reject


def _nothing(native: Any, args: Mapping[str, Any]) -> None:
    return None


def _cannot_undo(native: Any, args: Mapping[str, Any], before: Any) -> None:
    raise Reject("the refund service is down")


def _refuse(native: Any, args: Mapping[str, Any]) -> None:
    raise Reject("refused on purpose")


def _undo(native: Any, args: Mapping[str, Any], before: Any) -> None:
    return None


def _slow(native: Any, args: Mapping[str, Any]) -> None:
    time.sleep(float(args.get("seconds", 1)))


HANDLERS = {
    "stick": Handler(try_=_nothing, cancel=_cannot_undo),
    "refuse": Handler(try_=_refuse, cancel=_undo),
    "slow": Handler(try_=_slow, cancel=_undo),
}
