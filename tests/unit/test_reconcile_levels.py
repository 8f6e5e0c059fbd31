"""The audit reads a step's isolation level as the participants write it (I7).

``streams.reconcile._isolation`` keeps its own copies of the level's mark and of the
built-in action names (the job imports no participant code on its hot path); these
checks keep them equal to the participants' definitions.
"""

from __future__ import annotations

from typing import Any

import pytest

from saga.participants._actions import BUILTIN_ACTIONS, READ_COMMITTED_BEFORE
from saga.participants._barrier import ISOLATION_KEY, isolation_of
from saga.streams.reconcile import _isolation

pytestmark = pytest.mark.unit


def test_the_copies_match_the_participants() -> None:
    assert _isolation.LEVEL_KEY == ISOLATION_KEY
    assert set(_isolation._BUILTIN) == set(BUILTIN_ACTIONS)


@pytest.mark.parametrize(
    "before",
    [
        READ_COMMITTED_BEFORE,
        {ISOLATION_KEY: "none"},
        {"balance": 5},
        None,
        [1, 2],
        "read_committed",
        {},
    ],
)
def test_level_of_reads_a_before_as_the_participants_do(before: Any) -> None:
    assert _isolation.level_of(before) == str(isolation_of(before))
