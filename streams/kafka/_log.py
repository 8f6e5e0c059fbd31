"""The production :class:`streams.log.Log`: confluent-kafka clients for one deployment."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from saga.streams.kafka._consumer import Consumer
from saga.streams.kafka._message import RebalanceCallback
from saga.streams.kafka._producer import Producer
from saga.streams.kafka._settings import KafkaSettings
from saga.streams.kafka._txn_producer import TransactionalProducer


class KafkaLog:
    """The production :class:`~streams.log.Log`: confluent-kafka clients for ``settings``.

    ``on_wedged`` is called with a sentence when a transactional call outlives its
    timeout by far (a wedged client that cannot be used again): the process
    decides what to do (the command line exits, so a restart takes over).
    """

    def __init__(
        self, settings: KafkaSettings, *, on_wedged: Callable[[str], None] | None = None
    ) -> None:
        self._settings = settings
        self._on_wedged = on_wedged

    @property
    def settings(self) -> KafkaSettings:
        return self._settings

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
    ) -> Consumer:
        return Consumer(
            self._settings,
            group_id,
            client_id=client_id,
            isolation_level=isolation_level,
            assignment_strategy=assignment_strategy,
            on_assign=on_assign,
            on_revoke=on_revoke,
            on_lost=on_lost,
            group_instance_id=group_instance_id,
        )

    def producer(self, *, client_id: str = "saga") -> Producer:
        return Producer(self._settings, client_id=client_id)

    def transactional_producer(
        self,
        transactional_id: str,
        *,
        client_id: str = "saga",
        transaction_timeout_ms: int = 60_000,
    ) -> TransactionalProducer:
        return TransactionalProducer(
            self._settings,
            transactional_id,
            client_id=client_id,
            transaction_timeout_ms=transaction_timeout_ms,
            on_wedged=self._on_wedged,
        )
