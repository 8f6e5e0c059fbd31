"""A :class:`~streams.log.Log` whose producers sign every record they write.

:class:`SignedLog` wraps the log a service would use and adds the key id and the
signature of :meth:`Keyring.sign <streams._signing.Keyring.sign>` to the headers
of every record its producers (plain and transactional) produce: requests,
events, decisions, status records, dead letters and tombstones alike. Everything
else (consumers, flushes, transactions, offsets) is the wrapped log's, so a
service signs what it writes without any signing code of its own. Verifying what
is read is the reader's business (see :mod:`streams._signing`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, Self

from saga.streams._errors import ConfigurationError
from saga.streams._signing import Keyring
from saga.streams.kafka import DeliveryCallback, KafkaSettings, Partition, RebalanceCallback
from saga.streams.log import Log, LogConsumer, LogProducer, LogTransactionalProducer

__all__ = ["SignedLog"]


class _SigningProducer:
    """A :class:`~streams.log.LogProducer` that signs, then hands the record on."""

    def __init__(self, inner: LogProducer, keys: Keyring) -> None:
        self._inner = inner
        self._keys = keys

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
        self._inner.produce(
            topic,
            key,
            value,
            headers=self._keys.sign(topic, key, value, headers),
            on_delivery=on_delivery,
            partition=partition,
            timestamp_ms=timestamp_ms,
        )

    def poll(self, timeout: float = 0.0) -> int:
        return self._inner.poll(timeout)

    def flush(self, timeout: float = 30.0) -> int:
        return self._inner.flush(timeout)

    def close(self, timeout: float = 10.0) -> None:
        self._inner.close(timeout)

    def __enter__(self) -> Self:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._inner.__exit__(*exc_info)


class _SigningTransactionalProducer(_SigningProducer):
    """A :class:`~streams.log.LogTransactionalProducer` that signs every record."""

    def __init__(self, inner: LogTransactionalProducer, keys: Keyring) -> None:
        super().__init__(inner, keys)
        self._transactional = inner

    def init(self, timeout: float = 30.0) -> None:
        self._transactional.init(timeout)

    def begin(self) -> None:
        self._transactional.begin()

    def send_offsets(
        self, consumer: LogConsumer, offsets: Mapping[Partition, int], timeout: float = 30.0
    ) -> None:
        self._transactional.send_offsets(consumer, offsets, timeout)

    def commit(self, timeout: float = 30.0) -> None:
        self._transactional.commit(timeout)

    def abort(self, timeout: float = 30.0) -> None:
        self._transactional.abort(timeout)


class SignedLog:
    """``log``, with producers that sign every record with ``keys`` (which must sign).

    Consumers are ``log``'s own: a transactional producer of this log takes them
    in ``send_offsets`` as they are.
    """

    def __init__(self, log: Log, keys: Keyring) -> None:
        if not keys.signs:
            raise ConfigurationError("a signed log needs a keyring with a private key")
        self._log = log
        self.keys = keys

    @property
    def inner(self) -> Log:
        """The wrapped log."""
        return self._log

    @property
    def settings(self) -> KafkaSettings:
        return self._log.settings

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
    ) -> LogConsumer:
        return self._log.consumer(
            group_id,
            client_id=client_id,
            isolation_level=isolation_level,
            assignment_strategy=assignment_strategy,
            on_assign=on_assign,
            on_revoke=on_revoke,
            on_lost=on_lost,
            group_instance_id=group_instance_id,
        )

    def producer(self, *, client_id: str = "saga") -> LogProducer:
        return _SigningProducer(self._log.producer(client_id=client_id), self.keys)

    def transactional_producer(
        self,
        transactional_id: str,
        *,
        client_id: str = "saga",
        transaction_timeout_ms: int = 60_000,
    ) -> LogTransactionalProducer:
        return _SigningTransactionalProducer(
            self._log.transactional_producer(
                transactional_id,
                client_id=client_id,
                transaction_timeout_ms=transaction_timeout_ms,
            ),
            self.keys,
        )


def signing(log: Log, keys: Keyring | None) -> Log:
    """``log`` signing with ``keys`` when they hold a private key; else ``log`` itself."""
    if keys is None or not keys.signs or isinstance(log, SignedLog):
        return log
    return SignedLog(log, keys)
