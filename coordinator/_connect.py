"""How a client is told where Kafka is: one argument, keywords, or the environment.

``SagaClient("127.0.0.1:19092")`` takes the bootstrap servers as its first argument
(a :class:`~streams.kafka.KafkaSettings` is still accepted there), with keyword
arguments for the topic prefix, a Kafka client config file (``key=value`` lines:
SASL, TLS) and the keys. ``SagaClient.from_env()`` reads the variables the ``saga``
command reads: ``SAGA_KAFKA_BOOTSTRAP``, ``SAGA_TOPIC_PREFIX``, ``SAGA_KAFKA_<NAME>``
(a librdkafka setting) and ``SAGA_KEYS_DIR``; a keyword argument wins over its variable,
as an option does over its variable on the command line. Nothing else reads the
environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from saga.streams import ConfigurationError
from saga.streams._secrets import remember_settings
from saga.streams._signing import CLIENT, Keyring
from saga.streams.kafka import KafkaSettings

__all__ = ["Keys", "client_keys", "client_settings", "env_settings"]

Keys = Keyring | str | os.PathLike[str] | None
"""A client's keys: a :class:`~streams._signing.Keyring`, or the folder made by ``saga keys
create`` (its ``client`` key signs), or ``None`` (nothing signed nor checked)."""

_ENV_KEYS = "SAGA_KEYS_DIR"


def client_settings(
    kafka: KafkaSettings | str | None,
    *,
    prefix: str | None = None,
    kafka_config: str | os.PathLike[str] | None = None,
) -> KafkaSettings:
    """The settings of a client given ``kafka`` (bootstrap servers, or settings) and keywords.

    Raises:
        ConfigurationError: no address, keywords next to ready-made settings, or what
            :meth:`KafkaSettings.from_sources` raises (an unreadable config file, ...).
    """
    if isinstance(kafka, KafkaSettings):
        if prefix is not None or kafka_config is not None:
            raise ConfigurationError(
                "give the topic prefix and the Kafka config file either in the KafkaSettings "
                'or as keywords next to a bootstrap address, as SagaClient("host:port", '
                'prefix="p"), not both'
            )
        return kafka
    if not isinstance(kafka, str) or not kafka.strip():
        raise ConfigurationError(
            'a client needs the Kafka bootstrap servers: SagaClient("127.0.0.1:19092"), '
            "or SagaClient.from_env() to read SAGA_KAFKA_BOOTSTRAP"
        )
    return _settings(kafka, prefix, kafka_config, {})


def env_settings(
    environ: Mapping[str, str],
    *,
    prefix: str | None = None,
    kafka_config: str | os.PathLike[str] | None = None,
) -> KafkaSettings:
    """The settings the ``saga`` command would build from ``environ`` (keywords win)."""
    return _settings(None, prefix, kafka_config, environ)


def _settings(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | os.PathLike[str] | None,
    environ: Mapping[str, str],
) -> KafkaSettings:
    config = os.fspath(kafka_config) if kafka_config is not None else None
    settings = KafkaSettings.from_sources(bootstrap, prefix, config, environ)
    remember_settings(settings.extra)  # a sasl.password is never shown by a message
    return settings


def client_keys(keys: Keys, environ: Mapping[str, str] | None = None) -> Keyring | None:
    """The keyring of ``keys`` (a folder: its public keys and the ``client`` key); with
    ``environ`` and no ``keys``, that of ``SAGA_KEYS_DIR`` if it is set."""
    if keys is None and environ is not None and environ.get(_ENV_KEYS):
        keys = environ[_ENV_KEYS]
    if keys is None or isinstance(keys, Keyring):
        return keys
    return Keyring.load(keys, CLIENT)
