"""Fault hooks for crash tests, injected into the services; no-ops by default.

The services (coordinator, participant runtime, storage) take a :class:`Faults`
object and call :meth:`Faults.hit` at named points of the protocol and
:meth:`Faults.unsafe` where a test may break a guarantee on purpose. Production
uses :data:`NO_FAULTS`, which does nothing. Library code never reads the
environment, and the ``saga`` command as installed refuses ``SAGA_FAULTS`` and
``SAGA_UNSAFE_TEST_SWITCHES`` with one sentence: only the test suite's own entry
point, ``python -m tests.launch <saga arguments>`` (``tests/launch.py``, which is
not installed), turns them into a :class:`KillFaults` (:func:`faults_from_env`), e.g.::

    SAGA_FAULTS="participant.after_local_commit:3" python -m tests.launch participant run ...
    # SIGKILL on the 3rd time the point is hit

Points: ``participant.after_local_commit`` (storage committed, events not sent),
``participant.after_events`` (events acknowledged, offsets not committed),
``coordinator.after_read`` (records read, nothing decided),
``coordinator.before_commit`` (decisions produced, transaction not committed).

Unsafe test switches (``SAGA_UNSAFE_TEST_SWITCHES``) break a guarantee on
purpose, so that the chaos suite can show its checker catches the breakage (its
negative controls); the test launcher is the only way to set them:

* ``barrier-off``: a participant ignores its ledger for requests: a repeated
  request is applied again and a request after its rollback is applied;
* ``auto-commit``: a participant commits its input offsets as soon as it has
  read a batch, before the batch's storage work and events (what
  ``enable.auto.commit`` effectively does), so a crash in between loses them.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from typing import Final, Protocol

from saga.streams._errors import ConfigurationError

POINTS: Final = frozenset(
    {
        "participant.after_local_commit",
        "participant.after_events",
        "coordinator.after_read",
        "coordinator.before_commit",
    }
)

UNSAFE_SWITCHES: Final = frozenset({"barrier-off", "auto-commit"})


class Faults(Protocol):
    """What a service asks of its fault hooks."""

    def hit(self, point: str) -> None:
        """Pass through the fault point ``point``."""

    def unsafe(self, switch: str) -> bool:
        """Whether the unsafe test switch ``switch`` is on."""


class NoFaults:
    """The production hooks: no point does anything, no switch is on."""

    def hit(self, point: str) -> None:
        return None

    def unsafe(self, switch: str) -> bool:
        return False


NO_FAULTS: Final[Faults] = NoFaults()


class KillFaults:
    """Hooks that SIGKILL this process at an armed point, and report switches on.

    ``points`` is ``"point:n[,point:n]"`` (kill on the n-th pass), ``switches``
    is ``"a,b"``; unknown names raise :class:`~streams.ConfigurationError`.
    """

    def __init__(self, points: str | None = None, switches: str | None = None) -> None:
        self._armed: dict[str, int] = {}
        self._unsafe: set[str] = set()
        for part in (points or "").split(","):
            name, _, count = part.strip().partition(":")
            if not name:
                continue
            if name not in POINTS:
                raise ConfigurationError(
                    f"unknown fault point {name!r} in SAGA_FAULTS; "
                    f"known: {', '.join(sorted(POINTS))}"
                )
            try:
                self._armed[name] = max(1, int(count or "1"))
            except ValueError as exc:
                raise ConfigurationError(
                    f"fault point {name!r} needs a whole number of hits, got {count!r}"
                ) from exc
        for part in (switches or "").split(","):
            name = part.strip()
            if not name:
                continue
            if name not in UNSAFE_SWITCHES:
                raise ConfigurationError(
                    f"unknown switch {name!r} in SAGA_UNSAFE_TEST_SWITCHES; "
                    f"known: {', '.join(sorted(UNSAFE_SWITCHES))}"
                )
            self._unsafe.add(name)

    def hit(self, point: str) -> None:
        """Count a pass through ``point``; SIGKILL this process when its count runs out."""
        left = self._armed.get(point)
        if left is None:
            return
        if left <= 1:
            os.kill(os.getpid(), signal.SIGKILL)
        self._armed[point] = left - 1

    def unsafe(self, switch: str) -> bool:
        return switch in self._unsafe


def faults_from_env(environ: Mapping[str, str]) -> Faults:
    """The hooks a process started by the test launcher runs with: :data:`NO_FAULTS`
    unless the test variables are set."""
    points = environ.get("SAGA_FAULTS")
    switches = environ.get("SAGA_UNSAFE_TEST_SWITCHES")
    if not points and not switches:
        return NO_FAULTS
    return KillFaults(points, switches)
