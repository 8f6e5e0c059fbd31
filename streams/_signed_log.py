"""A :class:`~streams.log.Log` whose producers sign every record they write.

:class:`SignedLog` wraps the log a service would use and adds the key id and the
signature of :meth:`Keyring.sign <streams._signing.Keyring.sign>` to the headers
of every record its producers (plain and transactional) produce: requests,
events, decisions, status records, dead letters and tombstones alike. Everything
else (consumers, transactions, offsets) is the wrapped log's, so a service signs
what it writes without any signing code of its own. Verifying what is read is
the reader's business (see :mod:`streams._signing`).

Records are signed in batches (:meth:`Keyring.sign_batch
<streams._signing.Keyring.sign_batch>`: one Ed25519 signature for up to
:data:`BATCH_RECORDS` records), so a producer holds what it is given and hands it
to the wrapped producer, signed, when the batch is complete:

* a transactional producer, at ``send_offsets`` and ``commit`` (nothing of a
  transaction is visible before its commit anyway); ``abort`` drops what it holds;
* a plain producer, at ``poll``, ``flush``, ``close`` and the end of a ``with``
  block, once :data:`BATCH_RECORDS` are held, and at the latest :data:`LINGER_S`
  after the first one was held (on Kafka, from a thread of its own; the
  in-memory log writes only at ``flush`` anyway).

The order of records is kept. An error of the wrapped ``produce`` (a queue full
for 30 s, a fatal producer) comes out of the call that hands the records on, and
the records not handed on stay held for the next try (the linger thread does not
retry: it logs a warning and leaves that to the caller's next ``poll``, ``flush``
or ``close``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Final, Literal, Self

from saga.streams._errors import ConfigurationError
from saga.streams._signing import Keyring
from saga.streams.kafka import (
    DeliveryCallback,
    KafkaLog,
    KafkaSettings,
    Partition,
    RebalanceCallback,
)
from saga.streams.log import Log, LogConsumer, LogProducer, LogTransactionalProducer

__all__ = ["BATCH_RECORDS", "LINGER_S", "SignedLog"]

log = logging.getLogger("saga.kafka")

BATCH_RECORDS: Final = 32
"""Records under one signature. Each record carries log2 of it hashes (32 bytes each),
and a reader verifies one signature per batch: 32 keeps a proof at 164 bytes and the
Ed25519 work per record near a thirtieth (docs/signing-performance.md)."""
LINGER_S: Final = 0.005
"""The longest a plain producer on Kafka holds a record nobody flushes (librdkafka's own
``linger.ms`` here is 5 ms too)."""

_Held = tuple[
    str,
    str | bytes | None,
    bytes | None,
    Sequence[tuple[str, bytes]] | None,
    DeliveryCallback | None,
    int | None,
    int | None,
]


class _SigningProducer:
    """A :class:`~streams.log.LogProducer` that signs in batches, then hands records on."""

    def __init__(self, inner: LogProducer, keys: Keyring, *, linger_s: float | None) -> None:
        self._inner = inner
        self._keys = keys
        self._held: list[_Held] = []
        # Reentrant: a delivery callback run by the wrapped produce may produce again.
        self._cond = threading.Condition(threading.RLock())
        self._linger_s = linger_s
        self._held_since = 0.0
        self._closed = False
        self._thread: threading.Thread | None = None
        # The linger thread's last hand-on failed: it waits for a caller to try again.
        self._stalled = False

    def _holding(self) -> bool:
        """Whether ``produce`` holds the record now (else it is signed and sent at once)."""
        return True

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
        with self._cond:
            if self._closed or not self._holding():
                # Closed, or outside a transaction: the wrapped producer refuses it, saying why.
                record = (topic, key, value, headers, on_delivery, partition, timestamp_ms)
                self._hand_on([record], keep=False)
                return
            self._held.append((topic, key, value, headers, on_delivery, partition, timestamp_ms))
            if len(self._held) >= BATCH_RECORDS:
                self.release()
            elif len(self._held) == 1 and self._linger_s is not None:
                self._held_since = time.monotonic()
                self._start_lingering()
                self._cond.notify()

    def release(self) -> None:
        """Sign every record held and hand it to the wrapped producer, in order.

        What the wrapped producer refuses stays held, in order, and its error is raised.
        """
        with self._cond:
            self._stalled = False
            self._release()

    def _release(self) -> None:
        while self._held:
            batch, self._held = self._held[:BATCH_RECORDS], self._held[BATCH_RECORDS:]
            self._hand_on(batch, keep=True)

    def _hand_on(self, batch: list[_Held], *, keep: bool) -> None:
        """Sign ``batch`` and produce it; with ``keep``, what is refused is held again."""
        signed = self._keys.sign_batch([(t, k, v, h) for t, k, v, h, *_ in batch])
        for i, ((topic, key, value, _, on_delivery, partition, stamp), headers) in enumerate(
            zip(batch, signed, strict=True)
        ):
            try:
                self._inner.produce(
                    topic,
                    key,
                    value,
                    headers=headers,
                    on_delivery=on_delivery,
                    partition=partition,
                    timestamp_ms=stamp,
                )
            except BaseException:
                if keep:  # signed again in a later batch; those handed on keep their proofs
                    self._held[:0] = batch[i:]
                raise

    def _start_lingering(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(
                target=self._linger, name="saga-signing-linger", daemon=True
            )
            self._thread.start()

    def _linger(self) -> None:
        """Hand on what no one flushed within the linger time (a plain producer on Kafka)."""
        assert self._linger_s is not None
        with self._cond:
            while not self._closed:
                if not self._held or self._stalled:
                    self._cond.wait()
                    continue
                left = self._held_since + self._linger_s - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                try:
                    self._release()
                except Exception as exc:
                    # Kafka refused them (a queue full for 30 s, a fatal error): they stay
                    # held, and lingering stops until a caller's poll, flush or close tries
                    # again, which raises what it meets. Retrying here would hold the lock.
                    self._stalled = True
                    log.warning("signed records held, not yet handed to Kafka: %s", exc)

    def poll(self, timeout: float = 0.0) -> int:
        self.release()
        return self._inner.poll(timeout)

    def flush(self, timeout: float = 30.0) -> int:
        self.release()
        return self._inner.flush(timeout)

    def close(self, timeout: float = 10.0) -> None:
        try:
            self.release()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._inner.close(timeout)

    def __enter__(self) -> Self:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.release()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._inner.__exit__(*exc_info)


class _SigningTransactionalProducer(_SigningProducer):
    """A :class:`~streams.log.LogTransactionalProducer` that signs each transaction's records
    in batches, handed on at ``send_offsets`` and ``commit``."""

    def __init__(self, inner: LogTransactionalProducer, keys: Keyring) -> None:
        super().__init__(inner, keys, linger_s=None)
        self._transactional = inner
        self._in_transaction = False

    def _holding(self) -> bool:
        # Outside a transaction the wrapped producer refuses the record: let it say so.
        return self._in_transaction

    def init(self, timeout: float = 30.0) -> None:
        self._transactional.init(timeout)

    def begin(self) -> None:
        self._transactional.begin()
        self._in_transaction = True

    def send_offsets(
        self, consumer: LogConsumer, offsets: Mapping[Partition, int], timeout: float = 30.0
    ) -> None:
        self.release()  # what the wrapped produce raises comes before the commit is asked
        self._transactional.send_offsets(consumer, offsets, timeout)

    def commit(self, timeout: float = 30.0) -> None:
        self.release()
        self._in_transaction = False
        self._transactional.commit(timeout)

    def abort(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._held.clear()
        self._in_transaction = False
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
        linger = LINGER_S if isinstance(self._log, KafkaLog) else None
        return _SigningProducer(self._log.producer(client_id=client_id), self.keys, linger_s=linger)

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
