"""The client settings for broker failovers (README, Running on a cluster) and their overrides."""

from __future__ import annotations

import pytest

from saga.streams.kafka import KafkaSettings
from saga.streams.kafka._settings import (
    CONSUMER_SOCKET_TIMEOUT_MS,
    FAILOVER_DEFAULTS,
    _client_config,
)
from tests.unit.test_group_membership import recorded  # noqa: F401 (fixture)

pytestmark = pytest.mark.unit


def test_every_client_gets_the_failover_defaults_and_the_user_can_change_them() -> None:
    config = _client_config(KafkaSettings(bootstrap="b:1"))
    assert config["reconnect.backoff.max.ms"] == 1000
    assert config["socket.connection.setup.timeout.ms"] == 5000
    assert config["topic.metadata.refresh.interval.ms"] == 10_000
    own = KafkaSettings(bootstrap="b:1", extra={"reconnect.backoff.max.ms": "10000"})
    assert _client_config(own)["reconnect.backoff.max.ms"] == "10000"
    assert set(FAILOVER_DEFAULTS) <= set(config)


def test_a_consumer_times_requests_out_sooner_unless_told(recorded: list) -> None:  # noqa: F811
    from saga.streams.kafka import Consumer

    Consumer(KafkaSettings(bootstrap="b:1"), "g").close()
    Consumer(KafkaSettings(bootstrap="b:1", extra={"socket.timeout.ms": "60000"}), "g").close()
    first, second = recorded
    assert first["socket.timeout.ms"] == CONSUMER_SOCKET_TIMEOUT_MS == 10_000
    assert second["socket.timeout.ms"] == "60000"


def test_a_transactional_producer_retries_sooner_unless_told() -> None:
    """CONCURRENT_TRANSACTIONS right after a commit is retried after retry.backoff.ms."""
    from unittest import mock

    from saga.streams.kafka import TransactionalProducer
    from saga.streams.kafka._settings import TXN_RETRY_BACKOFF_MS

    made: list[dict[str, object]] = []

    def record(config: dict[str, object]) -> mock.MagicMock:
        made.append(config)
        return mock.MagicMock()

    with mock.patch("saga.streams.kafka._producer.ck.Producer", record):
        TransactionalProducer(KafkaSettings(bootstrap="b:1"), "t")
        own = KafkaSettings(bootstrap="b:1", extra={"retry.backoff.ms": "100"})
        TransactionalProducer(own, "t")
    assert made[0]["retry.backoff.ms"] == TXN_RETRY_BACKOFF_MS == 10
    assert made[1]["retry.backoff.ms"] == "100"
