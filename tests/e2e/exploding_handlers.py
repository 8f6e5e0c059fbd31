"""A custom action with a bug, for tests: ``explode`` raises (not ``Reject``) on ``boom``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from saga.participants import Handler


def _try(native: Any, args: Mapping[str, Any]) -> Any:
    if args.get("boom"):
        raise RuntimeError("the handler has a bug")
    return None


def _cancel(native: Any, args: Mapping[str, Any], before: Any) -> None:
    return None


HANDLERS = {"explode": Handler(try_=_try, cancel=_cancel)}
