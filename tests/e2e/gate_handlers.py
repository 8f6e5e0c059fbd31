"""A custom action that changes nothing, for tests that keep a saga open on purpose
(``--handlers tests.e2e.gate_handlers``).

A saga with a ``pass`` step on a participant that is not running stays undecided: its
other steps are applied and wait for the decision. Starting that participant later
lets the saga finish: ``pass`` applies (so the saga may commit) and its cancel undoes
nothing (so a rollback closes it). It works on every storage, whatever state its
built-in actions are in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from saga.participants import Handler


def _nothing(native: Any, args: Mapping[str, Any]) -> None:
    return None


def _undo_nothing(native: Any, args: Mapping[str, Any], before: Any) -> None:
    return None


HANDLERS = {"pass": Handler(try_=_nothing, cancel=_undo_nothing)}
