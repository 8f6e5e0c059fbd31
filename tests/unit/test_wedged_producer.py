"""A wedged ``send_offsets_to_transaction`` (librdkafka #5456) is left behind in-process.

The call that wedges after a broker restart runs on a worker thread; when it outlives its
bound, the producer is marked wedged (never touched again, never destroyed) and the caller
gets a :class:`FatalKafkaError`, on which the coordinator makes a new producer with the same
``transactional.id`` (which fences the old one). Past a few such clients, the watchdog
makes the process exit as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import confluent_kafka as ck
import pytest

from saga.streams import FatalKafkaError, KafkaSettings, TransientError
from saga.streams.kafka import Consumer
from saga.streams.kafka import _txn_producer as P

SETTINGS = KafkaSettings(bootstrap="nowhere:9092", prefix="u")


class _Client:
    """Stands in for the producer's librdkafka client: ``send_offsets`` as told."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.release = threading.Event()
        self.touched: list[str] = []

    def send_offsets_to_transaction(self, *_args: Any) -> None:
        self.touched.append("send_offsets")
        if self.behaviour == "wedge":
            self.release.wait(30)
        elif self.behaviour == "retriable":
            raise ck.KafkaException(
                ck.KafkaError(ck.KafkaError._TIMED_OUT, "timed out", retriable=True)
            )

    def flush(self, _timeout: float) -> int:
        self.touched.append("flush")
        return 0

    def poll(self, _timeout: float) -> int:
        return 0

    def close(self) -> None:
        self.touched.append("close")


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    abandoned: list[Any] = []
    monkeypatch.setattr(P, "_SEND_OFFSETS_S", 0.2)
    monkeypatch.setattr(P, "_WEDGED_AFTER_S", 0.3)
    monkeypatch.setattr(P, "_abandoned", abandoned)
    yield abandoned


def _producer(client: _Client, **kwargs: Any) -> P.TransactionalProducer:
    producer = P.TransactionalProducer(SETTINGS, "u.coordinator.t", **kwargs)
    real = producer._client
    real.close()
    producer._client = client
    return producer


def _consumer() -> Any:
    consumer = mock.Mock(spec=Consumer)
    consumer._client = mock.Mock()
    return consumer


def test_a_wedged_send_offsets_is_left_behind_and_raises(quick: list[Any]) -> None:
    client = _Client("wedge")
    producer = _producer(client)
    started = time.monotonic()
    with pytest.raises(FatalKafkaError, match="wedged") as caught:
        producer.send_offsets(_consumer(), {("t", 0): 5})
    assert not caught.value.fenced  # a reset, not a stop
    assert time.monotonic() - started < 5
    assert quick == [client]
    producer.close(5)  # returns at once, without flushing or destroying the wedged client
    assert client.touched == ["send_offsets"]
    client.release.set()


def test_calls_that_return_go_through_the_worker_as_before(quick: list[Any]) -> None:
    producer = _producer(_Client("ok"))
    producer.send_offsets(_consumer(), {("t", 0): 5})
    producer._client = _Client("retriable")
    with pytest.raises(TransientError, match="did not succeed"):
        producer.send_offsets(_consumer(), {("t", 0): 5})
    assert quick == []
    producer.close(0)


def test_past_the_last_client_to_leave_behind_the_watchdog_stops_the_process(
    quick: list[Any],
) -> None:
    quick.extend(object() for _ in range(P._MAX_ABANDONED))
    reported = threading.Event()
    client = _Client("wedge")
    producer = _producer(client, on_wedged=lambda _message: reported.set())
    caller = threading.Thread(
        target=lambda: producer.send_offsets(_consumer(), {("t", 0): 5}), daemon=True
    )
    caller.start()
    assert reported.wait(5)
    client.release.set()
    caller.join(5)
    producer.close(0)


def _all_brokers_down() -> ck.KafkaError:
    return ck.KafkaError(ck.KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down")


def test_a_client_that_saw_every_broker_down_is_left_behind_before_its_send_offsets(
    quick: list[Any],
) -> None:
    """The call that wedges after a broker restart is never made: the client is left
    behind at once (a new producer takes over), instead of after the bound."""
    client = _Client("wedge")
    producer = _producer(client)
    producer._initialised = True  # init() succeeded
    producer._on_client_error(_all_brokers_down())
    started = time.monotonic()
    with pytest.raises(FatalKafkaError, match="every broker down") as caught:
        producer.send_offsets(_consumer(), {("t", 0): 5})
    assert not caught.value.fenced
    assert time.monotonic() - started < P._SEND_OFFSETS_S
    assert quick == [client] and client.touched == []
    producer.close(0)


def test_brokers_unreachable_while_the_client_starts_are_not_an_outage(
    quick: list[Any],
) -> None:
    producer = _producer(_Client("ok"))
    producer._on_client_error(_all_brokers_down())  # before init() returned
    producer.send_offsets(_consumer(), {("t", 0): 5})
    assert quick == []
    producer.close(0)
