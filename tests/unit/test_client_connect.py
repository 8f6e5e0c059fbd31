"""A client in one obvious line (issue 30): ``SagaClient("host:port")``, keywords, ``from_env``.

The first argument is the Kafka bootstrap servers (ready-made ``KafkaSettings`` still
work); keywords give the topic prefix, a Kafka config file and the keys (a key folder
or a keyring); ``from_env()`` reads the variables the ``saga`` command reads. The same
for ``AsyncSagaClient``. Making a client contacts nobody, so these run without Kafka
(an unreachable address), and one sends through the in-memory log to show the
one-line client is a working one.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from saga import AsyncSagaClient, SagaClient, Step
from saga.streams import ConfigurationError, KafkaSettings, SagaRequest, decode
from saga.streams._signing import CLIENT, COORDINATOR, create_key
from saga.streams.testing import InMemoryLog

pytestmark = pytest.mark.unit

NOWHERE = "127.0.0.1:1"
STEP = Step("ledger", "increment", {"target": "accounts", "key": "a", "field": "n", "by": 1})


@pytest.fixture
def key_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "keys"
    for principal in (COORDINATOR, CLIENT):
        create_key(folder, principal)
    return folder


def test_a_bootstrap_string_is_all_a_client_needs_and_making_it_contacts_nobody() -> None:
    started = time.monotonic()
    with SagaClient(NOWHERE) as client:
        assert client.settings == KafkaSettings(bootstrap=NOWHERE)
        assert client.topics.requests == "saga.requests"
    assert time.monotonic() - started < 5


def test_keywords_give_the_prefix_a_kafka_config_file_and_the_keys(
    tmp_path: Path, key_folder: Path
) -> None:
    config = tmp_path / "kafka.properties"
    config.write_text("client.rack=r1\nsocket.timeout.ms=1234\n")
    with SagaClient(NOWHERE, prefix="shop", kafka_config=config, keys=key_folder) as client:
        assert client.settings.prefix == "shop" and client.topics.status == "shop.status"
        assert dict(client.settings.extra) == {"client.rack": "r1", "socket.timeout.ms": "1234"}
        assert client._keys is not None and client._keys.signs
        assert client._keys.principal == CLIENT


def test_ready_made_settings_still_work_but_not_with_the_same_keywords() -> None:
    settings = KafkaSettings(bootstrap=NOWHERE, prefix="p")
    with SagaClient(settings) as client:
        assert client.settings is settings
    with pytest.raises(ConfigurationError, match="either in the KafkaSettings or as keywords"):
        SagaClient(settings, prefix="q")


@pytest.mark.parametrize("kafka", [None, "", "  "])
def test_no_address_is_one_sentence_naming_both_ways(kafka: str | None) -> None:
    with pytest.raises(ConfigurationError) as caught:
        SagaClient(kafka)
    assert 'SagaClient("127.0.0.1:19092")' in str(caught.value)
    assert "SagaClient.from_env()" in str(caught.value)


def test_from_env_reads_the_variables_of_the_saga_command(key_folder: Path) -> None:
    environ = {
        "SAGA_KAFKA_BOOTSTRAP": NOWHERE,
        "SAGA_TOPIC_PREFIX": "env",
        "SAGA_KAFKA_CLIENT_RACK": "r1",
        "SAGA_KEYS_DIR": str(key_folder),
        "UNRELATED": "x",
    }
    with SagaClient.from_env(environ) as client:
        assert client.settings == KafkaSettings(
            bootstrap=NOWHERE, prefix="env", extra={"client.rack": "r1"}
        )
        assert client._keys is not None and client._keys.principal == CLIENT
    # a keyword wins over its variable; options reach the constructor
    with SagaClient.from_env(environ, prefix="kw", keys=None, delivery_timeout=3) as client:
        assert client.settings.prefix == "kw" and client.delivery_timeout == 3
        assert client._keys is not None  # keys=None: the variable still says where they are


def test_from_env_without_an_address_says_which_variable() -> None:
    with pytest.raises(ConfigurationError, match="SAGA_KAFKA_BOOTSTRAP"):
        SagaClient.from_env({"SAGA_TOPIC_PREFIX": "p"})


def test_the_async_client_is_made_the_same_ways(key_folder: Path) -> None:
    async def made() -> None:
        async with AsyncSagaClient(NOWHERE, prefix="a", keys=key_folder) as client:
            assert client.settings.prefix == "a"
        async with AsyncSagaClient.from_env({"SAGA_KAFKA_BOOTSTRAP": NOWHERE}) as client:
            assert client.settings == KafkaSettings(bootstrap=NOWHERE)

    asyncio.run(made())


def test_the_one_line_client_sends(tmp_path: Path) -> None:
    log = InMemoryLog(KafkaSettings(bootstrap="memory:9092", prefix="one"))
    log.create_topics(2)
    with SagaClient("memory:9092", prefix="one", log=log) as client:
        tx = client.submit([STEP], saga="credit")
    (record,) = [decode(m.value) for m in log.records("one.requests")]
    assert isinstance(record, SagaRequest) and record.tx_id == tx
