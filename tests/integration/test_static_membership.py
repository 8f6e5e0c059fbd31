"""Static group membership of the Consumer wrapper against the real broker.

A static member (``group_instance_id``) that closes keeps its partitions for its
restart (no LeaveGroup, no rebalance); a second live consumer with the same id
fences the first. The first rejoins (librdkafka fences a member by its own id after
some broker faults: streams._rejoin), which fences the second back; the second
rejoins too, and so on until the first, fenced a few times in a row, fails with one
sentence naming the id, so that two live processes never go on owning one partition.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from saga.streams._errors import FatalKafkaError
from saga.streams.kafka import (
    Consumer,
    KafkaSettings,
    create_topics,
    delete_topics,
    wait_for_broker,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BOOTSTRAP = os.environ.get("SAGA_KAFKA_BOOTSTRAP", "127.0.0.1:19092")
PARTITIONS = 2


@pytest.fixture
def settings() -> Iterator[KafkaSettings]:
    made = KafkaSettings(bootstrap=BOOTSTRAP, prefix=f"sm-{uuid.uuid4().hex[:12]}")
    wait_for_broker(made, timeout=15)
    create_topics(made, PARTITIONS)
    yield made
    delete_topics(made, made.topics.all)


@pytest.fixture
def consumers() -> Iterator[list[Consumer]]:
    made: list[Consumer] = []
    yield made
    for c in made:
        c.close()


def poll_until(consumer: Consumer, done: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        consumer.poll_batch(10, 0.2)
        if done():
            return True
    return False


def test_a_second_live_member_with_the_same_id_fences_the_first(
    settings: KafkaSettings, consumers: list[Consumer]
) -> None:
    group, member = f"{settings.prefix}.g", f"{settings.prefix}.g.w1"
    topic = settings.topics.requests
    first = Consumer(settings, group, group_instance_id=member)
    consumers.append(first)
    first.subscribe([topic])
    assert poll_until(first, lambda: len(first.assignment()) == PARTITIONS)

    second = Consumer(settings, group, group_instance_id=member)
    consumers.append(second)
    second.subscribe([topic])
    assert poll_until(second, lambda: len(second.assignment()) == PARTITIONS)

    # The first learns at its next heartbeat that it was replaced, rejoins, and is
    # fenced back by the second's own rejoin, a few times: then a fatal error, one
    # sentence that names the id; it must not go on as an owner of the partitions. The
    # second goes on.
    stopped: Consumer | None = None
    message = ""
    deadline = time.monotonic() + 60
    while stopped is None and time.monotonic() < deadline:
        for consumer in (first, second):
            try:
                consumer.poll_batch(10, 0.2)
            except FatalKafkaError as exc:
                stopped, message = consumer, str(exc)
                break
    assert stopped is first, "the older of two live members with one id did not stop"
    assert member in message and "give each process its own id" in message
    assert "\n" not in message
    assert first.rejoins >= 1 and second.rejoins >= 1
    assert poll_until(second, lambda: len(second.assignment()) == PARTITIONS)


def test_a_closed_static_member_keeps_its_partitions_for_its_restart(
    settings: KafkaSettings, consumers: list[Consumer]
) -> None:
    group = f"{settings.prefix}.g"
    topic = settings.topics.requests
    one = Consumer(settings, group, group_instance_id=f"{group}.one")
    two = Consumer(settings, group, group_instance_id=f"{group}.two")
    consumers += [one, two]
    for c in (one, two):
        c.subscribe([topic])

    def spread() -> bool:
        two.poll_batch(10, 0)
        return len(one.assignment()) == 1 and len(two.assignment()) == 1

    assert poll_until(one, spread)
    kept = one.assignment()
    one.close()  # a clean stop: a static member sends no LeaveGroup

    again = Consumer(settings, group, group_instance_id=f"{group}.one")
    consumers.append(again)
    again.subscribe([topic])
    started = time.monotonic()

    def back() -> bool:
        two.poll_batch(10, 0)
        return again.assignment() == kept

    assert poll_until(again, back)
    took = time.monotonic() - started
    # No rebalance: the other member never lost its partition nor got the closed one's.
    assert len(two.assignment()) == 1 and two.assignment() != kept
    # Back at once, not after the closed member's session (6 s) and a rebalance.
    assert took < 5.0, f"the restarted member owned its partition again after {took:.1f}s"
