"""A participant process announces itself on the participant registry, then keeps beating.

The runtime (:mod:`participants._runtime`) owns one :class:`Announcer`: it calls
:meth:`Announcer.announce` before it consumes anything (flushed: the coordinator
may read the announcement before any request this process acts on),
:meth:`Announcer.beat` from its poll loop (a heartbeat every ``interval_ms``; cheap
when none is due), and :meth:`Announcer.stop` on a clean stop (a last announcement
saying ``stopping``). Heartbeats come from the poll loop rather than a thread of
their own, so a process whose loop hangs stops beating and shows as gone, and
tests with a manual clock see every beat.

Announcing never stops the participant: Kafka being away, or the registry topic
missing, is logged and tried again at the next beat.
"""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import Iterable
from importlib import metadata
from typing import Final

from saga.streams import (
    ConfigurationError,
    ParticipantAnnouncement,
    ParticipantState,
    SagaError,
    StorageKind,
    Topics,
    encode,
)
from saga.streams._lifecycle import Clock, wall_clock_ms
from saga.streams.kafka import Message
from saga.streams.log import Log

__all__ = ["DEFAULT_HEARTBEAT_MS", "Announcer", "package_version", "storage_kind"]

log = logging.getLogger("saga.participant")

DEFAULT_HEARTBEAT_MS: Final = 5_000
"""How often a participant says it is still there, unless told otherwise."""

_MAX_INTERVAL_MS: Final = 86_400_000
_FLUSH_S: Final = 10.0
# A heartbeat holds up the poll loop at most this long when Kafka is slow or away.
_BEAT_FLUSH_S: Final = 1.0
_MAX_TARGETS: Final = 256
_MAX_HOST_CHARS: Final = 255


def package_version() -> str:
    """The installed version of the saga package, or ``unknown`` (running from a checkout)."""
    try:
        return metadata.version("saga-olep")
    except metadata.PackageNotFoundError:
        return "unknown"


def storage_kind(storage: object) -> StorageKind:
    """The kind of a storage adapter: ``sql``, ``mongo``, ``redis``, else ``other``."""
    module = type(storage).__module__
    for kind, home in (
        (StorageKind.SQL, "saga.participants.sql._adapter"),
        (StorageKind.MONGO, "saga.participants.mongo._adapter"),
        (StorageKind.REDIS, "saga.participants.redis._adapter"),
    ):
        if module == home:
            return kind
    return StorageKind.OTHER


class Announcer:
    """Produces the announcements of one participant process (see the module docstring).

    ``instance`` is new per process unless given (a random id); ``interval_ms`` is
    the heartbeat period, which every announcement carries so that readers know
    when to call this process gone (three intervals without a beat).
    """

    def __init__(
        self,
        log_: Log,
        topics: Topics,
        *,
        name: str,
        storage: StorageKind,
        targets: Iterable[str],
        interval_ms: int = DEFAULT_HEARTBEAT_MS,
        clock: Clock = wall_clock_ms,
        instance: str | None = None,
        version: str | None = None,
    ) -> None:
        if not 1 <= interval_ms <= _MAX_INTERVAL_MS:  # the schema's bounds
            raise ConfigurationError(
                f"the heartbeat interval must be 1 ms to 1 day, not {interval_ms} ms"
            )
        self.name = name
        self.topic = topics.participants
        self.storage = storage
        self.targets = tuple(sorted(targets))[:_MAX_TARGETS]
        self.interval_ms = interval_ms
        self.clock = clock
        self.instance = instance or uuid.uuid4().hex[:16]
        self.version = (version or package_version())[:64]
        self.host = socket.gethostname()[:_MAX_HOST_CHARS] or None
        self.started_ms = clock()
        self.sent = 0
        self._next_ms = 0
        self._producer = log_.producer(client_id=f"{topics.prefix}.participant.{name}.announce")

    def _record(self, state: ParticipantState, now: int) -> ParticipantAnnouncement:
        return ParticipantAnnouncement(
            name=self.name,
            storage=self.storage,
            targets=self.targets,
            version=self.version,
            instance=self.instance,
            started_ms=self.started_ms,
            heartbeat_ms=now,
            interval_ms=self.interval_ms,
            state=state,
            host=self.host,
        )

    def announce(
        self, state: ParticipantState = ParticipantState.UP, *, timeout: float = _FLUSH_S
    ) -> bool:
        """Produce one announcement now and wait up to ``timeout`` s for Kafka to have it.

        Returns whether Kafka acknowledged it in time (one that did not may still
        arrive later: it stays queued).
        """
        now = self.clock()
        self._next_ms = now + self.interval_ms
        try:
            self._producer.produce(
                self.topic,
                f"{self.name}/{self.instance}",
                encode(self._record(state, now)),
                on_delivery=self._delivered,
            )
            self._producer.flush(timeout)
        except (SagaError, BufferError) as exc:
            log.warning(
                "participant %s could not announce itself on %s (tried again in %d ms): %s",
                self.name,
                self.topic,
                self.interval_ms,
                exc,
            )
            return False
        return True

    def _delivered(self, error: SagaError | None, message: Message) -> None:
        if error is None:
            self.sent += 1
            return
        log.warning(
            "an announcement of participant %s did not reach %s: %s", self.name, self.topic, error
        )

    def beat(self) -> None:
        """Announce again if a heartbeat is due (waiting at most a second for Kafka)."""
        if self.clock() >= self._next_ms:
            self.announce(timeout=_BEAT_FLUSH_S)

    def stop(self) -> None:
        """Say ``stopping`` (flushed), then release the producer."""
        self.announce(ParticipantState.STOPPING)
        try:
            self._producer.close(_FLUSH_S)
        except SagaError as exc:
            log.warning("participant %s: closing the announcer: %s", self.name, exc)
