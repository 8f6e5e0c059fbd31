"""Recovery in seconds: static group membership, session timeouts, transactional call limits.

What a consumer asks librdkafka for (the client is replaced by a recorder: no broker),
which instance ids the coordinator and the participant workers give their groups, and
that the crash suite restarts every process with the same id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import confluent_kafka as ck
import pytest

from saga.coordinator import CoordinatorService
from saga.participants import ParticipantRuntime
from saga.streams import ConfigurationError, FatalKafkaError
from saga.streams.kafka import Consumer, KafkaSettings
from saga.streams.kafka._settings import GROUP_SESSION_TIMEOUT_MS, _group_timeouts
from saga.streams.kafka._txn_producer import TransactionalProducer
from saga.streams.testing import InMemoryLog

pytestmark = pytest.mark.unit

SETTINGS = KafkaSettings(bootstrap="nowhere:9092", prefix="u")


class _Recorder:
    """Stands in for ``confluent_kafka.Consumer``: keeps the configuration it was given."""

    made: list[dict[str, Any]] = []

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        _Recorder.made.append(config)
        self.queue: list[Any] = []

    def consume(self, num_messages: int, timeout: float) -> list[Any]:
        out, self.queue = self.queue, []
        return out

    def close(self) -> None:
        pass


@pytest.fixture
def recorded() -> Any:
    _Recorder.made = []
    with mock.patch("saga.streams.kafka._consumer.ck.Consumer", _Recorder):
        yield _Recorder.made


def test_a_group_consumer_gets_a_short_session_and_a_proportional_heartbeat(
    recorded: list[dict[str, Any]],
) -> None:
    Consumer(SETTINGS, "g").close()
    (config,) = recorded
    assert config["session.timeout.ms"] == GROUP_SESSION_TIMEOUT_MS == 6000
    assert config["heartbeat.interval.ms"] == 1000
    assert "group.instance.id" not in config  # dynamic member unless given an id


def test_a_static_member_sends_its_instance_id(recorded: list[dict[str, Any]]) -> None:
    Consumer(SETTINGS, "g", group_instance_id="u.coordinator.c0").close()
    assert recorded[0]["group.instance.id"] == "u.coordinator.c0"


def test_a_plain_reader_has_no_membership_settings(recorded: list[dict[str, Any]]) -> None:
    Consumer(SETTINGS).close()
    (config,) = recorded
    assert not {"session.timeout.ms", "heartbeat.interval.ms", "group.instance.id"} & set(config)
    with pytest.raises(ConfigurationError, match="needs a group_id"):
        Consumer(SETTINGS, group_instance_id="x")


def test_the_users_session_and_heartbeat_settings_win(recorded: list[dict[str, Any]]) -> None:
    user = KafkaSettings(
        bootstrap="nowhere:9092",
        extra={"session.timeout.ms": "45000", "heartbeat.interval.ms": "2000"},
    )
    Consumer(user, "g").close()
    assert recorded[0]["session.timeout.ms"] == "45000"
    assert recorded[0]["heartbeat.interval.ms"] == "2000"


@pytest.mark.parametrize(
    ("extra", "session", "expected"),
    [
        ({}, None, {"session.timeout.ms": 6000, "heartbeat.interval.ms": 1000}),
        ({"session.timeout.ms": "45000"}, None, {"heartbeat.interval.ms": 3000}),
        ({"session.timeout.ms": "12000"}, None, {"heartbeat.interval.ms": 2000}),
        ({}, 10_000, {"heartbeat.interval.ms": 1666}),
        ({"heartbeat.interval.ms": "500"}, None, {"session.timeout.ms": 6000}),
        ({"session.timeout.ms": "soon"}, None, {"heartbeat.interval.ms": 1000}),
    ],
)
def test_group_timeouts(
    extra: dict[str, str], session: int | None, expected: dict[str, Any]
) -> None:
    assert _group_timeouts(extra, session) == expected


@pytest.mark.parametrize("bad", ["", "has space", "slash/ed", "x" * 250, "naïve"])
def test_an_instance_id_kafka_cannot_take_is_one_sentence(
    recorded: list[dict[str, Any]], bad: str
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        Consumer(SETTINGS, "g", group_instance_id=bad)
    message = str(caught.value)
    assert "letters, digits" in message and "\n" not in message
    assert not recorded  # refused before any client exists


def test_a_fenced_static_member_exits_with_a_sentence_naming_its_id(
    recorded: list[dict[str, Any]],
) -> None:
    consumer = Consumer(SETTINGS, "g", group_instance_id="u.participant.bank.w1")
    fenced = mock.Mock()
    fenced.error.return_value = ck.KafkaError(
        ck.KafkaError._FATAL, "Broker: Static consumer fenced by other consumer"
    )
    consumer._client.queue = [fenced]
    with pytest.raises(FatalKafkaError) as caught:
        consumer.poll_batch(10, 0)
    message = str(caught.value)
    assert "u.participant.bank.w1" in message and "give each process its own id" in message
    consumer.close()


def test_the_coordinator_is_a_static_member_named_by_its_instance_id() -> None:
    log = InMemoryLog(SETTINGS)
    service = CoordinatorService(SETTINGS, instance_id="c7", log=log)
    assert service._consumer.group_instance_id == "u.coordinator.c7"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("worker", "member"), [("sql-0", "u.participant.bank.sql-0"), (None, None)]
)
def test_a_participant_worker_is_static_only_with_a_worker_id(
    worker: str | None, member: str | None
) -> None:
    log = InMemoryLog(SETTINGS)
    runtime = ParticipantRuntime(
        "bank", mock.Mock(), SETTINGS, log=log, worker_id=worker, announce=False
    )
    assert runtime._consumer.group_instance_id == member  # type: ignore[attr-defined]


def test_calls_inside_a_transaction_wait_no_longer_than_the_transaction_timeout() -> None:
    producer = TransactionalProducer(SETTINGS, "u.coordinator.t", transaction_timeout_ms=10_000)
    try:
        # The broker aborts the transaction after 10 s: waiting 30 s for it is idle time.
        assert producer._in_transaction(30.0) == 10.0
        assert producer._in_transaction(4.0) == 4.0
    finally:
        producer.close(0)


def test_the_participant_command_passes_its_worker_id() -> None:
    from tests.unit.test_cli_inputs import saga

    with (
        mock.patch("saga.coordinator.cli.wait_for_broker"),
        mock.patch("saga.participants.open_storage"),
        mock.patch("saga.participants.ParticipantRuntime") as runtime,
    ):
        by_option = saga(
            "participant", "run", "--name", "p", "--storage", "sql", "--targets", "t",
            "--url", "sqlite:///x.db", "--worker-id", "sql-1",
        )  # fmt: skip
        by_env = saga(
            "participant", "run", "--name", "p", "--storage", "sql", "--targets", "t",
            "--url", "sqlite:///x.db", env={"SAGA_WORKER_ID": "sql-2"},
        )  # fmt: skip
        without = saga(
            "participant", "run", "--name", "p", "--storage", "sql", "--targets", "t",
            "--url", "sqlite:///x.db",
        )  # fmt: skip
    assert (by_option.code, by_env.code, without.code) == (0, 0, 0)
    ids = [c.kwargs["worker_id"] for c in runtime.call_args_list]
    assert ids == ["sql-1", "sql-2", None]


def test_the_crash_suite_restarts_every_process_with_its_instance_id(tmp_path: Path) -> None:
    from tests.chaos.cluster import Cluster

    cluster = Cluster(
        mock.Mock(), prefix="p", token="t", logs=tmp_path, stores=("sql", "mongo", "redis")
    )
    for slot in cluster.slots.values():
        args = cluster._args(slot)
        flag = "--instance-id" if slot.kind == "coordinator" else "--worker-id"
        assert args[args.index(flag) + 1] == slot.instance_id == slot.name
        assert cluster._args(slot) == args  # the same on every (re)start
