"""Topics: create the saga topics (idempotently), delete, describe; wait for the broker."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import confluent_kafka as ck
from confluent_kafka.admin import AdminClient

# The defining modules: confluent_kafka.admin re-exports these without marking
# them as exported, which strict type checking rejects.
from confluent_kafka.admin._config import ConfigResource
from confluent_kafka.cimpl import NewTopic

from saga.streams._duration import DEFAULT_RETENTION_MS
from saga.streams._errors import ConfigurationError, TransientError
from saga.streams._topics import Topics
from saga.streams.kafka._settings import KafkaSettings, _client_config
from saga.streams.kafka._translate import (
    _AUTH_CODES,
    _E,
    _UNKNOWN_TOPIC_CODES,
    _error_of,
    _log_client_error,
    _partition_count,
    _translate,
)


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
        # The participant registry shares the status topic's settings: the latest
        # announcement of each process, and a process silent for twice the retention
        # (whose heartbeats stopped long ago) leaves the topic.
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
    """Create the six saga topics, all with ``partitions`` partitions; returns those created.

    Idempotent: topics that already exist with the same partition count are
    left alone (an existing status or participants topic must be compacted). Both
    are created with ``cleanup.policy=compact,delete`` and ``retention.ms`` twice
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
