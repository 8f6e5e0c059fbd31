"""A static member fenced by its own instance id rejoins in-process; a live duplicate stops.

librdkafka fences a static member by its own ``group.instance.id`` after some broker
faults (issue #3437); a second live process with the id is fenced the same way. The
first fence is ridden through by rejoining (streams._rejoin); a duplicate fences the
rejoined member back within seconds, again and again, and a streak of fences, each
soon after the rejoin before it, stops it.
Covered: the policy's window, the Kafka consumer's rejoin (a recorder stands in for the
client), and the in-memory model (self-fence, and two live consumers with one id).
"""

from __future__ import annotations

import logging
from typing import Any
from unittest import mock

import confluent_kafka as ck
import pytest

from saga.streams import FatalKafkaError, KafkaSettings, TransientError
from saga.streams._rejoin import FENCES_TO_STOP, REJOIN_WINDOW_S, RejoinPolicy, is_instance_fence
from saga.streams.kafka import Consumer
from saga.streams.testing import InMemoryLog, ManualClock
from tests._helpers import memory_log

pytestmark = pytest.mark.unit

SETTINGS = KafkaSettings(bootstrap="nowhere:9092", prefix="r")
LIBRDKAFKA_TEXT = (
    "Fatal error: Broker: Static consumer fenced by other consumer with same "
    "group.instance.id: Fatal consumer error: Broker: Static consumer fenced by other "
    "consumer with same group.instance.id"
)


def test_the_fence_is_known_by_its_code_or_librdkafkas_text() -> None:
    assert is_instance_fence("FENCED_INSTANCE_ID", "")
    assert is_instance_fence("_FATAL", LIBRDKAFKA_TEXT)
    assert not is_instance_fence("_FATAL", "Fatal error: Broker: something else")


def test_a_streak_of_quick_fences_is_a_duplicate_and_a_slow_one_is_not() -> None:
    now = [100.0]
    policy = RejoinPolicy("w1", clock=lambda: now[0])
    for _ in range(FENCES_TO_STOP - 1):  # self-fences while the group coordinator settles
        assert policy.allow("fenced")
        now[0] += REJOIN_WINDOW_S - 1
    assert not policy.allow("fenced again")  # the streak: a live duplicate
    fresh = RejoinPolicy("w2", clock=lambda: now[0])
    for _ in range(2 * FENCES_TO_STOP):  # broker faults further apart: never a streak
        assert fresh.allow("fenced")
        now[0] += REJOIN_WINDOW_S + 1
    assert fresh.rejoins == 2 * FENCES_TO_STOP


class _Recorder:
    """Stands in for ``confluent_kafka.Consumer``: hands out queued events, counts closes."""

    made: list[_Recorder] = []

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.queue: list[Any] = []
        self.closed = False
        _Recorder.made.append(self)

    def consume(self, num_messages: int, timeout: float) -> list[Any]:
        out, self.queue = self.queue, []
        return out

    def subscribe(self, topics: list[str], **callbacks: Any) -> None:
        self.topics = topics
        self.callbacks = callbacks

    def close(self) -> None:
        self.closed = True


def _fence() -> Any:
    event = mock.Mock()
    event.error.return_value = ck.KafkaError(ck.KafkaError._FATAL, LIBRDKAFKA_TEXT, fatal=True)
    return event


def test_the_kafka_consumer_rejoins_with_the_same_id_until_a_streak_stops_it() -> None:
    _Recorder.made = []
    lost: list[list[tuple[str, int]]] = []
    with mock.patch("saga.streams.kafka._consumer.ck.Consumer", _Recorder):
        consumer = Consumer(SETTINGS, "g", group_instance_id="r.w1", on_revoke=lost.append)
        consumer.subscribe(["t"])
        first = _Recorder.made[0]
        first.callbacks["on_assign"](first, [ck.TopicPartition("t", 0), ck.TopicPartition("t", 1)])
        first.queue = [_fence()]
        assert consumer.poll_batch(10, 0) == []
        assert consumer.rejoins == 1
        again = _Recorder.made[1]
        assert first.closed and again is consumer._client
        assert again.config["group.instance.id"] == "r.w1" and again.topics == ["t"]
        assert lost == [[("t", 0), ("t", 1)]]  # what it owned went to on_lost (on_revoke here)
        first.callbacks["on_revoke"](first, [ck.TopicPartition("t", 0)])  # the old client's
        assert lost == [[("t", 0), ("t", 1)]]  # ...callbacks are ignored
        for _ in range(FENCES_TO_STOP - 2):  # fenced back at once, as by a duplicate
            _Recorder.made[-1].queue = [_fence()]
            assert consumer.poll_batch(10, 0) == []
        _Recorder.made[-1].queue = [_fence()]
        with pytest.raises(FatalKafkaError) as caught:
            consumer.poll_batch(10, 0)
        message = str(caught.value)
        assert "r.w1" in message and "give each process its own id" in message
        assert "\n" not in message
        consumer.close()


def test_a_consumer_without_an_instance_id_does_not_rejoin() -> None:
    _Recorder.made = []
    with mock.patch("saga.streams.kafka._consumer.ck.Consumer", _Recorder):
        consumer = Consumer(SETTINGS, "g")
        _Recorder.made[0].queue = [_fence()]
        with pytest.raises(FatalKafkaError):
            consumer.poll_batch(10, 0)
        assert len(_Recorder.made) == 1


@pytest.fixture
def log(clock: ManualClock) -> InMemoryLog:
    return memory_log(SETTINGS, clock, 2)


def test_an_in_memory_member_fenced_alone_rejoins_and_gets_its_partitions_back(
    log: InMemoryLog,
) -> None:
    lost: list[list[tuple[str, int]]] = []
    consumer = log.consumer("g", group_instance_id="r.w1", on_lost=lost.append)
    consumer.subscribe([SETTINGS.topics.requests])
    consumer.poll_batch(10, 0)
    owned = consumer.assignment()
    assert len(owned) == 2
    log._leave(consumer)
    consumer.replaced = True  # the self-fence: no other member has the id
    consumer.poll_batch(10, 0)
    assert lost == [owned]
    assert consumer.assignment() == owned and consumer.rejoins == 1


def test_of_two_live_consumers_with_one_id_the_older_stops(
    log: InMemoryLog, clock: ManualClock
) -> None:
    topic = SETTINGS.topics.requests
    older = log.consumer("g", group_instance_id="r.w1")
    older.subscribe([topic])
    older.poll_batch(10, 0)
    newer = log.consumer("g", group_instance_id="r.w1")
    newer.subscribe([topic])  # fences the older
    newer.poll_batch(10, 0)
    stopped = None
    for _ in range(3 * FENCES_TO_STOP):  # they fence each other back until one stops
        for consumer in (older, newer):
            clock.advance(1_000)
            try:
                consumer.poll_batch(10, 0)
            except FatalKafkaError:
                stopped = consumer
                break
        if stopped is not None:
            break
    assert stopped is older
    newer.poll_batch(10, 0)
    assert len(newer.assignment()) == 2 and newer.rejoins == FENCES_TO_STOP - 1


def test_a_commit_failing_on_the_fence_rejoins_and_is_transient() -> None:
    """After the fatal error, a commit fails only with "Local: Fatal error": the error
    callback's text tells that it was the instance fence (seen in the cluster profile)."""
    _Recorder.made = []
    with mock.patch("saga.streams.kafka._consumer.ck.Consumer", _Recorder):
        consumer = Consumer(SETTINGS, "g", group_instance_id="r.w1")
        consumer.subscribe(["t"])
        first = _Recorder.made[0]
        first.config["error_cb"](ck.KafkaError(ck.KafkaError._FATAL, LIBRDKAFKA_TEXT, fatal=True))

        def commit(**_kwargs: Any) -> None:
            raise ck.KafkaException(
                ck.KafkaError(ck.KafkaError._FATAL, "Commit failed: Local: Fatal error", fatal=True)
            )

        first.commit = commit  # type: ignore[attr-defined]
        with pytest.raises(TransientError, match="rejoined"):
            consumer.commit({("t", 0): 5})
        assert consumer.rejoins == 1 and consumer._client is _Recorder.made[1]
        consumer.close()


def test_any_call_that_meets_the_fence_first_rejoins_and_is_transient() -> None:
    _Recorder.made = []
    with mock.patch("saga.streams.kafka._consumer.ck.Consumer", _Recorder):
        consumer = Consumer(SETTINGS, "g", group_instance_id="r.w1")
        consumer.subscribe(["t"])
        first = _Recorder.made[0]
        first.config["error_cb"](ck.KafkaError(ck.KafkaError._FATAL, LIBRDKAFKA_TEXT, fatal=True))

        def seek(_tp: Any) -> None:
            raise ck.KafkaException(ck.KafkaError(ck.KafkaError._FATAL, "Local: Fatal error"))

        first.seek = seek  # type: ignore[attr-defined]
        with pytest.raises(TransientError, match="rejoined"):
            consumer.seek("t", 0, 5)
        assert consumer.rejoins == 1
        consumer.close()


def test_a_commit_before_the_poll_that_says_why_finds_the_cause_in_the_queue() -> None:
    """The commit can fail with "Local: Fatal error" before any poll served the fence
    event (seen in the cluster profile): the queue is served to learn the cause."""
    _Recorder.made = []
    with mock.patch("saga.streams.kafka._consumer.ck.Consumer", _Recorder):
        consumer = Consumer(SETTINGS, "g", group_instance_id="r.w1")
        consumer.subscribe(["t"])
        first = _Recorder.made[0]
        first.queue = [_fence()]

        def commit(**_kwargs: Any) -> None:
            raise ck.KafkaException(
                ck.KafkaError(ck.KafkaError._FATAL, "Commit failed: Local: Fatal error", fatal=True)
            )

        first.commit = commit  # type: ignore[attr-defined]
        with pytest.raises(TransientError, match="rejoined"):
            consumer.commit({("t", 0): 5})
        assert consumer.rejoins == 1
        consumer.close()


def test_a_commit_whose_cause_only_the_clients_log_line_names_rejoins() -> None:
    """Neither the error callback nor the queue served the fence before the commit
    failed; the client's FATAL log line, served with the commit, names it (seen in the
    cluster profile: the participant exited instead of rejoining). The line still goes
    to the log."""
    _Recorder.made = []
    with mock.patch("saga.streams.kafka._consumer.ck.Consumer", _Recorder):
        consumer = Consumer(SETTINGS, "g", group_instance_id="r.w1")
        consumer.subscribe(["t"])
        first = _Recorder.made[0]

        def commit(**_kwargs: Any) -> None:
            first.config["logger"].log(
                logging.CRITICAL, "%s [%s] %s", "FATAL", "c#consumer-8", LIBRDKAFKA_TEXT
            )
            raise ck.KafkaException(
                ck.KafkaError(ck.KafkaError._FATAL, "Commit failed: Local: Fatal error", fatal=True)
            )

        first.commit = commit  # type: ignore[attr-defined]
        with (
            mock.patch.object(logging.getLogger("saga.kafka.librdkafka"), "log") as logged,
            pytest.raises(TransientError, match="rejoined"),
        ):
            consumer.commit({("t", 0): 5})
        assert consumer.rejoins == 1 and consumer._client is _Recorder.made[1]
        assert logged.call_args.args[0] == logging.CRITICAL
        consumer.close()
