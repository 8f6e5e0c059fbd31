"""The log as the services see it: small protocols over Kafka's clients.

The coordinator service and the participant runtime talk to the log only
through :class:`Log` (a factory of consumers and producers) and the three
client protocols below. :class:`KafkaLog` is the production implementation
(confluent-kafka; defined in :mod:`streams.kafka`, re-exported here);
:class:`streams.testing.InMemoryLog` is an in-memory one for fast unit tests
of the services (partitions, consumer groups, committed offsets, transactions,
read_committed and rebalances), with no broker.

The protocols state only what the services use; the Kafka classes offer more
(admin, watermarks for tools, delivery callbacks).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, Protocol, Self

from saga.streams.kafka import (
    DeliveryCallback,
    KafkaLog,
    KafkaSettings,
    Message,
    Partition,
    RebalanceCallback,
)

__all__ = [
    "KafkaLog",
    "Log",
    "LogConsumer",
    "LogProducer",
    "LogTransactionalProducer",
    "RebalanceCallback",
]


class LogConsumer(Protocol):
    """A consumer with auto-commit off (see :class:`streams.kafka.Consumer`)."""

    def subscribe(self, topics: Sequence[str]) -> None: ...

    def assign(
        self,
        partitions_with_offsets: Mapping[Partition, int] | Iterable[tuple[str, int, int]],
    ) -> None: ...

    def poll_batch(self, max_messages: int = 500, timeout: float = 1.0) -> list[Message]: ...

    def commit(self, offsets: Mapping[Partition, int]) -> None: ...

    def commit_async(self, offsets: Mapping[Partition, int]) -> None: ...

    def committed(
        self, partitions: Iterable[Partition], timeout: float = 10.0
    ) -> dict[Partition, int | None]: ...

    def position(self, partitions: Iterable[Partition]) -> dict[Partition, int | None]: ...

    def seek(self, topic: str, partition: int, offset: int) -> None: ...

    def pause_all(self) -> list[Partition]: ...

    def resume_all(self) -> None: ...

    def assignment(self) -> list[Partition]: ...

    def watermarks(self, topic: str, partition: int, timeout: float = 10.0) -> tuple[int, int]: ...

    def list_partitions(self, topic: str, timeout: float = 10.0) -> int: ...

    @property
    def rejoins(self) -> int:
        """Rejoins after an instance fence (a static member: see streams._rejoin)."""
        ...

    def close(self) -> None: ...


class LogProducer(Protocol):
    """An idempotent producer (see :class:`streams.kafka.Producer`)."""

    def produce(
        self,
        topic: str,
        key: str | bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]] | None = None,
        on_delivery: DeliveryCallback | None = None,
        partition: int | None = None,
        timestamp_ms: int | None = None,
    ) -> None: ...

    def poll(self, timeout: float = 0.0) -> int: ...

    def flush(self, timeout: float = 30.0) -> int: ...

    def close(self, timeout: float = 10.0) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc_info: object) -> None: ...


class LogTransactionalProducer(LogProducer, Protocol):
    """A producer whose records and consumer offsets commit atomically."""

    def init(self, timeout: float = 30.0) -> None: ...

    def begin(self) -> None: ...

    def send_offsets(
        self, consumer: LogConsumer, offsets: Mapping[Partition, int], timeout: float = 30.0
    ) -> None: ...

    def commit(self, timeout: float = 30.0) -> None: ...

    def abort(self, timeout: float = 30.0) -> None: ...


class Log(Protocol):
    """Makes the consumers and producers a service needs."""

    @property
    def settings(self) -> KafkaSettings: ...

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
    ) -> LogConsumer: ...

    def producer(self, *, client_id: str = "saga") -> LogProducer: ...

    def transactional_producer(
        self,
        transactional_id: str,
        *,
        client_id: str = "saga",
        transaction_timeout_ms: int = 60_000,
    ) -> LogTransactionalProducer: ...
