"""Which participants exist when the coordinator decides: a static list, the registry, or any.

Three policies, one per way of running the coordinator:

* **registry** (``saga coordinator run``'s default): a participant exists once it
  has announced itself on ``<prefix>.participants``
  (:class:`~streams._registry.ParticipantRegistry`). The coordinator reads the
  registry to its end before it decides anything (:meth:`KnownParticipants.start`),
  and follows it between batches (:meth:`KnownParticipants.poll`). A request naming
  a name not announced yet **waits for it** up to ``grace_ms`` (never past its
  deadline): processes start in no particular order, and a participant takes
  seconds to announce itself. Meanwhile the saga is pending as any other (the
  participants that exist act on it); when the grace ends, the registry is read to
  its end once more, and a step still pending whose participant has not announced
  itself counts as compensated and rolls the saga back, with the reason a request
  naming it had before there was a grace (:meth:`KnownParticipants.missing`). A
  restarted coordinator gives such sagas the grace again. With ``grace_ms`` 0 the
  registry is read to its end before the name counts as unknown, and the saga rolls
  back at once.
* **static** (``--participants a,b``): the names given; the registry is not read.
* **accept** (``--unknown-participants accept``, and the library default): every
  name exists, as for deployments that start participants after their first requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Final

from saga.coordinator._machine import ParticipantsMissing, RequestReceived, Saga
from saga.streams import ConfigurationError, SagaRequest, StepStatus
from saga.streams._lifecycle import Clock, wall_clock_ms
from saga.streams._registry import ParticipantRegistry
from saga.streams._signing import Keyring
from saga.streams.log import Log

__all__ = ["DEFAULT_PARTICIPANT_GRACE_MS", "KnownParticipants"]

log = logging.getLogger("saga.coordinator")

# A request naming a name not seen yet reads the registry to its end, at most this
# long, and not more often than every _REFRESH_EVERY_S (a flood of misspelt requests
# must not turn into a flood of offset look-ups).
_REFRESH_TIMEOUT_S: Final = 2.0
_REFRESH_EVERY_S: Final = 0.2
_STARTUP_REPORT_S: Final = 10.0

DEFAULT_PARTICIPANT_GRACE_MS: Final = 30_000
"""How long a request waits for a participant that has not announced itself yet."""


class KnownParticipants:
    """The coordinator's answer to "does this participant exist?" (see the module docstring)."""

    def __init__(
        self,
        *,
        static: frozenset[str] | None = None,
        registry: ParticipantRegistry | None = None,
        grace_ms: int = 0,
    ) -> None:
        if static is not None and registry is not None:
            raise ValueError("give a static list of participants or a registry, not both")
        self.static = static
        self.registry = registry
        self.grace_ms = grace_ms
        self._refreshed_at = 0.0

    @classmethod
    def from_registry(
        cls,
        log_: Log,
        *,
        keys: Keyring | None = None,
        clock: Clock = wall_clock_ms,
        client_id: str | None = None,
        grace_ms: int = 0,
    ) -> KnownParticipants:
        """The registry policy, reading ``log_``'s participants topic; requests naming a
        participant not announced yet wait ``grace_ms`` for it."""
        registry = ParticipantRegistry(log_, keys=keys, clock=clock, client_id=client_id)
        return cls(registry=registry, grace_ms=grace_ms)

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

    @property
    def waits(self) -> bool:
        """Whether a request naming a participant not announced yet waits for it."""
        return self.registry is not None and self.grace_ms > 0

    def check(self, request: SagaRequest) -> tuple[frozenset[str] | None, str | None]:
        """``(known, why)`` for :class:`~coordinator._machine.RequestReceived`.

        ``known`` is None when every name is accepted; ``why`` explains, for the
        rollback reason, why a name outside ``known`` is unknown. A request that will
        wait (:attr:`waits`) does not make the registry be read again now.
        """
        if self.static is not None:
            return self.static, None
        if self.registry is None:
            return None, None
        names = self.registry.names()
        if not self.waits and any(step.participant not in names for step in request.steps):
            names = self._refreshed()
        return names, self._why()

    def _why(self) -> str:
        assert self.registry is not None
        return f"no participant of that name has announced itself on {self.registry.topic}"

    def _refreshed(self) -> frozenset[str]:
        """The registry's names, read to its end first (at most every _REFRESH_EVERY_S)."""
        assert self.registry is not None
        now = time.monotonic()
        if now - self._refreshed_at >= _REFRESH_EVERY_S:
            self._refreshed_at = now
            self.registry.refresh(_REFRESH_TIMEOUT_S)
        return self.registry.names()

    def wait_for(self, inp: RequestReceived, now_ms: int) -> tuple[RequestReceived, int | None]:
        """The request as the machine should see it, and when its wait ends (None: none).

        A request naming a participant not announced yet is taken as if every name
        were known, and waits until ``now_ms + grace_ms`` or its deadline, whichever
        comes first; then :meth:`missing` says which steps can never be applied.
        """
        if not self.waits or inp.known is None:
            return inp, None
        if all(step.participant in inp.known for step in inp.request.steps):
            return inp, None
        ends = min(inp.request.deadline_ms, now_ms + self.grace_ms)
        if ends <= now_ms:
            return inp, None
        return replace(inp, known=None, unknown_why=None), ends

    def restored_wait(self, saga: Saga, now_ms: int) -> int | None:
        """When the wait of a saga rebuilt by a restart ends: one with a step still pending
        is given the grace again (its participant may be starting too); None: no wait."""
        if not self.waits or not saga.request_seen or saga.state.final:
            return None
        if StepStatus.PENDING not in saga.steps:
            return None
        return min(saga.deadline_ms, now_ms + self.grace_ms)

    def missing(self, saga: Saga, now_ms: int) -> ParticipantsMissing | None:
        """The machine's input for ``saga`` whose wait ended at ``now_ms`` (None: nothing
        to check); the registry is read to its end first."""
        if self.registry is None or not saga.request_seen or saga.state.final:
            return None
        return ParticipantsMissing(saga.tx_id, self._refreshed(), self._why(), now_ms)
