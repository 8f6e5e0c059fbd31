"""Fault points for crash tests: kill this process at a named point in the protocol.

Off unless configured. The command line configures it from ``SAGA_FAULTS``
(library code never reads the environment), e.g.::

    SAGA_FAULTS="participant.after_local_commit:3"   # SIGKILL on the 3rd time the point is hit

Points: ``participant.after_local_commit`` (storage committed, events not sent),
``participant.after_events`` (events acknowledged, offsets not committed),
``coordinator.after_read`` (records read, nothing decided),
``coordinator.before_commit`` (decisions produced, transaction not committed).
"""

from __future__ import annotations

import os
import signal

from streams._errors import ConfigurationError

POINTS = frozenset(
    {
        "participant.after_local_commit",
        "participant.after_events",
        "coordinator.after_read",
        "coordinator.before_commit",
    }
)

_armed: dict[str, int] = {}


def configure(spec: str | None) -> None:
    """Arm fault points from ``"point:n[,point:n]"``; ``None`` or empty disarms all."""
    _armed.clear()
    if not spec:
        return
    for part in spec.split(","):
        name, _, count = part.strip().partition(":")
        if name not in POINTS:
            raise ConfigurationError(
                f"unknown fault point {name!r} in SAGA_FAULTS; known: {', '.join(sorted(POINTS))}"
            )
        try:
            _armed[name] = max(1, int(count or "1"))
        except ValueError as exc:
            raise ConfigurationError(
                f"fault point {name!r} needs a whole number of hits, got {count!r}"
            ) from exc


def hit(name: str) -> None:
    """Count a pass through ``name``; SIGKILL this process when its count runs out."""
    left = _armed.get(name)
    if left is None:
        return
    if left <= 1:
        os.kill(os.getpid(), signal.SIGKILL)
    _armed[name] = left - 1
