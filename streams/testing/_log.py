"""The in-memory log: topics, groups, transactions' ends, inspection and fault hooks."""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING, Literal

from saga.streams._errors import ConfigurationError, SagaError
from saga.streams._lifecycle import Clock, wall_clock_ms
from saga.streams._topics import Topics
from saga.streams.kafka import KafkaSettings, Message, Partition, RebalanceCallback
from saga.streams.testing._clients import (
    InMemoryConsumer,
    InMemoryProducer,
    InMemoryTransactionalProducer,
)
from saga.streams.testing._model import _Client, _Entry, _Gate, _Group, _message, _Txn

if TYPE_CHECKING:
    from saga.streams.log import Log


class InMemoryLog:
    """A :class:`streams.log.Log` held in memory (see the module docstring)."""

    def __init__(
        self,
        settings: KafkaSettings | None = None,
        *,
        clock: Clock = wall_clock_ms,
        fetch_before_rebalance: bool = False,
    ) -> None:
        self._settings = settings or KafkaSettings(bootstrap="in-memory:9092")
        self.clock = clock
        self.fetch_before_rebalance = fetch_before_rebalance
        """A poll that runs a rebalance returns what it fetched just before it."""
        self._lock = threading.RLock()
        self._partitions: dict[str, list[list[_Entry]]] = {}
        self._groups: dict[str, _Group] = {}
        self._txn_owner: dict[str, InMemoryTransactionalProducer] = {}
        self._failing_commits: dict[str | None, int] = {}
        # (transactional id, call) -> errors its next calls raise, and whether after acting.
        self._call_failures: dict[tuple[str, str], list[tuple[SagaError, bool]]] = {}
        self._clients: list[_Client] = []
        self._dead_threads: set[int] = set()
        self._gates: dict[int, _Gate] = {}
        self._member_ids = itertools.count(1)

    @property
    def settings(self) -> KafkaSettings:
        return self._settings

    # ------------------------------------------------------------ topics

    def create_topic(self, name: str, partitions: int = 1) -> None:
        if partitions < 1:
            raise ValueError(f"a topic has at least one partition, not {partitions}")
        with self._lock:
            if name in self._partitions:
                raise ConfigurationError(f"topic {name} exists already")
            self._partitions[name] = [[] for _ in range(partitions)]

    def create_topics(self, partitions: int = 1) -> Topics:
        """Create the six saga topics of the settings with ``partitions`` each."""
        topics = self._settings.topics
        for name in topics.all:
            self.create_topic(name, partitions)
        return topics

    def _entries(self, topic: str, partition: int) -> list[_Entry]:
        parts = self._partitions.get(topic)
        if parts is None:
            raise ConfigurationError(
                f"topic {topic} does not exist: create the topics with `saga topics create`"
            )
        if not 0 <= partition < len(parts):
            raise ConfigurationError(f"topic {topic} has no partition {partition}")
        return parts[partition]

    @staticmethod
    def _stable_end(entries: list[_Entry]) -> int:
        """The last stable offset: the first record of an open transaction, else the end."""
        for offset, entry in enumerate(entries):
            if entry.txn is not None and entry.txn.state == "open" and not entry.marker:
                return offset
        return len(entries)

    def _append(self, topic: str, partition: int, entry: _Entry) -> int:
        entries = self._entries(topic, partition)
        entries.append(entry)
        return len(entries) - 1

    # ------------------------------------------------------------ clients (the Log protocol)

    def consumer(
        self,
        group_id: str | None = None,
        *,
        client_id: str = "saga",
        isolation_level: Literal["read_committed", "read_uncommitted"] = "read_committed",
        assignment_strategy: str = "cooperative-sticky",
        on_assign: RebalanceCallback | None = None,
        on_revoke: RebalanceCallback | None = None,
        on_lost: RebalanceCallback | None = None,
        group_instance_id: str | None = None,
    ) -> InMemoryConsumer:
        """A consumer; every group assigns by range, whatever ``assignment_strategy`` says.

        ``group_instance_id`` (static membership) is modelled only as Kafka fences: a
        consumer that joins with the id of a live member replaces it, and the replaced
        one's next call raises :class:`~streams.FatalKafkaError` (there are no sessions
        to outlive).
        """
        made = InMemoryConsumer(
            self,
            group_id,
            client_id=client_id,
            read_committed=isolation_level == "read_committed",
            on_assign=on_assign,
            on_revoke=on_revoke,
            on_lost=on_lost,
        )
        made.group_instance_id = group_instance_id
        with self._lock:
            self._clients.append(made)
        return made

    def producer(self, *, client_id: str = "saga") -> InMemoryProducer:
        made = InMemoryProducer(self, client_id)
        with self._lock:
            self._clients.append(made)
        return made

    def transactional_producer(
        self,
        transactional_id: str,
        *,
        client_id: str = "saga",
        transaction_timeout_ms: int = 60_000,
    ) -> InMemoryTransactionalProducer:
        if not transactional_id:
            raise ConfigurationError("a transactional producer needs a transactional.id")
        made = InMemoryTransactionalProducer(self, client_id, transactional_id)
        with self._lock:
            self._clients.append(made)
        return made

    # ------------------------------------------------------------ groups

    def _group(self, group_id: str) -> _Group:
        return self._groups.setdefault(group_id, _Group())

    def _join(self, consumer: InMemoryConsumer) -> None:
        assert consumer.group_id is not None
        with self._lock:
            consumer.member_id = f"{consumer.client_id}-{next(self._member_ids):06d}"
            group = self._group(consumer.group_id)
            if consumer.group_instance_id is not None:
                for member_id, member in list(group.members.items()):
                    if member.group_instance_id == consumer.group_instance_id:
                        del group.members[member_id]  # fenced, as Kafka's FENCED_INSTANCE_ID
                        member.replaced = True
            group.members[consumer.member_id] = consumer
            self._regroup(group)

    def _leave(self, consumer: InMemoryConsumer) -> None:
        with self._lock:
            if consumer.group_id is None or consumer.member_id is None:
                return
            group = self._group(consumer.group_id)
            if group.members.get(consumer.member_id) is consumer:
                del group.members[consumer.member_id]
                self._regroup(group)

    def _regroup(self, group: _Group) -> None:
        """A new generation, assigned as the range assignor does."""
        group.generation += 1
        ids = sorted(group.members)
        result: dict[str, list[Partition]] = {m: [] for m in ids}
        topics = sorted({t for m in ids for t in group.members[m].subscription})
        for topic in topics:
            subscribers = [m for m in ids if topic in group.members[m].subscription]
            count = len(self._partitions.get(topic, ()))
            per, extra = divmod(count, len(subscribers))
            start = 0
            for i, member in enumerate(subscribers):
                n = per + (1 if i < extra else 0)
                result[member] += [(topic, p) for p in range(start, start + n)]
                start += n
        group.assignment = result

    def _end_transaction(self, txn: _Txn, state: Literal["committed", "aborted"]) -> None:
        """Commit or abort ``txn``: markers on its partitions; its offsets, if committed."""
        with self._lock:
            txn.state = state
            for topic, partition in sorted(txn.touched):
                marker = _Entry(None, None, (), self.clock(), txn, marker=True)
                self._append(topic, partition, marker)
            for (group_id, tp), offset in txn.offsets.items():
                group = self._group(group_id)
                if state == "committed":
                    group.committed[tp] = offset
                if group.pending.get(tp) is txn:
                    del group.pending[tp]

    # ------------------------------------------------------------ inspection (for tests)

    def records(self, topic: str, partition: int | None = None) -> list[Message]:
        """What a ``read_committed`` reader sees of ``topic`` (one partition, or all in order)."""
        with self._lock:
            parts = range(len(self._partitions[topic])) if partition is None else [partition]
            return [
                _message(topic, p, offset, entry)
                for p in parts
                for offset, entry in enumerate(self._entries(topic, p))
                if entry.visible(True)
            ]

    def end_offset(self, topic: str, partition: int) -> int:
        """The offset the next record of the partition gets (markers count)."""
        with self._lock:
            return len(self._entries(topic, partition))

    def committed_offset(self, group_id: str, topic: str, partition: int) -> int | None:
        with self._lock:
            return self._group(group_id).committed.get((topic, partition))

    def members(self, group_id: str) -> list[InMemoryConsumer]:
        """The group's members, by member id."""
        with self._lock:
            group = self._group(group_id)
            return [group.members[m] for m in sorted(group.members)]

    def generation(self, group_id: str) -> int:
        with self._lock:
            return self._group(group_id).generation

    # ------------------------------------------------------------ faults (for tests)

    def drop(self, consumer: InMemoryConsumer) -> None:
        """Remove ``consumer`` from its group without its knowing (its session timed out).

        The others rebalance at their next poll; ``consumer``, if it polls again,
        gets ``on_lost`` and joins again as a new member.
        """
        self._leave(consumer)

    def fail_next_commit(self, transactional_id: str | None = None, times: int = 1) -> None:
        """Make the next ``times`` transaction commits (of one id, or of any) abort."""
        with self._lock:
            self._failing_commits[transactional_id] = (
                self._failing_commits.get(transactional_id, 0) + times
            )

    def fail_next_call(
        self,
        transactional_id: str,
        call: Literal["init", "begin", "send_offsets", "commit", "abort"],
        error: SagaError,
        *,
        after: bool = False,
    ) -> None:
        """Make the next ``call`` of the producer of ``transactional_id`` raise ``error``.

        With ``after``, the call does its work first (a commit commits: its answer was
        lost). A :class:`~streams.FatalKafkaError` leaves the producer unusable: every
        later call raises it too, as librdkafka does after a fatal error. Calls queue.
        """
        with self._lock:
            self._call_failures.setdefault((transactional_id, call), []).append((error, after))

    def _take_commit_failure(self, transactional_id: str) -> bool:
        with self._lock:
            for key in (transactional_id, None):
                if self._failing_commits.get(key, 0) > 0:
                    self._failing_commits[key] -= 1
                    return True
            return False

    def kill(self, thread_id: int | None = None) -> None:
        """Kill the clients last used by a thread (default: this one), as a SIGKILL would.

        Their members leave their groups without callbacks (as if the session timed
        out), unflushed records are lost, open transactions stay open until the
        transactional id is initialised again, and every later call on them (or, on
        any client of this log, from that thread: it must not use this log again;
        a :class:`Stepper`'s thread is forgotten when it ends) raises :class:`Killed`.
        """
        ident = threading.get_ident() if thread_id is None else thread_id
        with self._lock:
            self._dead_threads.add(ident)
            for client in self._clients:
                if client.thread_id == ident and not client.dead:
                    client.dead = True
                    if isinstance(client, InMemoryConsumer):
                        self._leave(client)
                    elif isinstance(client, InMemoryProducer):
                        client.buffer.clear()

    def _park(self) -> None:
        gate = self._gates.get(threading.get_ident())
        if gate is not None:
            gate.park()


if TYPE_CHECKING:
    _IS_A_LOG: Log = InMemoryLog()  # mypy checks that it implements the protocols
