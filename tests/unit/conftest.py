"""Fixtures the unit modules share: a manual clock (a module may still define its own)."""

from __future__ import annotations

import pytest

from saga.streams.testing import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()
