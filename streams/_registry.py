"""The participant registry as its readers see it: who announced itself, and who is gone.

Participants announce themselves on the compacted ``<prefix>.participants`` topic
(``saga.participant`` records keyed ``<name>/<instance>``; see
:class:`~streams._records.ParticipantAnnouncement`). :class:`ParticipantRegistry`
reads that whole topic through the :class:`~streams.log.Log` protocol (every
partition, from the beginning, no consumer group), keeps the latest announcement
of each instance, and keeps following it while its owner polls.

Contracts:

* **Caught up** means: read up to the high watermarks of the topic as they were
  at :meth:`ParticipantRegistry.start` (or at the last :meth:`~ParticipantRegistry.refresh`).
  A reader that decides on the registry (the coordinator) must not decide before.
* **Known** names are those with at least one stored announcement, gone or not:
  a participant that announced itself once exists; that it is down now does not
  make a request naming it invalid (its steps wait, visibly, for its return).
* **Gone**: an instance whose last announcement said ``stopping``, or whose last
  heartbeat is older than three of its own heartbeat intervals. A participant is
  gone when all its instances are.
* **Forgetting**: a tombstone (``None`` value) on ``<name>/<instance>`` removes that
  instance (``saga participants --forget``); a name whose every instance was
  forgotten is unknown again.
* **Hostile records** never stop a reader: an announcement that breaks the wire
  contract, or is keyed otherwise than ``<name>/<instance>``, or (with keys) is not
  signed by ``participant-<name>`` (a tombstone: by that participant or ``operator``),
  is skipped, counted in ``stats.skipped`` and logged. Readers are not the DLQ's
  writer; the topic is not the transactions' either.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from saga.streams._codec import decode_announcement
from saga.streams._errors import InvalidRecord, TransientError
from saga.streams._lifecycle import Clock, wall_clock_ms
from saga.streams._records import ParticipantAnnouncement, ParticipantState
from saga.streams._signing import OPERATOR, Keyring, participant_principal
from saga.streams.kafka import OFFSET_BEGINNING, KafkaLog, KafkaSettings, Message
from saga.streams.log import Log, LogConsumer

__all__ = ["GONE_AFTER_INTERVALS", "ParticipantInfo", "ParticipantRegistry", "read_registry"]

log = logging.getLogger("saga.registry")

GONE_AFTER_INTERVALS: Final = 3
"""An instance is gone after this many heartbeat intervals without a heartbeat."""

_BATCH: Final = 1000


def instance_gone(announcement: ParticipantAnnouncement, now_ms: int) -> bool:
    """Whether the instance that made ``announcement`` (its latest) is gone at ``now_ms``."""
    if announcement.state is ParticipantState.STOPPING:
        return True
    return now_ms - announcement.heartbeat_ms > GONE_AFTER_INTERVALS * announcement.interval_ms


@dataclass(frozen=True, slots=True)
class ParticipantInfo:
    """One participant name as the registry sees it at ``now_ms``.

    ``storage``, ``targets`` and ``version`` are those of its most recent
    announcement; ``instances`` holds the latest announcement of each of its
    processes, most recent heartbeat first, and ``live`` the ids of those not gone.
    """

    name: str
    storage: str
    targets: tuple[str, ...]
    version: str
    instances: tuple[ParticipantAnnouncement, ...]
    live: tuple[str, ...]
    last_heartbeat_ms: int
    now_ms: int

    @property
    def gone(self) -> bool:
        """No instance is up: each said ``stopping`` or missed three heartbeats."""
        return not self.live

    @property
    def heartbeat_age_ms(self) -> int:
        """Milliseconds since the last heartbeat of any of its instances."""
        return max(0, self.now_ms - self.last_heartbeat_ms)

    def to_json(self) -> dict[str, object]:
        """A plain-JSON view (what ``saga participants --json`` prints)."""
        return {
            "name": self.name,
            "storage": self.storage,
            "targets": list(self.targets),
            "version": self.version,
            "state": "gone" if self.gone else "up",
            "last_heartbeat_ms": self.last_heartbeat_ms,
            "heartbeat_age_ms": self.heartbeat_age_ms,
            "instances": [
                {
                    "instance": a.instance,
                    "host": a.host,
                    "state": "up" if a.instance in self.live else "gone",
                    "said": str(a.state),
                    "started_ms": a.started_ms,
                    "heartbeat_ms": a.heartbeat_ms,
                    "interval_ms": a.interval_ms,
                    "version": a.version,
                }
                for a in self.instances
            ],
        }


@dataclass(slots=True)
class RegistryStats:
    """What a reader has read: records applied, records skipped (hostile), tombstones."""

    read: int = 0
    skipped: int = 0
    forgotten: int = 0


@dataclass(slots=True)
class _Progress:
    """Per partition: the offset to reach to be caught up, and the next offset to read."""

    target: dict[int, int] = field(default_factory=dict)
    next: dict[int, int] = field(default_factory=dict)

    def reached(self) -> bool:
        return all(self.next.get(p, 0) >= high for p, high in self.target.items())


class ParticipantRegistry:
    """A live view of the participants topic (see the module docstring).

    Single-threaded: the owner calls :meth:`start` once, then :meth:`poll` (or
    :meth:`catch_up`) from one thread, and reads :meth:`known`, :meth:`names` and
    :meth:`participants` between polls. ``keys`` (a keyring with the participants'
    public keys) turns the signature check on. ``clock`` gives "now" for ``gone``.
    """

    def __init__(
        self,
        log: Log,
        *,
        keys: Keyring | None = None,
        clock: Clock = wall_clock_ms,
        client_id: str | None = None,
    ) -> None:
        self._log = log
        self.topic = log.settings.topics.participants
        self._keys = keys
        self.clock = clock
        self._client_id = client_id or f"{log.settings.topics.prefix}.registry"
        self._consumer: LogConsumer | None = None
        self._marks: LogConsumer | None = None
        self._latest: dict[tuple[str, str], ParticipantAnnouncement] = {}
        self._names: frozenset[str] = frozenset()
        self._progress = _Progress()
        self.stats = RegistryStats()

    # ------------------------------------------------------------ reading

    def start(self) -> None:
        """Assign every partition of the topic from its beginning; note where "caught up" is.

        Raises:
            ConfigurationError: the topic does not exist (``saga topics create`` makes it).
            TransientError: Kafka does not answer.
        """
        consumer = self._log.consumer(None, client_id=self._client_id)
        # Ends are asked of a consumer that fetches nothing: on the reading one, an offset
        # request waits behind its fetch, which the broker may hold for up to 500 ms.
        marks = self._log.consumer(None, client_id=f"{self._client_id}.ends")
        try:
            count = consumer.list_partitions(self.topic)
            consumer.assign([(self.topic, p, OFFSET_BEGINNING) for p in range(count)])
        except BaseException:
            consumer.close()
            marks.close()
            raise
        self._consumer, self._marks = consumer, marks
        self._progress = _Progress(next=dict.fromkeys(range(count), 0))
        self._mark_target()

    def _mark_target(self) -> None:
        assert self._marks is not None
        self._progress.target = {
            p: self._marks.watermarks(self.topic, p)[1] for p in self._progress.next
        }

    @property
    def caught_up(self) -> bool:
        """Whether everything up to the noted high watermarks has been read."""
        return self._consumer is not None and self._progress.reached()

    def poll(self, timeout: float = 0.0) -> int:
        """Read what has arrived (waiting at most ``timeout`` s for the first record); how many."""
        if self._consumer is None:
            raise RuntimeError("call start() before poll()")
        messages = self._consumer.poll_batch(_BATCH, timeout)
        for m in messages:
            self._apply(m)
            self._progress.next[m.partition] = max(
                self._progress.next.get(m.partition, 0), m.offset + 1
            )
        if not self._progress.reached():
            # Offsets without a record to deliver (transaction markers, compacted gaps at
            # the end) count as read once the consumer's position is past them.
            positions = self._consumer.position((self.topic, p) for p in self._progress.target)
            for (_, p), at in positions.items():
                if at is not None and at > self._progress.next.get(p, 0):
                    self._progress.next[p] = at
        return len(messages)

    def catch_up(self, timeout: float, *, stop: Callable[[], bool] | None = None) -> bool:
        """Poll until caught up (True), ``timeout`` seconds pass or ``stop()`` says so (False)."""
        deadline = time.monotonic() + timeout
        while not self.caught_up:
            if (stop is not None and stop()) or time.monotonic() >= deadline:
                return False
            self.poll(min(0.1, max(0.0, deadline - time.monotonic())))
        return True

    def refresh(self, timeout: float) -> bool:
        """Read up to the topic's end as it is now (not as it was at start); caught up or not."""
        if self._consumer is None:
            raise RuntimeError("call start() before refresh()")
        try:
            self._mark_target()
        except TransientError as exc:
            log.warning("could not read the end of %s: %s", self.topic, exc)
            return False
        return self.catch_up(timeout)

    def close(self) -> None:
        """Release the consumers; what was read stays readable (answers only)."""
        for consumer in (self._consumer, self._marks):
            if consumer is not None:
                consumer.close()
        self._consumer = self._marks = None

    def _apply(self, m: Message) -> None:
        raw_key = m.key or b""
        name, _, instance = raw_key.decode("utf-8", "replace").partition("/")
        if m.value is None:
            self._forget(m, name, instance)
            return
        try:
            record = decode_announcement(m.key, m.value)
        except InvalidRecord as exc:
            self._skip(m, exc.reason)
            return
        if self._keys is not None:
            why = self._keys.check(
                m.topic,
                m.key,
                m.value,
                m.headers,
                frozenset({participant_principal(record.name)}),
            )
            if why is not None:
                self._skip(m, why)
                return
        self.stats.read += 1
        self._latest[(record.name, record.instance)] = record
        if record.name not in self._names:
            self._names = self._names | {record.name}

    def _forget(self, m: Message, name: str, instance: str) -> None:
        if self._keys is not None and name:
            allowed = frozenset({participant_principal(name), OPERATOR})
            why = self._keys.check(m.topic, m.key, m.value, m.headers, allowed)
            if why is not None:
                self._skip(m, why)
                return
        if self._latest.pop((name, instance), None) is None:
            return
        self.stats.forgotten += 1
        if not any(n == name for n, _ in self._latest):
            self._names = self._names - {name}

    def _skip(self, m: Message, reason: str) -> None:
        self.stats.skipped += 1
        log.warning(
            "skipping the record at %s/%d@%d of the participant registry: %s",
            m.topic,
            m.partition,
            m.offset,
            reason,
        )

    # ------------------------------------------------------------ answers

    def known(self, name: str) -> bool:
        """Whether participant ``name`` has announced itself (and was not forgotten)."""
        return name in self._names

    def names(self) -> frozenset[str]:
        """Every known participant name (the same object until one is added or forgotten)."""
        return self._names

    def instances(self) -> list[ParticipantAnnouncement]:
        """The latest announcement of every instance, by name, then most recent first."""
        return sorted(self._latest.values(), key=lambda a: (a.name, -a.heartbeat_ms, a.instance))

    def participants(self, now_ms: int | None = None) -> list[ParticipantInfo]:
        """Every known participant, by name, as seen at ``now_ms`` (default: the clock)."""
        now = self.clock() if now_ms is None else now_ms
        grouped: dict[str, list[ParticipantAnnouncement]] = {}
        for a in self.instances():
            grouped.setdefault(a.name, []).append(a)
        out: list[ParticipantInfo] = []
        for name, announcements in sorted(grouped.items()):
            newest = announcements[0]
            out.append(
                ParticipantInfo(
                    name=name,
                    storage=str(newest.storage),
                    targets=newest.targets,
                    version=newest.version,
                    instances=tuple(announcements),
                    live=tuple(a.instance for a in announcements if not instance_gone(a, now)),
                    last_heartbeat_ms=newest.heartbeat_ms,
                    now_ms=now,
                )
            )
        return out

    def get(self, name: str, now_ms: int | None = None) -> ParticipantInfo | None:
        """What the registry knows of participant ``name``, or None."""
        if name not in self._names:
            return None
        return next((p for p in self.participants(now_ms) if p.name == name), None)


def read_registry(
    source: KafkaSettings | Log,
    timeout: float = 10.0,
    *,
    keys: Keyring | None = None,
    clock: Clock = wall_clock_ms,
) -> ParticipantRegistry:
    """Read the whole participants topic once, for one-shot readers (``saga participants``).

    Returns a caught-up registry whose consumer is closed (answers only).

    Raises:
        ConfigurationError: the topic does not exist.
        TransientError: Kafka does not answer, or the topic was not read to its end
            within ``timeout`` seconds.
    """
    log_: Log = KafkaLog(source) if isinstance(source, KafkaSettings) else source
    prefix = log_.settings.topics.prefix
    registry = ParticipantRegistry(
        log_, keys=keys, clock=clock, client_id=f"{prefix}.reader.registry"
    )
    registry.start()
    try:
        if not registry.catch_up(timeout):
            raise TransientError(
                f"could not read the participant registry ({registry.topic}) to its end "
                f"within {timeout:g}s; is Kafka at {log_.settings.bootstrap} reachable?"
            )
    finally:
        registry.close()
    return registry
