"""Which participants exist when the coordinator decides: a static list, the registry, or any.

Three policies, one per way of running the coordinator:

* **registry** (``saga coordinator run``'s default): a participant exists once it
  has announced itself on ``<prefix>.participants``
  (:class:`~streams._registry.ParticipantRegistry`). The coordinator reads the
  registry to its end before it decides anything (:meth:`KnownParticipants.start`),
  and follows it between batches (:meth:`KnownParticipants.poll`). A request naming
  a name not seen yet makes it read the registry to its end once more before the
  name counts as unknown, so a participant that announced itself a moment before
  the request was read is not mistaken for a missing one.
* **static** (``--participants a,b``): the names given; the registry is not read.
* **accept** (``--unknown-participants accept``, and the library default): every
  name exists, as for deployments that start participants after their first requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

from saga.streams import ConfigurationError, SagaRequest
from saga.streams._lifecycle import Clock, wall_clock_ms
from saga.streams._registry import ParticipantRegistry
from saga.streams._signing import Keyring
from saga.streams.log import Log

__all__ = ["KnownParticipants"]

log = logging.getLogger("saga.coordinator")

# A request naming a name not seen yet reads the registry to its end, at most this
# long, and not more often than every _REFRESH_EVERY_S (a flood of misspelt requests
# must not turn into a flood of offset look-ups).
_REFRESH_TIMEOUT_S: Final = 2.0
_REFRESH_EVERY_S: Final = 0.2
_STARTUP_REPORT_S: Final = 10.0


class KnownParticipants:
    """The coordinator's answer to "does this participant exist?" (see the module docstring)."""

    def __init__(
        self,
        *,
        static: frozenset[str] | None = None,
        registry: ParticipantRegistry | None = None,
    ) -> None:
        if static is not None and registry is not None:
            raise ValueError("give a static list of participants or a registry, not both")
        self.static = static
        self.registry = registry
        self._refreshed_at = 0.0

    @classmethod
    def from_registry(
        cls,
        log_: Log,
        *,
        keys: Keyring | None = None,
        clock: Clock = wall_clock_ms,
        client_id: str | None = None,
    ) -> KnownParticipants:
        """The registry policy, reading ``log_``'s participants topic."""
        return cls(registry=ParticipantRegistry(log_, keys=keys, clock=clock, client_id=client_id))

    @property
    def ready(self) -> bool:
        """Whether requests may be decided: always, except a registry not yet caught up."""
        return self.registry is None or self.registry.caught_up

    def start(self, should_stop: Callable[[], bool]) -> bool:
        """Read the registry to its end (if any) before the first decision; False if stopped.

        Raises what :meth:`ParticipantRegistry.start` raises (the topic is missing:
        one sentence naming ``saga topics create``).
        """
        if self.registry is None:
            return True
        try:
            self.registry.start()
        except ConfigurationError as exc:
            if "does not exist" not in str(exc):
                raise
            raise ConfigurationError(
                f"topic {self.registry.topic} (the participant registry) does not exist: run "
                "`saga topics create` again, which adds only the missing topics, or run the "
                "coordinator with --unknown-participants accept"
            ) from None
        begun = time.monotonic()
        while not self.registry.catch_up(_STARTUP_REPORT_S, stop=should_stop):
            if should_stop():
                return False
            log.warning(
                "still reading the participant registry %s after %.0fs; "
                "no request is decided before it is read to its end",
                self.registry.topic,
                time.monotonic() - begun,
            )
        log.info("participant registry read: %d participant(s) known", len(self.registry.names()))
        return True

    def poll(self) -> None:
        """Take in what arrived on the registry since the last call (never waits)."""
        if self.registry is not None:
            self.registry.poll(0)

    def close(self) -> None:
        if self.registry is not None:
            self.registry.close()

    def check(self, request: SagaRequest) -> tuple[frozenset[str] | None, str | None]:
        """``(known, why)`` for :class:`~coordinator._machine.RequestReceived`.

        ``known`` is None when every name is accepted; ``why`` explains, for the
        rollback reason, why a name outside ``known`` is unknown.
        """
        if self.static is not None:
            return self.static, None
        registry = self.registry
        if registry is None:
            return None, None
        names = registry.names()
        if any(step.participant not in names for step in request.steps):
            now = time.monotonic()
            if now - self._refreshed_at >= _REFRESH_EVERY_S:
                self._refreshed_at = now
                registry.refresh(_REFRESH_TIMEOUT_S)
                names = registry.names()
        why = f"no participant of that name has announced itself on {registry.topic}"
        return names, why
