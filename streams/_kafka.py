"""Kafka clients behind a thin typed layer: the only module of saga that imports confluent_kafka.

Everything else in the project sees :class:`KafkaSettings`, :class:`Message`,
``(topic, partition)`` tuples and saga's own errors (:mod:`streams._errors`);
confluent-kafka objects and ``KafkaException`` never leave this module.

Offsets: the off-by-one
-----------------------
Every offset this module takes or returns for committing, resuming or
positioning is **the next offset to read**, i.e. *the offset of the last record
processed + 1* (:attr:`Message.next_offset`). That is Kafka's convention for
committed offsets: a consumer that restarts from committed offset ``N`` reads the
record at ``N`` first. Committing ``message.offset`` instead of
``message.offset + 1`` re-delivers the last processed record after every
restart or rebalance; committing ``+ 2`` silently skips one. This applies to
:meth:`Consumer.commit`, :meth:`Consumer.committed`, :meth:`Consumer.position`,
:meth:`Consumer.assign`, :meth:`Consumer.seek` (which takes the offset of the
next record wanted) and :meth:`TransactionalProducer.send_offsets`.

Errors
------
* :class:`~streams._errors.FatalKafkaError` — the client cannot go on: a fenced
  transactional producer (another instance took over its ``transactional.id``)
  or any error librdkafka flags as fatal. The process should exit.
* :class:`TransactionAborted` (a :class:`~streams._errors.TransientError`) — the
  current Kafka transaction cannot commit; abort it and re-process from the last
  committed offsets.
* :class:`~streams._errors.TransientError` — the broker is unreachable, slow or
  rebalancing; retrying later can help.
* :class:`~streams._errors.ConfigurationError` — bad settings, a missing topic,
  authentication or authorisation refused.

Partitioning: every producer here hashes keys with murmur2 (``murmur2_random``),
the Java client's partitioner, so a record re-published by a JVM client (the
Spark reconciliation job) lands on the same partition as one produced from
Python. librdkafka's own default (CRC32) would not.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Literal, Self, TypeVar

import confluent_kafka as ck
from confluent_kafka.admin import AdminClient

# The defining modules: confluent_kafka.admin re-exports these without marking
# them as exported, which strict type checking rejects.
from confluent_kafka.admin._config import ConfigResource
from confluent_kafka.cimpl import NewTopic

from ._duration import DEFAULT_RETENTION_MS
from ._errors import ConfigurationError, FatalKafkaError, SagaError, TransientError
from ._limits import DLQ_EXCERPT_BYTES, MAX_RECORD_BYTES
from ._topics import Topics

__all__ = [
    "OFFSET_BEGINNING",
    "OFFSET_END",
    "Consumer",
    "DeliveryCallback",
    "KafkaSettings",
    "Message",
    "Partition",
    "Producer",
    "RebalanceCallback",
    "TransactionAborted",
    "TransactionalProducer",
    "create_topics",
    "delete_topics",
    "describe_partitions",
    "partition_for",
    "send_to_dlq",
    "topic_config",
    "wait_for_broker",
]

_log = logging.getLogger("saga.kafka")
# librdkafka's own log lines (connection failures, retries, ...) go here.
_librdkafka_log = logging.getLogger("saga.kafka.librdkafka")

if TYPE_CHECKING:
    from streams.log import LogProducer

_T = TypeVar("_T")

Partition = tuple[str, int]
"""A partition as ``(topic, partition number)``."""

RebalanceCallback = Callable[[list[Partition]], None]
"""Called with the partitions assigned, revoked or lost by a group rebalance."""

DeliveryCallback = Callable[["SagaError | None", "Message"], None]
"""Called once per produced record: ``(None, record)`` when the broker acknowledged it
(``record.offset`` is then its offset), ``(error, record)`` when it was not delivered."""

OFFSET_BEGINNING: Final = ck.OFFSET_BEGINNING
"""For :meth:`Consumer.assign`: start at the oldest record the partition still holds."""
OFFSET_END: Final = ck.OFFSET_END
"""For :meth:`Consumer.assign`: start after the newest record (read only new ones)."""

_ENV_PREFIX: Final = "SAGA_KAFKA_"
_ENV_BOOTSTRAP: Final = "SAGA_KAFKA_BOOTSTRAP"
_ENV_TOPIC_PREFIX: Final = "SAGA_TOPIC_PREFIX"

# Settings saga decides itself; letting a config file change them would break the
# guarantees of DESIGN §5 (or, for bootstrap.servers, contradict --bootstrap).
_RESERVED: Final = frozenset(
    {
        "acks",
        "enable.auto.commit",
        "enable.idempotence",
        "group.id",
        "isolation.level",
        "transactional.id",
    }
)

_E = ck.KafkaError
_FENCED_CODES: Final = frozenset({_E._FENCED, _E.PRODUCER_FENCED, _E.INVALID_PRODUCER_EPOCH})
_UNKNOWN_TOPIC_CODES: Final = frozenset(
    {_E.UNKNOWN_TOPIC_OR_PART, _E._UNKNOWN_TOPIC, _E._UNKNOWN_PARTITION}
)
_AUTH_CODES: Final = frozenset(
    {
        _E._AUTHENTICATION,
        _E.SASL_AUTHENTICATION_FAILED,
        _E.TOPIC_AUTHORIZATION_FAILED,
        _E.GROUP_AUTHORIZATION_FAILED,
        _E.CLUSTER_AUTHORIZATION_FAILED,
        _E.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    }
)

_TXN_ATTEMPTS: Final = 5
_WEDGED_AFTER_S: Final = 30.0
"""How long past its own timeout a transactional call may run before the client is wedged."""
_BUFFER_FULL_TIMEOUT_S: Final = 30.0


class TransactionAborted(TransientError):
    """The current Kafka transaction failed and cannot be committed.

    Nothing it produced becomes visible to ``read_committed`` readers and its
    offsets are not committed. The caller calls :meth:`TransactionalProducer.abort`,
    rewinds its consumer to the last committed offsets and processes the records
    again in a new transaction.
    """


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class KafkaSettings:
    """How to reach Kafka and which topics to use; built once at start-up.

    ``extra`` holds librdkafka settings passed to every client this module
    creates (``security.protocol``, ``sasl.mechanism``, ``ssl.ca.location``,
    ...). The settings that carry saga's guarantees (``acks``,
    ``enable.idempotence``, ``transactional.id``, ``group.id``,
    ``enable.auto.commit``, ``isolation.level``) and ``bootstrap.servers`` are
    not accepted there.

    Raises:
        ConfigurationError: empty ``bootstrap``, a bad ``prefix`` or a reserved
            key in ``extra``.
    """

    bootstrap: str
    prefix: str = "saga"
    extra: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.bootstrap.strip():
            raise ConfigurationError(
                "no Kafka address: pass --bootstrap HOST:PORT or set SAGA_KAFKA_BOOTSTRAP"
            )
        Topics(self.prefix)  # validates the prefix
        for key in self.extra:
            if key == "bootstrap.servers":
                raise ConfigurationError(
                    "bootstrap.servers cannot be an extra Kafka setting: pass it as the address"
                )
            if key in _RESERVED:
                raise ConfigurationError(
                    f"the Kafka setting {key} is fixed by saga (it carries the delivery "
                    "guarantees) and cannot be changed in the configuration"
                )
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))

    @property
    def topics(self) -> Topics:
        """The topic names under this deployment's prefix."""
        return Topics(self.prefix)

    @classmethod
    def from_sources(
        cls,
        bootstrap: str | None,
        prefix: str | None,
        config_file: str | None,
        environ: Mapping[str, str],
    ) -> KafkaSettings:
        """Build settings from command-line values, a config file and the environment.

        * address: ``bootstrap``, else ``SAGA_KAFKA_BOOTSTRAP``, else a
          ``bootstrap.servers`` line of the config file;
        * topic prefix: ``prefix``, else ``SAGA_TOPIC_PREFIX``, else ``saga``;
        * extra librdkafka settings: ``name=value`` lines of ``config_file``
          (blank lines and lines starting with ``#`` are skipped; everything
          after the first ``=`` is the value, so values may contain ``=`` and
          ``#``), then every ``SAGA_KAFKA_<NAME>`` variable, which overrides the
          file. ``<NAME>`` maps to the librdkafka name by lower-casing it and
          turning ``_`` into ``.``: ``SAGA_KAFKA_SECURITY_PROTOCOL`` sets
          ``security.protocol``.

        Only ``environ`` is read, never ``os.environ``: the caller passes it in.

        Raises:
            ConfigurationError: no address, an unreadable file or a line that is
                not ``name=value`` (the message names the file and line), or a
                setting saga does not allow to change.
        """
        extra: dict[str, str] = {}
        if config_file is not None:
            extra.update(_read_config_file(config_file))
        for name, value in environ.items():
            if name.startswith(_ENV_PREFIX) and name != _ENV_BOOTSTRAP:
                suffix = name[len(_ENV_PREFIX) :]
                if suffix:
                    extra[suffix.lower().replace("_", ".")] = value
        from_file_or_env = extra.pop("bootstrap.servers", None)
        address = bootstrap or environ.get(_ENV_BOOTSTRAP) or from_file_or_env
        if not address:
            raise ConfigurationError(
                "no Kafka address: pass --bootstrap HOST:PORT or set SAGA_KAFKA_BOOTSTRAP"
            )
        topic_prefix = prefix or environ.get(_ENV_TOPIC_PREFIX) or "saga"
        return cls(bootstrap=address, prefix=topic_prefix, extra=extra)


def _read_config_file(path: str) -> dict[str, str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigurationError(
            f"cannot read the Kafka config file {path}: {exc.strerror or exc}"
        ) from exc
    except UnicodeDecodeError as exc:
        raise ConfigurationError(f"the Kafka config file {path} is not UTF-8 text") from exc
    settings: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        name = name.strip()
        # The line itself is not echoed: it may hold a password.
        if not sep or not name or any(c.isspace() for c in name):
            raise ConfigurationError(
                f"{path}, line {number}: expected name=value, a librdkafka setting "
                "such as security.protocol=SASL_SSL"
            )
        settings[name] = value.strip()
    return settings


def _client_config(settings: KafkaSettings, **fixed: Any) -> dict[str, Any]:
    """The librdkafka configuration: address, the user's extras, then saga's fixed values."""
    config: dict[str, Any] = {
        "bootstrap.servers": settings.bootstrap,
        "logger": _librdkafka_log,
        # Brokers close idle connections routinely; that is not worth a log line.
        "log.connection.close": False,
    }
    config.update(settings.extra)
    config.update({key.replace("_", "."): value for key, value in fixed.items()})
    return config


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class Message:
    """A consumed (or delivered) record, copied out of the client library.

    ``offset`` is the record's own offset; the offset to commit after processing
    it is :attr:`next_offset`. ``timestamp_ms`` is ``None`` when the broker gave
    none. Header values that were null arrive as ``b""``.
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()
    timestamp_ms: int | None = None

    @property
    def next_offset(self) -> int:
        """The offset to commit once this record is processed: ``offset + 1``."""
        return self.offset + 1

    @property
    def partition_key(self) -> Partition:
        """``(topic, partition)``, the key of the offset mappings of this module."""
        return (self.topic, self.partition)

    def header(self, name: str) -> bytes | None:
        """The value of the last header called ``name``, or ``None``."""
        found: bytes | None = None
        for key, value in self.headers:
            if key == name:
                found = value
        return found


def _to_message(raw: ck.Message) -> Message:
    raw_headers = raw.headers() or []
    pairs = raw_headers.items() if isinstance(raw_headers, Mapping) else raw_headers
    headers = tuple(
        (name, value.encode() if isinstance(value, str) else (value or b""))
        for name, value in pairs
    )
    kind, stamp = raw.timestamp()
    partition = raw.partition()
    offset = raw.offset()
    return Message(
        topic=raw.topic() or "",
        partition=-1 if partition is None else partition,
        offset=-1 if offset is None else offset,
        key=raw.key(),
        value=raw.value(),
        headers=headers,
        timestamp_ms=None if kind == ck.TIMESTAMP_NOT_AVAILABLE else stamp,
    )


def _tps(partitions: Iterable[Partition]) -> list[ck.TopicPartition]:
    return [ck.TopicPartition(topic, partition) for topic, partition in partitions]


def _tps_at(offsets: Mapping[Partition, int]) -> list[ck.TopicPartition]:
    return [ck.TopicPartition(topic, part, offset) for (topic, part), offset in offsets.items()]


def _offset_or_none(offset: int) -> int | None:
    # librdkafka reports "no offset" as a negative logical offset (OFFSET_INVALID).
    return offset if offset >= 0 else None


# --------------------------------------------------------------------------- errors


def _error_of(exc: ck.KafkaException) -> ck.KafkaError | None:
    first = exc.args[0] if exc.args else None
    return first if isinstance(first, ck.KafkaError) else None


def _fenced_sentence(transactional_id: str) -> str:
    return (
        f"this process's transactional producer ({transactional_id!r}) was fenced by a "
        "newer instance with the same transactional.id; exiting"
    )


def _translate(
    err: ck.KafkaError | None,
    doing: str,
    *,
    text: str,
    topic: str | None = None,
    transactional_id: str | None = None,
) -> SagaError:
    """Map one librdkafka error to saga's error tree (see the module docstring)."""
    if err is None:
        return TransientError(f"{doing} failed: {text}")
    code = err.code()
    if code in _FENCED_CODES and transactional_id is not None:
        return FatalKafkaError(_fenced_sentence(transactional_id))
    if err.fatal() or code == _E._FATAL:
        return FatalKafkaError(f"{doing} failed with a fatal Kafka error: {err.str()}; exiting")
    if err.txn_requires_abort():
        return TransactionAborted(
            f"{doing} failed: {err.str()}; the transaction must be aborted and the "
            "records re-processed from the last committed offsets"
        )
    if code in _UNKNOWN_TOPIC_CODES and topic is not None:
        return ConfigurationError(
            f"topic {topic} does not exist: create the topics with `saga topics create`"
        )
    if code in _AUTH_CODES:
        return ConfigurationError(
            f"{doing} was refused by Kafka: {err.str()}; check the security settings "
            "(security.protocol, sasl.*, ssl.*) and the ACLs"
        )
    return TransientError(f"{doing} failed: {err.str()}")


def _severity(error: SagaError) -> int:
    if isinstance(error, FatalKafkaError):
        return 2
    if isinstance(error, ConfigurationError):
        return 1
    return 0


# --------------------------------------------------------------------------- producers


class _ProducerBase:
    """What both producers share: construction, produce with back-pressure, flush, close."""

    def __init__(
        self,
        settings: KafkaSettings,
        config: dict[str, Any],
        *,
        transactional_id: str | None,
        collect_failures: bool,
    ) -> None:
        self._settings = settings
        self._transactional_id = transactional_id
        self._collect_failures = collect_failures
        self._failures: list[SagaError] = []
        # The first delivery failure of the current transaction (transactional only).
        self._txn_failure: SagaError | None = None
        self._delivered = 0
        self._fatal: ck.KafkaError | None = None
        self._closed = False
        config["error_cb"] = self._on_client_error
        try:
            self._client = ck.Producer(config)
        except (ck.KafkaException, ValueError, TypeError) as exc:
            raise ConfigurationError(f"cannot create a Kafka producer: {exc}") from exc

    def _on_client_error(self, err: ck.KafkaError) -> None:
        if err.fatal():
            self._fatal = err
        _log_client_error(err)

    def _translated(self, exc: ck.KafkaException, doing: str, topic: str | None) -> SagaError:
        err = _error_of(exc)
        if err is not None and (err.fatal() or err.code() in _FENCED_CODES):
            self._fatal = err
        elif err is not None and err.code() == _E._FATAL and self._fatal is not None:
            # After a fatal error librdkafka answers every call with a bare _FATAL;
            # the error that caused it is the useful one.
            err = self._fatal
        error = _translate(
            err, doing, text=str(exc), topic=topic, transactional_id=self._transactional_id
        )
        if isinstance(error, TransactionAborted) and self._txn_failure is not None:
            # "n message(s) failed delivery" alone does not say why; the record's error does.
            error = TransactionAborted(f"{error} (first failed record: {self._txn_failure})")
        return error

    def _delivery_handler(
        self, on_delivery: DeliveryCallback | None
    ) -> Callable[[ck.KafkaError | None, ck.Message], None]:
        def handle(err: ck.KafkaError | None, raw: ck.Message) -> None:
            message = _to_message(raw)
            error: SagaError | None = None
            if err is None:
                self._delivered += 1
            else:
                error = _translate(
                    err,
                    f"delivering a record to {message.topic}",
                    text=err.str(),
                    topic=message.topic,
                    transactional_id=self._transactional_id,
                )
            if on_delivery is not None:
                on_delivery(error, message)
            elif error is not None and self._collect_failures:
                self._failures.append(error)
            if error is not None and self._txn_failure is None and not self._collect_failures:
                self._txn_failure = error

        return handle

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
        """Queue one record; it is sent in the background.

        ``partition`` overrides the key's partition: only tools and tests that send a
        record where it does not belong need it (consumers reject such a record).
        ``timestamp_ms`` sets the record's time (default: now), for tools that write
        a history as it would have been written.

        Returns once the record is queued, not delivered. When the local queue
        is full, serves delivery reports and retries for up to 30 s. A str key
        is sent as UTF-8.

        Delivery is reported to ``on_delivery`` when given (it runs inside
        :meth:`poll`, :meth:`flush` or a later :meth:`produce`, and an exception
        it raises comes out of that call). Without it, failures are kept and
        raised by the next :meth:`flush` (plain :class:`Producer`) or surface as
        :class:`TransactionAborted` from ``commit`` (transactional producer).

        A record to a topic that does not exist is queued like any other and
        fails with a time-out after ``message.timeout.ms`` (topic
        auto-creation is off): create the topics first.

        Raises:
            TransientError: the queue stayed full (the broker is not keeping up
                or is unreachable).
            FatalKafkaError: the producer is fenced or in a fatal state.
        """
        handler = self._delivery_handler(on_delivery)
        header_list: list[tuple[str, str | bytes | None]] | None = (
            list(headers) if headers else None
        )
        deadline = time.monotonic() + _BUFFER_FULL_TIMEOUT_S
        while True:
            try:
                extra: dict[str, Any] = {}
                if partition is not None:
                    extra["partition"] = partition
                if timestamp_ms is not None:
                    extra["timestamp"] = timestamp_ms
                self._client.produce(
                    topic, value=value, key=key, headers=header_list, on_delivery=handler, **extra
                )
                break
            except BufferError:
                if time.monotonic() >= deadline:
                    raise TransientError(
                        f"the producer's queue stayed full for {_BUFFER_FULL_TIMEOUT_S:.0f}s: "
                        f"is Kafka at {self._settings.bootstrap} reachable?"
                    ) from None
                self._client.poll(0.1)
            except ck.KafkaException as exc:
                raise self._translated(exc, f"producing to {topic}", topic) from exc
        # Serve delivery reports (and logs) of earlier records without blocking.
        self._client.poll(0)

    def poll(self, timeout: float = 0.0) -> int:
        """Serve delivery reports for up to ``timeout`` seconds; returns how many ran."""
        return self._client.poll(timeout)

    def flush(self, timeout: float = 30.0) -> int:
        """Wait until every queued record is delivered; returns how many were since the last flush.

        Raises:
            TransientError: records are still undelivered after ``timeout``
                seconds, or some failed to deliver (collected failures, without
                an ``on_delivery`` callback; the most severe one is raised, with
                the count).
            FatalKafkaError: the producer is fenced or in a fatal state (also
                when a collected delivery failure was fatal).
            ConfigurationError: a collected delivery failure was refused
                authorisation.
        """
        try:
            remaining = self._client.flush(timeout)
        except ck.KafkaException as exc:
            raise self._translated(exc, "flushing the producer", None) from exc
        if remaining:
            raise TransientError(
                f"{remaining} record(s) still undelivered after {timeout:g}s: "
                f"is Kafka at {self._settings.bootstrap} reachable?"
            )
        if self._failures:
            failures, self._failures = self._failures, []
            worst = max(failures, key=_severity)
            raise type(worst)(f"{len(failures)} record(s) were not delivered; {worst}")
        delivered, self._delivered = self._delivered, 0
        return delivered

    def close(self, timeout: float = 10.0) -> None:
        """Deliver what is queued (for up to ``timeout`` seconds) and release the client.

        Records still queued after ``timeout`` are dropped with a warning; a
        transaction still open is aborted. Never raises; closing twice is a no-op.
        """
        if self._closed:
            return
        self._closed = True
        if self._fatal is None:
            try:
                remaining = self._client.flush(timeout)
                if remaining:
                    _log.warning("closing the producer drops %d undelivered record(s)", remaining)
                    self._client.purge()
            except ck.KafkaException as exc:
                _log.warning("closing the producer: %s", exc)
        # confluent-kafka reports a failed abort of the open transaction (always
        # the case for a fenced producer) as a RuntimeWarning; it is expected here.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                self._client.close()
            except (ck.KafkaException, RuntimeError) as exc:
                _log.warning("closing the producer: %s", exc)
        for warning in caught:
            _log.info("closing the producer: %s", warning.message)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


Compression = Literal["lz4", "zstd", "gzip", "snappy", "none"]


class Producer(_ProducerBase):
    """An idempotent producer (``acks=all``, ``enable.idempotence=true``).

    Records with the same key keep their order and are written once even when
    librdkafka retries. Delivery failures are raised by the next :meth:`flush`
    unless :meth:`produce` got an ``on_delivery`` callback.
    """

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        client_id: str = "saga",
        compression: Compression = "lz4",
        linger_ms: int = 5,
    ) -> None:
        config = _client_config(
            settings,
            client_id=client_id,
            compression_type=compression,
            linger_ms=linger_ms,
            partitioner="murmur2_random",
            acks="all",
            enable_idempotence=True,
        )
        super().__init__(settings, config, transactional_id=None, collect_failures=True)


class TransactionalProducer(_ProducerBase):
    """A producer that writes records and consumer offsets atomically (DESIGN §5).

    Use::

        producer.init()                      # once; fences older instances
        producer.begin()
        producer.produce(...)                # any number
        producer.send_offsets(consumer, {("saga.events", 3): last_offset + 1})
        producer.commit()

    ``transactional.id`` must be stable for the role and partition set of the
    process: a restarted instance with the same id fences the old one (which
    then gets :class:`~streams._errors.FatalKafkaError` on its next call) and
    aborts its open transaction.

    Error contract of :meth:`init`, :meth:`send_offsets`, :meth:`commit` and
    :meth:`abort`: errors librdkafka calls retriable are retried a few times
    with a short backoff, then raised as :class:`~streams._errors.TransientError`;
    ``txn_requires_abort`` raises :class:`TransactionAborted`; fencing and fatal
    errors raise :class:`~streams._errors.FatalKafkaError`; anything else
    raises :class:`~streams._errors.TransientError`.
    """

    def __init__(
        self,
        settings: KafkaSettings,
        transactional_id: str,
        *,
        client_id: str = "saga",
        compression: Compression = "lz4",
        linger_ms: int = 5,
        transaction_timeout_ms: int = 60_000,
        on_wedged: Callable[[str], None] | None = None,
    ) -> None:
        if not transactional_id:
            raise ConfigurationError("a transactional producer needs a transactional.id")
        config = _client_config(
            settings,
            client_id=client_id,
            compression_type=compression,
            linger_ms=linger_ms,
            partitioner="murmur2_random",
            acks="all",
            enable_idempotence=True,
            transactional_id=transactional_id,
            transaction_timeout_ms=transaction_timeout_ms,
        )
        super().__init__(
            settings, config, transactional_id=transactional_id, collect_failures=False
        )
        # (what, monotonic deadline) while a transactional call runs: see _watch.
        self._busy: tuple[str, float] | None = None
        self._on_wedged = on_wedged
        threading.Thread(target=self._watch, name="saga-txn-watchdog", daemon=True).start()

    def _watch(self) -> None:
        """Report a transactional call that outlives its timeout by far to ``on_wedged``.

        librdkafka does not always honour the timeout of its transactional calls:
        after a broker restart ``send_offsets_to_transaction`` can block for good
        (librdkafka issues #5456 and #5511; found by the chaos suite). The call
        cannot be interrupted and the client cannot be used again. This thread only
        reports it (once); the process decides: the command line exits with status
        1, as on a fatal error, and the restarted instance fences this one's
        ``transactional.id`` and aborts its open transaction.
        """
        while not self._closed:
            busy = self._busy
            if busy is not None and time.monotonic() > busy[1]:
                message = (
                    f"{busy[0]} has not returned {_WEDGED_AFTER_S:.0f}s after its timeout: "
                    "the Kafka client is wedged (librdkafka issue #5456)"
                )
                _log.critical("%s", message)
                if self._on_wedged is not None:
                    self._on_wedged(message)
                return
            time.sleep(1.0)

    @property
    def transactional_id(self) -> str:
        """The id that identifies this producer across restarts (and fences older instances)."""
        assert self._transactional_id is not None
        return self._transactional_id

    def _call(self, doing: str, operation: Callable[[float], _T], timeout: float) -> _T:
        """Run ``operation(remaining seconds)``, retrying retriable errors within ``timeout``."""
        deadline = time.monotonic() + timeout
        self._busy = (doing, deadline + _WEDGED_AFTER_S)
        try:
            return self._attempts(doing, operation, timeout, deadline)
        finally:
            self._busy = None

    def _attempts(
        self, doing: str, operation: Callable[[float], _T], timeout: float, deadline: float
    ) -> _T:
        attempt = 1
        while True:
            remaining = max(deadline - time.monotonic(), 0.1)
            try:
                return operation(remaining)
            except ck.KafkaException as exc:
                err = _error_of(exc)
                retry = (
                    err is not None
                    and err.retriable()
                    and not err.fatal()
                    and not err.txn_requires_abort()
                    and err.code() not in _FENCED_CODES
                )
                if not retry:
                    raise self._translated(exc, doing, None) from exc
                if attempt >= _TXN_ATTEMPTS or time.monotonic() >= deadline:
                    raise TransientError(
                        f"{doing} did not succeed within {timeout:g}s ({attempt} attempts): "
                        f"{err.str() if err else exc}; "
                        f"is Kafka at {self._settings.bootstrap} reachable?"
                    ) from exc
                _log.info("%s: %s; retrying (attempt %d)", doing, exc, attempt)
                time.sleep(min(0.1 * 2 ** (attempt - 1), 1.0, max(deadline - time.monotonic(), 0)))
                attempt += 1

    def init(self, timeout: float = 30.0) -> None:
        """Register the ``transactional.id``: fences older instances, aborts their open transaction.

        Call once, before anything else.
        """
        self._call("initialising Kafka transactions", self._client.init_transactions, timeout)

    def begin(self) -> None:
        """Start a transaction; every record produced until commit/abort belongs to it."""
        self._txn_failure = None
        self._call("beginning a Kafka transaction", lambda _: self._client.begin_transaction(), 5.0)

    def send_offsets(
        self,
        consumer: Any,
        offsets: Mapping[Partition, int],
        timeout: float = 30.0,
    ) -> None:
        """Make committing ``offsets`` for ``consumer``'s group part of this transaction.

        Each offset is the **next offset to read**: the offset of the last
        record processed on that partition + 1 (:attr:`Message.next_offset`),
        not the offset of the last record. The offsets are committed if and
        only if the transaction commits. The consumer's current group metadata
        goes with them, so the broker refuses offsets from a consumer that was
        left behind by a rebalance (a zombie); the transaction must then be
        aborted. The broker checks the group generation, not which partitions
        the consumer owns: leave out partitions it no longer owns. An empty
        mapping does nothing.

        Raises:
            ValueError: a negative offset (librdkafka would ignore it silently).
        """
        if not offsets:
            return
        for partition, offset in offsets.items():
            if offset < 0:
                raise ValueError(f"offset {offset} for {partition} is not a position")
        if not isinstance(consumer, Consumer):
            raise TypeError("send_offsets needs the Kafka Consumer whose group the offsets are for")
        positions = _tps_at(offsets)
        try:
            metadata = consumer._client.consumer_group_metadata()
        except ck.KafkaException as exc:
            raise self._translated(exc, "reading the consumer group metadata", None) from exc
        self._call(
            "sending offsets to the Kafka transaction",
            lambda left: self._client.send_offsets_to_transaction(positions, metadata, left),
            timeout,
        )

    def commit(self, timeout: float = 30.0) -> None:
        """Deliver the transaction's records and commit it (records and offsets at once)."""
        self._call("committing the Kafka transaction", self._client.commit_transaction, timeout)

    def abort(self, timeout: float = 30.0) -> None:
        """Abort the transaction: its records stay invisible to ``read_committed`` readers.

        Records still queued locally are dropped without being sent; those
        already on the broker are marked aborted. Offsets sent with
        :meth:`send_offsets` are not committed. Call :meth:`begin` next.
        """
        self._call("aborting the Kafka transaction", self._client.abort_transaction, timeout)


# --------------------------------------------------------------------------- consumer


class Consumer:
    """A consumer with auto-commit off: offsets are committed only when asked.

    With a ``group_id`` it joins that group through :meth:`subscribe`; without
    one it is a plain reader for :meth:`assign` (it gets a throw-away group id
    and cannot commit). ``read_committed`` (the default) hides records of
    aborted and still-open transactions. The rebalance callbacks receive
    ``(topic, partition)`` lists and run inside :meth:`poll_batch`; with the
    default cooperative-sticky strategy they receive only the partitions that
    change. ``on_lost`` defaults to ``on_revoke``.
    """

    def __init__(
        self,
        settings: KafkaSettings,
        group_id: str | None = None,
        *,
        isolation_level: Literal["read_committed", "read_uncommitted"] = "read_committed",
        assignment_strategy: str = "cooperative-sticky",
        auto_offset_reset: Literal["earliest", "latest", "error"] = "earliest",
        on_assign: RebalanceCallback | None = None,
        on_revoke: RebalanceCallback | None = None,
        on_lost: RebalanceCallback | None = None,
        client_id: str = "saga",
        session_timeout_ms: int | None = None,
        max_poll_interval_ms: int | None = None,
    ) -> None:
        self._settings = settings
        self._has_group = group_id is not None
        self._on_assign = on_assign
        self._on_revoke = on_revoke
        self._on_lost = on_lost
        self._closed = False
        options: dict[str, Any] = {}
        if session_timeout_ms is not None:
            options["session.timeout.ms"] = session_timeout_ms
        if max_poll_interval_ms is not None:
            options["max.poll.interval.ms"] = max_poll_interval_ms
        config = _client_config(
            settings,
            client_id=client_id,
            group_id=group_id or f"{settings.prefix}.reader.{uuid.uuid4().hex}",
            enable_auto_commit=False,
            auto_offset_reset=auto_offset_reset,
            isolation_level=isolation_level,
            partition_assignment_strategy=assignment_strategy,
        )
        config.update(options)
        config["error_cb"] = _log_client_error
        try:
            self._client = ck.Consumer(config)
        except (ck.KafkaException, ValueError, TypeError) as exc:
            raise ConfigurationError(f"cannot create a Kafka consumer: {exc}") from exc

    # -- group membership

    def subscribe(self, topics: Sequence[str]) -> None:
        """Join the group for ``topics``; partitions arrive through :meth:`poll_batch`."""
        if not self._has_group:
            raise ConfigurationError("a consumer without a group_id cannot subscribe: use assign()")

        def relay(
            callback: RebalanceCallback,
        ) -> Callable[[ck.Consumer, list[ck.TopicPartition]], None]:
            def handler(_client: ck.Consumer, partitions: list[ck.TopicPartition]) -> None:
                callback([(tp.topic, tp.partition) for tp in partitions])

            return handler

        # confluent-kafka rejects None for these; pass only those given. After each
        # callback returns, the client performs the (incremental) assignment itself.
        callbacks: dict[str, Callable[[ck.Consumer, list[ck.TopicPartition]], None]] = {
            name: relay(callback)
            for name, callback in (
                ("on_assign", self._on_assign),
                ("on_revoke", self._on_revoke),
                ("on_lost", self._on_lost),
            )
            if callback is not None
        }
        self._guard("subscribing", lambda: self._client.subscribe(list(topics), **callbacks))

    def assign(
        self,
        partitions_with_offsets: Mapping[Partition, int] | Iterable[tuple[str, int, int]],
    ) -> None:
        """Read exactly these partitions, without a group, from the given offsets.

        Takes ``{(topic, partition): offset}`` or ``[(topic, partition, offset), ...]``.
        Each offset is the next offset to read, or :data:`OFFSET_BEGINNING` /
        :data:`OFFSET_END`. Replaces any previous assignment.
        """
        if isinstance(partitions_with_offsets, Mapping):
            starts = _tps_at(partitions_with_offsets)
        else:
            starts = [ck.TopicPartition(t, p, o) for t, p, o in partitions_with_offsets]
        self._guard("assigning partitions", lambda: self._client.assign(starts))

    # -- reading

    def poll_batch(self, max_messages: int = 500, timeout: float = 1.0) -> list[Message]:
        """Up to ``max_messages`` records, waiting at most ``timeout`` seconds; may be empty.

        Natural batching: it returns what has arrived as soon as there is
        anything, and waits (up to ``timeout``) only while nothing has. So a
        busy process gets large batches (what arrived while it worked on the
        last one) and an idle one handles a record without delay. (librdkafka's
        batch consume alone waits for ``max_messages`` or the whole timeout.)

        Rebalance callbacks run inside this call. Partition-end events are
        skipped; other per-partition errors are logged (librdkafka keeps
        retrying those partitions by itself).

        Raises:
            ConfigurationError: a subscribed or assigned topic does not exist.
            FatalKafkaError: the consumer hit a fatal error.
            TransientError: the client failed as a whole.
        """
        try:
            raw = self._client.consume(max_messages, 0)
            if not raw and timeout > 0:
                raw = self._client.consume(1, timeout)
                if raw and max_messages > 1:
                    raw += self._client.consume(max_messages - 1, 0)
        except ck.KafkaException as exc:
            raise _translate(_error_of(exc), "consuming", text=str(exc)) from exc
        messages: list[Message] = []
        for item in raw:
            err = item.error()
            if err is None:
                messages.append(_to_message(item))
                continue
            code = err.code()
            if code == _E._PARTITION_EOF:
                continue
            topic = item.topic()
            if code in _UNKNOWN_TOPIC_CODES and topic and not self._topic_exists(topic):
                raise ConfigurationError(
                    f"topic {topic} does not exist: create the topics with `saga topics create`"
                )
            if err.fatal():
                raise FatalKafkaError(f"the Kafka consumer hit a fatal error: {err.str()}; exiting")
            _log.warning(
                "Kafka consumer: %s (topic %s, partition %s); retrying",
                err.str(),
                topic,
                item.partition(),
            )
        return messages

    def _topic_exists(self, topic: str) -> bool:
        # An unknown-topic event can precede metadata propagation of a topic
        # created a moment ago; ask the broker before calling it missing.
        try:
            _partition_count(self._client.list_topics(topic, timeout=5.0), topic)
        except ConfigurationError:
            return False
        except ck.KafkaException:
            return True
        return True

    # -- offsets

    def commit(self, offsets: Mapping[Partition, int]) -> None:
        """Commit ``offsets`` for the group synchronously; an empty mapping does nothing.

        Each offset is the **next offset to read** (last processed + 1).

        Raises:
            TransientError: the commit failed, e.g. because the group is
                rebalancing and these partitions may have moved; the records
                since the last successful commit will be delivered again.
        """
        if not offsets:
            return
        if not self._has_group:
            raise ConfigurationError("a consumer without a group_id cannot commit offsets")
        result = self._guard(
            "committing offsets",
            lambda: self._client.commit(offsets=_tps_at(offsets), asynchronous=False),
        )
        for tp in result:
            if tp.error is not None:
                raise _translate(
                    tp.error,
                    f"committing offset {tp.offset} of {tp.topic} [{tp.partition}]",
                    text=tp.error.str(),
                )

    def committed(
        self, partitions: Iterable[Partition], timeout: float = 10.0
    ) -> dict[Partition, int | None]:
        """The group's committed offsets (next offset to read); ``None`` if none is committed."""
        result = self._guard(
            "reading committed offsets",
            lambda: self._client.committed(_tps(partitions), timeout=timeout),
        )
        return {(tp.topic, tp.partition): _offset_or_none(tp.offset) for tp in result}

    def position(self, partitions: Iterable[Partition]) -> dict[Partition, int | None]:
        """Per partition, the offset of the next record to be returned (``None``: unknown)."""
        result = self._guard("reading positions", lambda: self._client.position(_tps(partitions)))
        return {(tp.topic, tp.partition): _offset_or_none(tp.offset) for tp in result}

    def seek(self, topic: str, partition: int, offset: int) -> None:
        """Make the next record read from an assigned partition the one at ``offset``."""
        self._guard(
            f"seeking {topic} [{partition}] to {offset}",
            lambda: self._client.seek(ck.TopicPartition(topic, partition, offset)),
        )

    # -- flow control and metadata

    def pause(self, partitions: Iterable[Partition]) -> None:
        """Stop fetching these partitions (they stay assigned) until :meth:`resume`."""
        self._guard("pausing partitions", lambda: self._client.pause(_tps(partitions)))

    def resume(self, partitions: Iterable[Partition]) -> None:
        """Fetch paused partitions again, from where they stopped."""
        self._guard("resuming partitions", lambda: self._client.resume(_tps(partitions)))

    def pause_all(self) -> list[Partition]:
        """Pause every partition assigned now; returns them.

        Partitions assigned later (by a rebalance) are not paused: keep
        polling to stay in the group and hold back what they deliver.
        """
        assigned = self.assignment()
        if assigned:
            self.pause(assigned)
        return assigned

    def resume_all(self) -> None:
        """Resume every partition assigned now (resuming one not paused is harmless)."""
        assigned = self.assignment()
        if assigned:
            self.resume(assigned)

    def assignment(self) -> list[Partition]:
        """The partitions currently assigned to this consumer."""
        result = self._guard("reading the assignment", self._client.assignment)
        return [(tp.topic, tp.partition) for tp in result]

    def watermarks(self, topic: str, partition: int, timeout: float = 10.0) -> tuple[int, int]:
        """``(low, high)``: the oldest offset still stored, and the offset of the next record."""
        tp = ck.TopicPartition(topic, partition)
        deadline = time.monotonic() + timeout
        while True:
            try:
                marks = self._guard(
                    f"reading the offsets of {topic} [{partition}]",
                    lambda: self._client.get_watermark_offsets(tp, timeout=timeout),
                    topic=topic,
                )
                break
            except TransientError:
                # A partition created a moment ago may still answer "not leader".
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)
        if marks is None:
            raise TransientError(
                f"Kafka at {self._settings.bootstrap} did not report the offsets of "
                f"{topic} [{partition}] within {timeout:g}s"
            )
        low, high = marks
        return low, high

    def list_partitions(self, topic: str, timeout: float = 10.0) -> int:
        """The number of partitions of ``topic``.

        Raises:
            ConfigurationError: the topic does not exist.
        """
        metadata = self._guard(
            f"describing topic {topic}",
            lambda: self._client.list_topics(topic, timeout=timeout),
            topic=topic,
        )
        return _partition_count(metadata, topic)

    def close(self) -> None:
        """Leave the group (revoking partitions) and release the client; closing twice is a no-op.

        Commits nothing: commit what was processed before closing.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._client.close()
        except (ck.KafkaException, RuntimeError) as exc:
            _log.warning("closing the consumer: %s", exc)

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _guard(self, doing: str, operation: Callable[[], _T], *, topic: str | None = None) -> _T:
        try:
            return operation()
        except ck.KafkaException as exc:
            raise _translate(_error_of(exc), doing, text=str(exc), topic=topic) from exc


def _log_client_error(err: ck.KafkaError) -> None:
    # librdkafka logs these errors itself (through saga.kafka.librdkafka) at the
    # level it finds right; repeating them louder here would double the noise.
    if err.fatal():
        _log.error("Kafka client: fatal error: %s", err.str())
    else:
        _log.debug("Kafka client: %s", err.str())


def _partition_count(metadata: Any, topic: str) -> int:
    described = metadata.topics.get(topic)
    if described is None or (
        described.error is not None and described.error.code() in _UNKNOWN_TOPIC_CODES
    ):
        raise ConfigurationError(
            f"topic {topic} does not exist: create the topics with `saga topics create`"
        )
    if described.error is not None:
        raise TransientError(f"describing topic {topic} failed: {described.error.str()}")
    return len(described.partitions)


# --------------------------------------------------------------------------- admin


def _admin(settings: KafkaSettings, *, quiet: bool = False) -> AdminClient:
    config = _client_config(settings)
    config["error_cb"] = (lambda err: None) if quiet else _log_client_error
    if quiet:
        # Connection-refused lines every retry are noise while waiting for a broker.
        config["log_level"] = 2
    try:
        return AdminClient(config)
    except (ck.KafkaException, ValueError, TypeError) as exc:
        raise ConfigurationError(f"cannot create a Kafka admin client: {exc}") from exc


def _topic_config(
    name: str,
    topics: Topics,
    replication_factor: int,
    retention_ms: int,
    status_segment_bytes: int,
) -> dict[str, str]:
    config: dict[str, str] = {}
    if replication_factor >= 3:
        # acks=all then survives one broker down without losing acknowledged writes.
        config["min.insync.replicas"] = "2"
    if name in topics.compacted:
        config.update(
            {
                # Compacted: the latest state of each transaction. And deleted by time:
                # a record older than twice the retention goes with its segment, whether
                # or not the cleaner ran, so restores and new clients read the sagas of
                # the last retention period, never all history. The coordinator forgets
                # finished sagas at the retention (a tombstone) and publishes the status of
                # each saga it keeps again every half retention, so nothing it keeps is
                # ever deleted.
                "cleanup.policy": "compact,delete",
                "retention.ms": str(2 * retention_ms),
                # Keep recent updates uncompacted briefly so readers catching up
                # see the sequence; old ones collapse to the latest state.
                "min.compaction.lag.ms": "60000",
                # A restore reads at most one segment per partition beyond the live set.
                "segment.ms": str(min(600_000, retention_ms)),
                "segment.bytes": str(status_segment_bytes),
                # A tombstone stays an hour after compaction: long enough for a reader
                # that was catching up to see it, short enough not to pile up.
                "delete.retention.ms": "3600000",
            }
        )
    return config


def _existing_counts(admin: AdminClient, names: Iterable[str], timeout: float) -> dict[str, int]:
    try:
        metadata = admin.list_topics(timeout=timeout)
    except ck.KafkaException as exc:
        raise _translate(_error_of(exc), "listing the Kafka topics", text=str(exc)) from exc
    counts: dict[str, int] = {}
    for name in names:
        described = metadata.topics.get(name)
        if described is not None and described.error is None:
            counts[name] = len(described.partitions)
    return counts


def _all_led(admin: AdminClient, names: Iterable[str], timeout: float) -> bool:
    try:
        metadata = admin.list_topics(timeout=timeout)
    except ck.KafkaException as exc:
        raise _translate(_error_of(exc), "listing the Kafka topics", text=str(exc)) from exc
    for name in names:
        described = metadata.topics.get(name)
        if described is None or described.error is not None:
            return False
        if any(p.leader < 0 or p.error is not None for p in described.partitions.values()):
            return False
    return True


def _check_count(name: str, actual: int, wanted: int) -> None:
    if actual != wanted:
        raise ConfigurationError(
            f"topic {name} already exists with {actual} partition(s), not {wanted}: every "
            "saga topic must have the same partition count; use --partitions "
            f"{actual} or delete the topics first"
        )


def _check_compacted(admin: AdminClient, names: Sequence[str], timeout: float) -> None:
    if not names:
        return
    resources = [ConfigResource("TOPIC", name) for name in names]
    futures = admin.describe_configs(resources, request_timeout=timeout)
    for resource, future in futures.items():
        try:
            entries = future.result()
        except ck.KafkaException as exc:
            raise _translate(
                _error_of(exc), f"describing topic {resource.name}", text=str(exc)
            ) from exc
        policy = entries.get("cleanup.policy")
        value = policy.value if policy is not None else None
        if value is None or "compact" not in value:
            raise ConfigurationError(
                f"topic {resource.name} exists but is not compacted (cleanup.policy={value}): "
                "it keeps the latest state of each transaction; set cleanup.policy=compact "
                "on it or delete it and run `saga topics create` again"
            )


def create_topics(
    settings: KafkaSettings,
    partitions: int,
    replication_factor: int = 1,
    timeout: float = 30.0,
    *,
    retention_ms: int = DEFAULT_RETENTION_MS,
    status_segment_bytes: int = 16 * 1024 * 1024,
) -> list[str]:
    """Create the five saga topics, all with ``partitions`` partitions; returns those created.

    Idempotent: topics that already exist with the same partition count are
    left alone (an existing status topic must be compacted). The status topic
    is created with ``cleanup.policy=compact,delete`` and ``retention.ms`` twice
    ``retention_ms`` (the coordinator's retention), in segments of at most
    ``status_segment_bytes``. Returns once the broker's metadata shows every topic.

    Raises:
        ConfigurationError: ``partitions < 1``, an existing topic has another
            partition count, the status topic exists uncompacted, or the broker
            rejects the request (for example a replication factor above the
            number of brokers).
        TransientError: the broker does not answer in time.
    """
    if partitions < 1:
        raise ConfigurationError(f"the partition count must be at least 1, not {partitions}")
    if replication_factor < 1:
        raise ConfigurationError(
            f"the replication factor must be at least 1, not {replication_factor}"
        )
    topics = settings.topics
    admin = _admin(settings)
    existing = _existing_counts(admin, topics.all, timeout)
    for name, count in existing.items():
        _check_count(name, count, partitions)
    _check_compacted(admin, [n for n in topics.compacted if n in existing], timeout)

    missing = [name for name in topics.all if name not in existing]
    created: list[str] = []
    if missing:
        new_topics = [
            NewTopic(
                name,
                num_partitions=partitions,
                replication_factor=replication_factor,
                config=_topic_config(
                    name, topics, replication_factor, retention_ms, status_segment_bytes
                ),
            )
            for name in missing
        ]
        futures = admin.create_topics(
            new_topics, operation_timeout=timeout, request_timeout=timeout
        )
        for name, future in futures.items():
            try:
                future.result()
            except ck.KafkaException as exc:
                err = _error_of(exc)
                if err is not None and err.code() == _E.TOPIC_ALREADY_EXISTS:
                    continue  # created concurrently by someone else; checked below
                if err is not None and not err.retriable():
                    raise ConfigurationError(
                        f"Kafka refused to create topic {name} ({partitions} partitions, "
                        f"replication factor {replication_factor}): {err.str()}"
                    ) from exc
                raise _translate(err, f"creating topic {name}", text=str(exc)) from exc
            created.append(name)

    _await_topics(admin, topics.all, partitions, timeout)
    raced = [name for name in missing if name not in created]
    _check_compacted(admin, [n for n in topics.compacted if n in raced], timeout)
    return [name for name in topics.all if name in created]


def _await_topics(
    admin: AdminClient, names: Sequence[str], partitions: int, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        counts = _existing_counts(admin, names, timeout)
        for name, count in counts.items():
            _check_count(name, count, partitions)
        # Ready means every partition has a leader: right after creation a
        # partition may still answer "not leader" to offset look-ups.
        if len(counts) == len(names) and _all_led(admin, names, timeout):
            return
        if time.monotonic() >= deadline:
            absent = ", ".join(n for n in names if n not in counts)
            raise TransientError(f"topics {absent} did not appear within {timeout:g}s")
        time.sleep(0.1)


def delete_topics(
    settings: KafkaSettings, names: Iterable[str], timeout: float = 30.0
) -> list[str]:
    """Delete ``names``; topics that do not exist are skipped. Returns those deleted.

    Deletion completes asynchronously on the broker: a topic of the same name
    may not be creatable for a moment afterwards.
    """
    wanted = list(names)
    if not wanted:
        return []
    admin = _admin(settings)
    futures = admin.delete_topics(wanted, operation_timeout=timeout, request_timeout=timeout)
    deleted: list[str] = []
    for name, future in futures.items():
        try:
            future.result()
        except ck.KafkaException as exc:
            err = _error_of(exc)
            if err is not None and err.code() in _UNKNOWN_TOPIC_CODES:
                continue
            raise _translate(err, f"deleting topic {name}", text=str(exc)) from exc
        deleted.append(name)
    return deleted


def describe_partitions(settings: KafkaSettings, topic: str, timeout: float = 10.0) -> int:
    """The number of partitions of ``topic``.

    Raises:
        ConfigurationError: the topic does not exist.
        TransientError: the broker does not answer in time.
    """
    admin = _admin(settings)
    try:
        metadata = admin.list_topics(topic, timeout=timeout)
    except ck.KafkaException as exc:
        raise _translate(
            _error_of(exc), f"describing topic {topic}", text=str(exc), topic=topic
        ) from exc
    return _partition_count(metadata, topic)


def topic_config(settings: KafkaSettings, topic: str, timeout: float = 10.0) -> dict[str, str]:
    """The effective configuration of ``topic`` (``cleanup.policy``, ``retention.ms``, ...).

    Raises:
        ConfigurationError: the topic does not exist.
        TransientError: the broker does not answer in time.
    """
    admin = _admin(settings)
    futures = admin.describe_configs([ConfigResource("TOPIC", topic)], request_timeout=timeout)
    config: dict[str, str] = {}
    for future in futures.values():
        try:
            entries = future.result()
        except ck.KafkaException as exc:
            raise _translate(
                _error_of(exc), f"describing topic {topic}", text=str(exc), topic=topic
            ) from exc
        config.update(
            {name: entry.value for name, entry in entries.items() if entry.value is not None}
        )
    return config


def wait_for_broker(settings: KafkaSettings, timeout: float = 30.0) -> None:
    """Return once Kafka answers a metadata request; try for up to ``timeout`` seconds.

    Raises:
        TransientError: no answer in time.
        ConfigurationError: the broker answered but refused the credentials.
    """
    admin = _admin(settings, quiet=True)
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransientError(
                f"Kafka at {settings.bootstrap} does not answer after {timeout:g}s ({last}): "
                "is it running? (`make infra-status`)"
            )
        try:
            admin.list_topics(timeout=max(0.5, min(remaining, 2.0)))
            return
        except ck.KafkaException as exc:
            err = _error_of(exc)
            if err is not None and err.code() in _AUTH_CODES:
                raise _translate(
                    err, f"connecting to Kafka at {settings.bootstrap}", text=str(exc)
                ) from exc
            last = err.str() if err is not None else str(exc)
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def partition_for(key: str | bytes, partitions: int) -> int:
    """The partition a record with ``key`` goes to among ``partitions`` (Java-compatible murmur2).

    The same number for every saga topic (they share the partition count), for
    the producers of this module and for JVM clients with the default partitioner.
    """
    if partitions < 1:
        raise ValueError(f"a topic has at least one partition, not {partitions}")
    return ck.murmur2(key.encode() if isinstance(key, str) else key, partitions)


# --------------------------------------------------------------------------- dead letters


def send_to_dlq(
    producer: LogProducer,
    topics: Topics,
    message: Message,
    reason: str,
    *,
    component: str,
    at_ms: int | None = None,
) -> None:
    """Queue ``message``'s original key and value bytes on the dead-letter topic.

    Headers (UTF-8 strings): ``saga.error`` (``reason``), ``saga.source.topic``,
    ``saga.source.partition``, ``saga.source.offset``, ``saga.component`` and
    ``saga.rejected.at_ms`` (``at_ms``, default now). Through a
    :class:`TransactionalProducer` inside a transaction, the dead letter is
    written atomically with the offsets that skip the record. Like
    :meth:`Producer.produce` this only queues: flush or commit to be sure.

    A record larger than :data:`~streams._limits.MAX_RECORD_BYTES` (key and value
    together) could exceed what the producer or the broker accepts once headers are
    added, so it is not copied whole: the dead letter holds the first
    :data:`~streams._limits.DLQ_EXCERPT_BYTES` bytes of the key and of the value, and
    the headers ``saga.truncated`` (``1``), ``saga.source.key.length``,
    ``saga.source.value.length`` and ``saga.source.sha256`` (hex digest of the value)
    describe the original.
    """
    stamp = at_ms if at_ms is not None else int(time.time() * 1000)
    headers = [
        ("saga.error", reason.encode()),
        ("saga.source.topic", message.topic.encode()),
        ("saga.source.partition", str(message.partition).encode()),
        ("saga.source.offset", str(message.offset).encode()),
        ("saga.component", component.encode()),
        ("saga.rejected.at_ms", str(stamp).encode()),
    ]
    key, value = message.key, message.value
    size = len(key or b"") + len(value or b"")
    if size > MAX_RECORD_BYTES:
        headers += [
            ("saga.truncated", b"1"),
            ("saga.source.key.length", str(len(key or b"")).encode()),
            ("saga.source.value.length", str(len(value or b"")).encode()),
            ("saga.source.sha256", hashlib.sha256(value or b"").hexdigest().encode()),
        ]
        key = key[:DLQ_EXCERPT_BYTES] if key is not None else None
        value = value[:DLQ_EXCERPT_BYTES] if value is not None else None
    producer.produce(topics.dlq, key, value, headers=headers)
