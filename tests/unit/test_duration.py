"""The duration parser of ``--retention`` (``streams._duration``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from saga.streams._duration import DEFAULT_RETENTION, DEFAULT_RETENTION_MS, parse_duration_ms

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("90s", 90_000),
        ("30m", 1_800_000),
        ("12h", 43_200_000),
        ("7d", 604_800_000),
        ("500ms", 500),
        (" 2H ", 7_200_000),
        ("1d", 86_400_000),
    ],
)
def test_parses_a_number_and_a_unit(text: str, ms: int) -> None:
    assert parse_duration_ms(text) == ms


def test_the_default_retention_is_seven_days() -> None:
    assert parse_duration_ms(DEFAULT_RETENTION) == DEFAULT_RETENTION_MS == 7 * 86_400_000


@pytest.mark.parametrize(
    "text", ["", "7", "d", "7 d", "1.5h", "-1d", "7w", "7dd", "1e3s", "ten minutes", "0s", "0d"]
)
def test_refuses_anything_else_in_one_sentence(text: str) -> None:
    with pytest.raises(ValueError, match="duration") as info:
        parse_duration_ms(text)
    assert "\n" not in str(info.value)


@given(st.integers(1, 10**6), st.sampled_from(["ms", "s", "m", "h", "d"]))
def test_units_scale(value: int, unit: str) -> None:
    scale = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}[unit]
    assert parse_duration_ms(f"{value}{unit}") == value * scale
