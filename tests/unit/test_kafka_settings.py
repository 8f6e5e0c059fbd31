"""The broker-free parts of streams.kafka: settings parsing, Message, partitioning."""

from __future__ import annotations

from pathlib import Path

import pytest

from saga.streams._errors import ConfigurationError
from saga.streams.kafka import KafkaSettings, Message, partition_for

pytestmark = pytest.mark.unit


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kafka.properties"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_address_comes_from_the_argument_before_the_environment() -> None:
    env = {"SAGA_KAFKA_BOOTSTRAP": "env-host:9092"}
    settings = KafkaSettings.from_sources("arg-host:9092", None, None, env)
    assert settings.bootstrap == "arg-host:9092"
    assert KafkaSettings.from_sources(None, None, None, env).bootstrap == "env-host:9092"


@pytest.mark.parametrize("env", [{}, {"SAGA_KAFKA_BOOTSTRAP": ""}])
def test_missing_address_says_how_to_give_one(env: dict[str, str]) -> None:
    with pytest.raises(ConfigurationError) as caught:
        KafkaSettings.from_sources(None, None, None, env)
    assert str(caught.value) == (
        "no Kafka address: pass --bootstrap HOST:PORT or set SAGA_KAFKA_BOOTSTRAP"
    )


def test_prefix_comes_from_argument_then_environment_then_default() -> None:
    env = {"SAGA_KAFKA_BOOTSTRAP": "h:1", "SAGA_TOPIC_PREFIX": "staging"}
    assert KafkaSettings.from_sources(None, "mine", None, env).prefix == "mine"
    assert KafkaSettings.from_sources(None, None, None, env).prefix == "staging"
    settings = KafkaSettings.from_sources("h:1", None, None, {})
    assert settings.prefix == "saga"
    assert settings.topics.requests == "saga.requests"
    assert settings.topics.status == "saga.status"


def test_bad_prefix_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="prefix"):
        KafkaSettings.from_sources("h:1", "no spaces allowed", None, {})


def test_config_file_lines_become_extra_settings(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "# security for the managed cluster\n"
        "\n"
        "security.protocol = SASL_SSL\n"
        "sasl.mechanism=PLAIN\n"
        "  # an indented comment\n"
        "sasl.password=se=cr#et\n",
    )
    settings = KafkaSettings.from_sources("h:1", None, path, {})
    assert dict(settings.extra) == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "PLAIN",
        "sasl.password": "se=cr#et",
    }


def test_environment_maps_to_librdkafka_names_and_overrides_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "security.protocol=SSL\nssl.ca.location=/etc/ca.pem\n")
    env = {
        "SAGA_KAFKA_BOOTSTRAP": "h:1",
        "SAGA_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "SAGA_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "SAGA_TOPIC_PREFIX": "p",
        "SAGA_POSTGRES_URL": "postgresql://x",
        "HOME": "/root",
    }
    settings = KafkaSettings.from_sources(None, None, path, env)
    assert settings.bootstrap == "h:1"
    assert dict(settings.extra) == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "ssl.ca.location": "/etc/ca.pem",
    }


def test_file_address_is_the_last_resort(tmp_path: Path) -> None:
    path = write(tmp_path, "bootstrap.servers=file-host:9092\n")
    assert KafkaSettings.from_sources(None, None, path, {}).bootstrap == "file-host:9092"
    settings = KafkaSettings.from_sources("arg:1", None, path, {})
    assert settings.bootstrap == "arg:1"
    assert "bootstrap.servers" not in settings.extra


def test_bad_line_names_file_and_line_without_echoing_it(tmp_path: Path) -> None:
    path = write(tmp_path, "security.protocol=SSL\n# fine\nsasl.password hunter2\n")
    with pytest.raises(ConfigurationError) as caught:
        KafkaSettings.from_sources("h:1", None, path, {})
    message = str(caught.value)
    assert f"{path}, line 3" in message
    assert "hunter2" not in message


def test_unreadable_file_is_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.properties")
    with pytest.raises(ConfigurationError, match=r"cannot read the Kafka config file .*nope"):
        KafkaSettings.from_sources("h:1", None, missing, {})


@pytest.mark.parametrize("key", ["enable.auto.commit", "acks", "transactional.id"])
def test_settings_that_carry_guarantees_cannot_be_overridden(tmp_path: Path, key: str) -> None:
    path = write(tmp_path, f"{key}=whatever\n")
    with pytest.raises(ConfigurationError, match=key):
        KafkaSettings.from_sources("h:1", None, path, {})


def test_extra_is_read_only() -> None:
    source = {"security.protocol": "SSL"}
    settings = KafkaSettings("h:1", extra=source)
    source["security.protocol"] = "PLAINTEXT"
    assert settings.extra["security.protocol"] == "SSL"
    with pytest.raises(TypeError):
        settings.extra["x"] = "y"  # type: ignore[index]


def test_message_next_offset_is_one_past_the_record() -> None:
    message = Message(
        topic="saga.events",
        partition=2,
        offset=41,
        key=b"tx-1",
        value=b"{}",
        headers=(("a", b"1"), ("b", b"2"), ("a", b"3")),
    )
    assert message.next_offset == 42
    assert message.partition_key == ("saga.events", 2)
    assert message.header("a") == b"3"
    assert message.header("missing") is None


# Computed with the Java client (kafka-clients 4.1.1):
# Utils.toPositive(Utils.murmur2(key.getBytes(UTF_8))) % partitions
@pytest.mark.parametrize(
    ("key", "on_3", "on_7"),
    [("tx-1", 0, 0), ("tx-2", 0, 0), ("order:42", 2, 5), ("ü-x", 2, 0), ("abc", 0, 4)],
)
def test_partition_for_agrees_with_the_java_partitioner(key: str, on_3: int, on_7: int) -> None:
    assert partition_for(key, 3) == on_3
    assert partition_for(key, 7) == on_7
    assert partition_for(key.encode(), 7) == on_7
