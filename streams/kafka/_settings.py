"""Kafka settings: how to reach the broker, which topics, and the librdkafka configuration.

:class:`KafkaSettings` is built once at start-up (from arguments, a config file
and the environment); :func:`_client_config` turns it into the configuration of
each confluent-kafka client, with saga's fixed values last so nothing overrides them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from saga.streams._errors import ConfigurationError
from saga.streams._repeats import RepeatFilter, RoutineRetryFilter
from saga.streams._topics import Topics

# librdkafka's own log lines (connection failures, retries, ...) go here; a line it
# repeats (a refused connection, every reconnect backoff) shows once per 10 s.
_librdkafka_log = logging.getLogger("saga.kafka.librdkafka")
_librdkafka_log.addFilter(RoutineRetryFilter())
_librdkafka_log.addFilter(RepeatFilter())

_ENV_PREFIX: Final = "SAGA_KAFKA_"
_ENV_BOOTSTRAP: Final = "SAGA_KAFKA_BOOTSTRAP"
_ENV_TOPIC_PREFIX: Final = "SAGA_TOPIC_PREFIX"

# Settings saga decides itself; letting a config file change them would break the
# guarantees of docs/architecture.md §5 (or, for bootstrap.servers, contradict --bootstrap).
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


@dataclass(frozen=True)
class KafkaSettings:
    """How to reach Kafka and which topics to use; built once at start-up.

    ``extra`` holds librdkafka settings passed to every client this package
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


FAILOVER_DEFAULTS: Final = MappingProxyType(
    {
        # librdkafka waits up to 10 s (its default) before reconnecting to a broker it lost:
        # a broker back from a restart in seconds sat unused that long.
        "reconnect.backoff.max.ms": 1000,
        # A paused (or unreachable but not refusing) broker held a new connection for 30 s.
        "socket.connection.setup.timeout.ms": 5000,
        # Leader and coordinator moves are learnt from errors at once; this also catches
        # those no request failed on (a paused leader), every 10 s instead of every 5 min.
        "topic.metadata.refresh.interval.ms": 10_000,
    }
)
"""Client settings for riding through broker failovers (README, Running on a cluster);
every one of them can be set otherwise in the user's extra settings."""

CONSUMER_SOCKET_TIMEOUT_MS: Final = 10_000
"""A consumer's request timeout (librdkafka's 60 s default): a fetch to a paused leader
held its partitions that long after the controller had moved them to a live broker. A
transactional producer's is already below its transaction timeout (librdkafka adjusts it)."""


TXN_RETRY_BACKOFF_MS: Final = 10
"""A transactional producer's ``retry.backoff.ms`` (librdkafka's default: 100 ms).

A transaction begun right after the previous one committed is refused with
CONCURRENT_TRANSACTIONS until the broker has written that one's markers (a few ms);
librdkafka retries ``send_offsets_to_transaction`` after ``retry.backoff.ms``, so each
such batch of the coordinator waited 100 ms or more. The backoff still doubles on
each retry, up to ``retry.backoff.max.ms`` (1 s)."""


def _client_config(settings: KafkaSettings, **fixed: Any) -> dict[str, Any]:
    """The librdkafka configuration: address, the user's extras, then saga's fixed values."""
    config: dict[str, Any] = {
        "bootstrap.servers": settings.bootstrap,
        "logger": _librdkafka_log,
        # Brokers close idle connections routinely; that is not worth a log line.
        "log.connection.close": False,
        **FAILOVER_DEFAULTS,
    }
    config.update(settings.extra)
    config.update({key.replace("_", "."): value for key, value in fixed.items()})
    return config


# Group membership: librdkafka's session timeout (45 s) is how long the partitions of a
# process that died sit idle. 6 s is the broker's smallest (group.min.session.timeout.ms);
# a restarted static member takes its partitions back without waiting for it at all.
GROUP_SESSION_TIMEOUT_MS: Final = 6000
_MAX_HEARTBEAT_MS: Final = 3000  # librdkafka's default heartbeat.interval.ms
_INSTANCE_ID_CHARS: Final = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-"
)
_MAX_INSTANCE_ID: Final = 249  # Kafka's limit, as for topic names


def _group_timeouts(extra: Mapping[str, str], session_timeout_ms: int | None) -> dict[str, Any]:
    """The session and heartbeat settings of a group consumer, where nobody set them.

    ``session.timeout.ms`` defaults to :data:`GROUP_SESSION_TIMEOUT_MS` unless the
    caller (``session_timeout_ms``) or the user's extra settings set it;
    ``heartbeat.interval.ms`` to a sixth of the session timeout (at most 3 s, at
    least 100 ms) unless the user set it: a member learns of a rebalance at its
    next heartbeat, and the broker drops one that missed the whole session.
    """
    out: dict[str, Any] = {}
    session: Any = session_timeout_ms
    if session is None:
        session = extra.get("session.timeout.ms", GROUP_SESSION_TIMEOUT_MS)
        if "session.timeout.ms" not in extra:
            out["session.timeout.ms"] = session
    if "heartbeat.interval.ms" not in extra:
        try:
            ms = int(session)
        except (TypeError, ValueError):
            ms = GROUP_SESSION_TIMEOUT_MS  # librdkafka refuses the bad value itself
        out["heartbeat.interval.ms"] = max(100, min(_MAX_HEARTBEAT_MS, ms // 6))
    return out


def _checked_instance_id(instance_id: str) -> str:
    """``instance_id`` as a ``group.instance.id``, or a ConfigurationError saying why not."""
    if (
        not instance_id
        or len(instance_id) > _MAX_INSTANCE_ID
        or not set(instance_id) <= _INSTANCE_ID_CHARS
    ):
        raise ConfigurationError(
            f"the Kafka group instance id {instance_id[:80]!r} must be 1-{_MAX_INSTANCE_ID} "
            "letters, digits, '.', '_' or '-': choose another instance or worker id"
        )
    return instance_id
