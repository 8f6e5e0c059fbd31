"""The in-memory consumer and producers."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Self

from saga.streams._errors import ConfigurationError, FatalKafkaError, TransientError
from saga.streams._rejoin import RejoinPolicy
from saga.streams.kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    DeliveryCallback,
    Message,
    Partition,
    RebalanceCallback,
    TransactionAborted,
    partition_for,
)
from saga.streams.log import LogConsumer
from saga.streams.testing._model import _Client, _Entry, _message, _Txn

_log = logging.getLogger("saga.kafka")

if TYPE_CHECKING:
    from saga.streams.testing._log import InMemoryLog


class InMemoryConsumer(_Client):
    """A :class:`streams.log.LogConsumer` of an :class:`InMemoryLog`."""

    def __init__(
        self,
        log: InMemoryLog,
        group_id: str | None,
        *,
        client_id: str,
        read_committed: bool,
        on_assign: RebalanceCallback | None,
        on_revoke: RebalanceCallback | None,
        on_lost: RebalanceCallback | None,
    ) -> None:
        super().__init__(log, client_id)
        self.group_id = group_id
        self.group_instance_id: str | None = None  # recorded only (see InMemoryLog.consumer)
        self.read_committed = read_committed
        self._on_assign = on_assign
        self._on_revoke = on_revoke
        self._on_lost = on_lost or on_revoke
        self.subscription: tuple[str, ...] = ()
        self.member_id: str | None = None
        self.generation = 0  # the group generation this member last joined
        self._assigned: list[Partition] = []
        self._positions: dict[Partition, int | None] = {}  # None: from the committed offset
        self._paused: set[Partition] = set()
        self.replaced = False  # a newer member joined with its group_instance_id
        self._rejoin: RejoinPolicy | None = None  # made at the first fence
        self.commit_failures = 0  # commit_async calls that failed

    def _live(self) -> None:
        self._touch()
        if self.closed:
            raise TransientError(f"consumer {self.client_id} is closed")
        if self.replaced and self._rejoins():
            # As streams.kafka.Consumer: the first fence is ridden through by rejoining
            # with the same id. Dropped from the group, the next poll rejoins (on_lost,
            # then a new member id, which fences the other holder of the id back).
            self.replaced = False
        if self.replaced:
            raise FatalKafkaError(
                "the Kafka consumer hit a fatal error: static consumer fenced by another "
                f"consumer with the same group.instance.id ({self.group_instance_id}); exiting"
            )

    def _rejoins(self) -> bool:
        """Whether this fence is ridden through (streams._rejoin.RejoinPolicy, log clock)."""
        if self.group_instance_id is None:
            return False
        if self._rejoin is None:
            self._rejoin = RejoinPolicy(
                self.group_instance_id, clock=lambda: self.log.clock() / 1000
            )
        return self._rejoin.allow("replaced by a member with the same group.instance.id")

    @property
    def rejoins(self) -> int:
        """How many times this consumer rejoined its group after an instance fence."""
        return 0 if self._rejoin is None else self._rejoin.rejoins

    # -- group membership

    def subscribe(self, topics: Sequence[str]) -> None:
        self._live()
        if self.group_id is None:
            raise ConfigurationError("a consumer without a group_id cannot subscribe: use assign()")
        with self.log._lock:
            for topic in topics:
                self.log._entries(topic, 0)  # raises for a missing topic
            self.subscription = tuple(topics)
        self.log._join(self)

    def _stale(self) -> bool:
        """Whether the group moved on without this member (dropped, or a newer generation)."""
        if not self.subscription or self.group_id is None:
            return False
        group = self.log._group(self.group_id)
        member = group.members.get(self.member_id or "")
        return member is not self or group.generation != self.generation

    def _rebalance(self) -> None:
        """Rejoin (eagerly, as the range assignor does), running the callbacks here."""
        assert self.group_id is not None
        with self.log._lock:
            group = self.log._group(self.group_id)
            dropped = group.members.get(self.member_id or "") is not self
            old = list(self._assigned)
        callback = self._on_lost if dropped else self._on_revoke
        if old and callback is not None:
            callback(old)
        with self.log._lock:
            self._assigned, self._positions, self._paused = [], {}, set()
        if dropped:
            self.log._join(self)
        with self.log._lock:
            group = self.log._group(self.group_id)
            assert self.member_id is not None
            self.generation = group.generation
            self._assigned = list(group.assignment.get(self.member_id, []))
            self._positions = dict.fromkeys(self._assigned)
        if self._on_assign is not None:
            self._on_assign(list(self._assigned))

    def assign(
        self,
        partitions_with_offsets: Mapping[Partition, int] | Iterable[tuple[str, int, int]],
    ) -> None:
        self._live()
        if isinstance(partitions_with_offsets, Mapping):
            starts = [(t, p, o) for (t, p), o in partitions_with_offsets.items()]
        else:
            starts = list(partitions_with_offsets)
        with self.log._lock:
            self._assigned, self._positions, self._paused = [], {}, set()
            for topic, partition, offset in starts:
                end = len(self.log._entries(topic, partition))
                start = {OFFSET_BEGINNING: 0, OFFSET_END: end}.get(offset, offset)
                self._assigned.append((topic, partition))
                self._positions[(topic, partition)] = start

    # -- reading

    def poll_batch(self, max_messages: int = 500, timeout: float = 1.0) -> list[Message]:
        """What is there, up to ``max_messages``; never waits. Rebalances run here."""
        self._live()
        if self.subscription:
            self.log._park()
            self._live()
        with self.log._lock:
            stale = self._stale()
        if not stale:
            return self._fetch(max_messages)
        early = self._fetch(max_messages) if self.log.fetch_before_rebalance else []
        self._rebalance()
        return early or self._fetch(max_messages)

    def _start(self, tp: Partition) -> int | None:
        """Where a newly assigned partition starts; None while a transaction holds its offset."""
        if self.group_id is None:
            return 0
        group = self.log._group(self.group_id)
        if tp in group.pending:
            return None
        return group.committed.get(tp, 0)

    def _fetch(self, max_messages: int) -> list[Message]:
        out: list[Message] = []
        with self.log._lock:
            for tp in self._assigned:
                if tp in self._paused:
                    continue
                position = self._positions.get(tp)
                if position is None:
                    position = self._start(tp)
                    if position is None:
                        continue
                entries = self.log._entries(*tp)
                limit = self.log._stable_end(entries) if self.read_committed else len(entries)
                while position < limit:
                    entry = entries[position]
                    if entry.visible(self.read_committed):
                        if len(out) >= max_messages:
                            break
                        out.append(_message(tp[0], tp[1], position, entry))
                    position += 1
                self._positions[tp] = position
        return out

    # -- offsets

    def commit(self, offsets: Mapping[Partition, int]) -> None:
        self._live()
        if not offsets:
            return
        if self.group_id is None:
            raise ConfigurationError("a consumer without a group_id cannot commit offsets")
        with self.log._lock:
            if self._stale():
                raise TransientError(
                    "committing offsets failed: the group is rebalancing "
                    f"(member {self.member_id} generation {self.generation} is stale)"
                )
            self.log._group(self.group_id).committed.update(offsets)

    def commit_async(self, offsets: Mapping[Partition, int]) -> None:
        """As Kafka's: applied at once here; a stale member's commit is logged, not raised."""
        try:
            self.commit(offsets)
        except TransientError as exc:
            self.commit_failures += 1
            _log.warning("offsets not committed (%s); the records will be read again", exc)

    def committed(
        self, partitions: Iterable[Partition], timeout: float = 10.0
    ) -> dict[Partition, int | None]:
        self._live()
        wanted = list(partitions)
        if self.group_id is None:
            return dict.fromkeys(wanted)
        with self.log._lock:
            group = self.log._group(self.group_id)
            unstable = [tp for tp in wanted if tp in group.pending]
            if unstable:
                raise TransientError(
                    f"reading committed offsets failed: a transaction is pending on {unstable}"
                )
            return {tp: group.committed.get(tp) for tp in wanted}

    def position(self, partitions: Iterable[Partition]) -> dict[Partition, int | None]:
        self._live()
        with self.log._lock:
            return {tp: self._positions.get(tp) for tp in partitions}

    def seek(self, topic: str, partition: int, offset: int) -> None:
        self._live()
        with self.log._lock:
            if (topic, partition) not in self._assigned:
                raise TransientError(f"seeking {topic} [{partition}]: partition not assigned")
            end = len(self.log._entries(topic, partition))
            self._positions[(topic, partition)] = {OFFSET_BEGINNING: 0, OFFSET_END: end}.get(
                offset, offset
            )

    # -- flow control and metadata

    def pause_all(self) -> list[Partition]:
        self._live()
        with self.log._lock:
            self._paused |= set(self._assigned)
            return list(self._assigned)

    def resume_all(self) -> None:
        self._live()
        with self.log._lock:
            self._paused.clear()

    @property
    def paused(self) -> set[Partition]:
        """The partitions paused now (for tests)."""
        return set(self._paused)

    def assignment(self) -> list[Partition]:
        self._live()
        return list(self._assigned)

    def watermarks(self, topic: str, partition: int, timeout: float = 10.0) -> tuple[int, int]:
        """``(0, high)``; ``high`` is the last stable offset for a ``read_committed`` reader."""
        self._live()
        with self.log._lock:
            entries = self.log._entries(topic, partition)
            return 0, self.log._stable_end(entries) if self.read_committed else len(entries)

    def list_partitions(self, topic: str, timeout: float = 10.0) -> int:
        self._live()
        with self.log._lock:
            self.log._entries(topic, 0)
            return len(self.log._partitions[topic])

    def close(self) -> None:
        """Leave the group, revoking the assignment (``on_revoke``); commits nothing."""
        self._touch()
        if self.closed:
            return
        self.closed = True
        if self.subscription and not self._stale() and self._assigned and self._on_revoke:
            self._on_revoke(list(self._assigned))
        self.log._leave(self)


class InMemoryProducer(_Client):
    """A :class:`streams.log.LogProducer`: records enter the log on ``flush`` (or ``close``)."""

    def __init__(self, log: InMemoryLog, client_id: str) -> None:
        super().__init__(log, client_id)
        self.buffer: list[tuple[str, int, _Entry, DeliveryCallback | None]] = []

    def _placed(
        self,
        topic: str,
        key: str | bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]] | None,
        partition: int | None,
        timestamp_ms: int | None,
    ) -> tuple[int, _Entry]:
        raw_key = key.encode() if isinstance(key, str) else key
        with self.log._lock:
            self.log._entries(topic, 0)  # raises for a missing topic
            count = len(self.log._partitions[topic])
        if partition is None:
            partition = partition_for(raw_key, count) if raw_key is not None else 0
        elif not 0 <= partition < count:
            raise ConfigurationError(f"topic {topic} has no partition {partition}")
        stamp = timestamp_ms if timestamp_ms is not None else self.log.clock()
        return partition, _Entry(raw_key, value, tuple(headers or ()), stamp)

    def produce(
        self,
        topic: str,
        key: str | bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]] | None = None,
        on_delivery: DeliveryCallback | None = None,
        partition: int | None = None,
        timestamp_ms: int | None = None,
    ) -> None:
        self._touch()
        if self.closed:
            raise TransientError(f"producer {self.client_id} is closed")
        p, entry = self._placed(topic, key, value, headers, partition, timestamp_ms)
        self.buffer.append((topic, p, entry, on_delivery))

    def poll(self, timeout: float = 0.0) -> int:
        self._touch()
        return 0

    def flush(self, timeout: float = 30.0) -> int:
        """Write every buffered record to the log; returns how many."""
        self._touch()
        delivered, self.buffer = self.buffer, []
        reports: list[tuple[DeliveryCallback, Message]] = []
        with self.log._lock:
            for topic, p, entry, on_delivery in delivered:
                offset = self.log._append(topic, p, entry)
                if on_delivery is not None:
                    reports.append((on_delivery, _message(topic, p, offset, entry)))
        for callback, message in reports:
            callback(None, message)
        return len(delivered)

    def close(self, timeout: float = 10.0) -> None:
        self._touch()
        if not self.closed:
            self.flush(timeout)
            self.closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class InMemoryTransactionalProducer(InMemoryProducer):
    """A :class:`streams.log.LogTransactionalProducer` of an :class:`InMemoryLog`."""

    def __init__(self, log: InMemoryLog, client_id: str, transactional_id: str) -> None:
        super().__init__(log, client_id)
        self.transactional_id = transactional_id
        self._ready = False
        self._fenced = False
        self._fatal: FatalKafkaError | None = None  # injected: the client cannot go on
        self._txn: _Txn | None = None

    def _check(self) -> None:
        self._touch()
        if self._fenced:
            raise FatalKafkaError(
                f"this process's transactional producer ({self.transactional_id!r}) was fenced "
                "by a newer instance with the same transactional.id",
                fenced=True,
            )
        if self._fatal is not None:
            raise self._fatal
        if self.closed:
            raise TransientError(f"producer {self.client_id} is closed")

    def _injected(self, call: str, *, after: bool) -> None:
        """Raise the failure a test queued for ``call`` (see InMemoryLog.fail_next_call)."""
        with self.log._lock:
            queued = self.log._call_failures.get((self.transactional_id, call))
            if not queued or queued[0][1] != after:
                return
            error, _ = queued.pop(0)
        if isinstance(error, FatalKafkaError):
            self._fatal = error
        raise error

    def init(self, timeout: float = 30.0) -> None:
        """Fence the previous producer of this id and abort its open transaction."""
        self._check()
        self._injected("init", after=False)
        with self.log._lock:
            previous = self.log._txn_owner.get(self.transactional_id)
            if previous is not None and previous is not self:
                previous._fenced = True
                if previous._txn is not None and previous._txn.state == "open":
                    self.log._end_transaction(previous._txn, "aborted")
            self.log._txn_owner[self.transactional_id] = self
            self._ready = True

    def begin(self) -> None:
        self._check()
        if not self._ready:
            raise RuntimeError("begin() before init()")
        if self._txn is not None and self._txn.state == "open":
            raise RuntimeError("begin() while a transaction is open")
        self._injected("begin", after=False)
        self._txn = _Txn(self.transactional_id)

    def _open(self) -> _Txn:
        if self._txn is None or self._txn.state != "open":
            raise RuntimeError("no transaction is open: call begin()")
        return self._txn

    def produce(
        self,
        topic: str,
        key: str | bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]] | None = None,
        on_delivery: DeliveryCallback | None = None,
        partition: int | None = None,
        timestamp_ms: int | None = None,
    ) -> None:
        """Write the record into the log at once, in the open transaction."""
        self._check()
        txn = self._open()
        p, entry = self._placed(topic, key, value, headers, partition, timestamp_ms)
        entry.txn = txn
        with self.log._lock:
            offset = self.log._append(topic, p, entry)
            txn.touched.add((topic, p))
        if on_delivery is not None:
            on_delivery(None, _message(topic, p, offset, entry))

    def flush(self, timeout: float = 30.0) -> int:
        self._check()
        return 0

    def send_offsets(
        self, consumer: LogConsumer, offsets: Mapping[Partition, int], timeout: float = 30.0
    ) -> None:
        """Make ``offsets`` pending in the transaction; a stale member dooms the commit."""
        self._check()
        txn = self._open()
        self._injected("send_offsets", after=False)
        if not offsets:
            return
        for tp, offset in offsets.items():
            if offset < 0:
                raise ValueError(f"offset {offset} for {tp} is not a position")
        if not isinstance(consumer, InMemoryConsumer) or consumer.group_id is None:
            raise TypeError("send_offsets needs a group consumer of the same InMemoryLog")
        with self.log._lock:
            if consumer._stale():
                txn.doomed = (
                    f"the consumer group {consumer.group_id} moved to generation "
                    f"{self.log._group(consumer.group_id).generation}; member "
                    f"{consumer.member_id} is at {consumer.generation}"
                )
                return
            group = self.log._group(consumer.group_id)
            for tp, offset in offsets.items():
                txn.offsets[(consumer.group_id, tp)] = offset
                group.pending[tp] = txn

    def commit(self, timeout: float = 30.0) -> None:
        self._check()
        txn = self._open()
        self._injected("commit", after=False)
        if self.log._take_commit_failure(self.transactional_id):
            txn.doomed = txn.doomed or "failure injected by the test"
        if txn.doomed is not None:
            raise TransactionAborted(
                f"committing the Kafka transaction failed: {txn.doomed}; the transaction "
                "must be aborted and the records re-processed from the last committed offsets"
            )
        self.log._end_transaction(txn, "committed")
        self._injected("commit", after=True)

    def abort(self, timeout: float = 30.0) -> None:
        self._check()
        self._injected("abort", after=False)
        if self._txn is not None and self._txn.state == "open":
            self.log._end_transaction(self._txn, "aborted")

    def close(self, timeout: float = 10.0) -> None:
        """Abort a transaction still open; never raises (a fenced producer closes quietly)."""
        self._touch()
        if self.closed:
            return
        self.closed = True
        if not self._fenced and self._txn is not None and self._txn.state == "open":
            self.log._end_transaction(self._txn, "aborted")
