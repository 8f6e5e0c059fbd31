"""Fault points for crash tests: kill this process at a named point in the protocol.

Off unless configured. The command line configures it from ``SAGA_FAULTS``
(library code never reads the environment), e.g.::

    SAGA_FAULTS="participant.after_local_commit:3"   # SIGKILL on the 3rd time the point is hit

Points: ``participant.after_local_commit`` (storage committed, events not sent),
``participant.after_events`` (events acknowledged, offsets not committed),
``coordinator.after_read`` (records read, nothing decided),
``coordinator.before_commit`` (decisions produced, transaction not committed).

Unsafe test switches (``SAGA_UNSAFE_TEST_SWITCHES``, read only by the command
line, like ``SAGA_FAULTS``) break a guarantee on purpose, so that the chaos
suite can show its checker catches the breakage (its negative controls). Never
set them outside that suite:

* ``barrier-off``: a participant ignores its ledger for requests: a repeated
  request is applied again and a request after its rollback is applied;
* ``auto-commit``: a participant commits its input offsets as soon as it has
  read a batch, before the batch's storage work and events (what
  ``enable.auto.commit`` effectively does), so a crash in between loses them.
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

UNSAFE_SWITCHES = frozenset({"barrier-off", "auto-commit"})

_armed: dict[str, int] = {}
_unsafe: set[str] = set()


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


def configure_unsafe(spec: str | None) -> None:
    """Turn on the unsafe test switches named in ``"a,b"``; ``None`` or empty turns all off."""
    _unsafe.clear()
    if not spec:
        return
    for part in spec.split(","):
        name = part.strip()
        if not name:
            continue
        if name not in UNSAFE_SWITCHES:
            raise ConfigurationError(
                f"unknown switch {name!r} in SAGA_UNSAFE_TEST_SWITCHES; "
                f"known: {', '.join(sorted(UNSAFE_SWITCHES))}"
            )
        _unsafe.add(name)


def unsafe(name: str) -> bool:
    """Whether the unsafe test switch ``name`` is on (never, outside the chaos suite)."""
    return name in _unsafe
