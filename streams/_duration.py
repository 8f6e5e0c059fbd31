"""Durations on the command line: ``90s``, ``30m``, ``12h``, ``7d`` (and ``500ms``).

One parser for every command that takes a duration (the participant's and the
coordinator's ``--retention``), so they accept the same spellings and say the
same thing about a bad one.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["DEFAULT_RETENTION", "DEFAULT_RETENTION_MS", "parse_duration_ms"]

_UNITS_MS: Final = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_DURATION: Final = re.compile(r"([0-9]{1,12})(ms|s|m|h|d)")

DEFAULT_RETENTION: Final = "7d"
"""How long ledgers (and the coordinator's memory) keep a finished transaction."""
DEFAULT_RETENTION_MS: Final = 7 * _UNITS_MS["d"]


def parse_duration_ms(text: str) -> int:
    """``text`` (a whole number and a unit: ``ms``, ``s``, ``m``, ``h`` or ``d``) in ms.

    Raises:
        ValueError: one sentence naming the text and the accepted form; zero is refused.
    """
    match = _DURATION.fullmatch(text.strip().lower()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(
            f"{text!r} is not a duration; give a whole number and a unit, such as 90s, "
            "30m, 12h or 7d"
        )
    value = int(match.group(1)) * _UNITS_MS[match.group(2)]
    if value <= 0:
        raise ValueError(f"the duration {text!r} must be longer than zero")
    return value
