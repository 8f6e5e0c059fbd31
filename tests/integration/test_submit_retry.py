"""Submits that can be retried safely (issue 31, must-hold 3), against the real broker.

* Kafka unreachable during ``submit`` (the client's bootstrap address goes through a
  gate that refuses connections until the test opens it): the error is
  :class:`~streams.SubmitUncertain`, a :class:`~streams.TransientError` that names the
  ``tx_id``. The request stays queued; once Kafka is reachable it is delivered late,
  and the retry with the same ``tx_id`` is delivered too: two request records, and the
  coordinator (a real one, in a thread) makes one saga of them: one status, one
  decision, nothing in the DLQ.
* Two threads sharing one client each learn the fate of their own request: with Kafka
  unreachable (a closed port) each error names its own ``tx_id``; with Kafka up each
  gets the delivery (topic, partition, offset) of its own records.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest

from saga.coordinator import Delivered, SagaClient
from saga.coordinator._service import CoordinatorService
from saga.streams import (
    Decision,
    SagaRequest,
    SagaState,
    SagaStatus,
    Step,
    SubmitUncertain,
    TransientError,
    decode,
)
from saga.streams.kafka import Consumer, KafkaSettings, Message, create_topics, delete_topics
from tests._infra import Services, eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PARTITIONS = 2
STEP = Step("ledger", "increment", {"target": "accounts", "key": "a", "field": "n", "by": 1})


@pytest.fixture
def settings(services: Services, topic_prefix: str) -> Iterator[KafkaSettings]:
    """The saga topics under a fresh prefix, deleted afterwards."""
    made = KafkaSettings(bootstrap=services.kafka_bootstrap, prefix=topic_prefix)
    create_topics(made, PARTITIONS)
    yield made
    delete_topics(made, made.topics.all)


class Gate:
    """A TCP forwarder to Kafka's bootstrap address that refuses every connection until
    :meth:`open` (a client bootstrapped through it cannot reach Kafka until then; after,
    it learns the broker's own address and talks to it directly)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        self.opened = threading.Event()
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def open(self) -> None:
        self.opened.set()

    def close(self) -> None:
        self._stop.set()
        self._server.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                continue
            if not self.opened.is_set():
                conn.close()  # refused: the client retries after its reconnect backoff
                continue
            upstream = socket.create_connection(self._upstream)
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with suppress(OSError):
                s.close()


@contextmanager
def running_coordinator(settings: KafkaSettings) -> Iterator[CoordinatorService]:
    service = CoordinatorService(settings, instance_id=f"t{uuid.uuid4().hex[:6]}")
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    try:
        yield service
    finally:
        service.stop()
        thread.join(30)


def read_all(settings: KafkaSettings, topic: str) -> list[Message]:
    """Every record of ``topic`` now (read_committed)."""
    reader = Consumer(settings, group_id=None, client_id="retry-test.reader")
    try:
        found: list[Message] = []
        for p in range(PARTITIONS):
            low, high = reader.watermarks(topic, p)
            if high <= low:
                continue
            reader.assign([(topic, p, low)])
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                found += reader.poll_batch(500, 0.2)
                position = reader.position([(topic, p)])[(topic, p)]
                if position is not None and position >= high:
                    break
        return found
    finally:
        reader.close()


def records_of(settings: KafkaSettings, topic: str, tx: str) -> list[object]:
    return [
        decode(m.value) if m.value is not None else None
        for m in read_all(settings, topic)
        if m.key == tx.encode()
    ]


def requests_read(settings: KafkaSettings) -> bool:
    """Whether the coordinator's group has committed every request in the log."""
    group = Consumer(settings, group_id=f"{settings.prefix}.coordinator", client_id="retry-test")
    try:
        topic = settings.topics.requests
        committed = group.committed([(topic, p) for p in range(PARTITIONS)])
        return all(
            (committed[(topic, p)] or 0) >= group.watermarks(topic, p)[1] for p in range(PARTITIONS)
        )
    finally:
        group.close()


def closed_port() -> str:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_kafka_unreachable_during_submit_names_the_tx_id_and_its_retry_is_one_saga(
    services: Services, settings: KafkaSettings
) -> None:
    gate = Gate(services.kafka_bootstrap)
    gated = KafkaSettings(bootstrap=gate.address, prefix=settings.prefix)
    try:
        with running_coordinator(settings), SagaClient(gated, delivery_timeout=2) as down:
            started = time.monotonic()
            with pytest.raises(SubmitUncertain) as caught:
                down.submit([STEP], saga="transfer", timeout=8)
            error = caught.value
            assert time.monotonic() - started < 15
            assert isinstance(error, TransientError) and error.retryable
            assert error.tx_id and error.tx_id in str(error) and "submit it again" in str(error)

            gate.open()  # Kafka is back: the first request, still queued, goes out late
            tx = down.submit([STEP], saga="transfer", timeout=8, tx_id=error.tx_id)
            assert tx == error.tx_id
            down.flush(30)

            requests = eventually(
                lambda: len(r := records_of(settings, settings.topics.requests, tx)) == 2 and r,
                timeout=30,
                message="both copies of the request should be in the log",
            )
            assert all(isinstance(r, SagaRequest) for r in requests)

            # No participant runs: the saga rolls back at its deadline and waits, as one
            # saga, for its step to be compensated.
            decisions = eventually(
                lambda: records_of(settings, settings.topics.decisions, tx),
                timeout=60,
                message="the saga was never decided",
            )
            # Both copies read and accounted for (offsets commit with the decisions): a
            # second saga would have shown by then.
            eventually(lambda: requests_read(settings), timeout=30, message="not read yet")
        assert [(type(d), getattr(d, "reason", None)) for d in decisions] == [
            (Decision, "deadline passed")
        ]
        assert records_of(settings, settings.topics.decisions, tx) == decisions
        (last,) = records_of(settings, settings.topics.status, tx)[-1:]
        assert isinstance(last, SagaStatus) and last.state is SagaState.ROLLING_BACK
        status_keys = {m.key for m in read_all(settings, settings.topics.status)}
        assert status_keys == {tx.encode()}, "exactly one saga"
        assert records_of(settings, settings.topics.dlq, tx) == []
    finally:
        gate.close()


def test_two_threads_sharing_an_unreachable_client_each_get_their_own_error(
    topic_prefix: str,
) -> None:
    client = SagaClient(
        KafkaSettings(bootstrap=closed_port(), prefix=topic_prefix), delivery_timeout=2
    )
    barrier = threading.Barrier(2)
    caught: dict[str, str] = {}

    def submit(name: str) -> None:
        tx = f"{name}-{uuid.uuid4().hex[:8]}"
        barrier.wait()
        try:
            client.submit([STEP], saga="transfer", tx_id=tx)
        except SubmitUncertain as exc:
            caught[tx] = exc.tx_id

    threads = [threading.Thread(target=submit, args=(n,)) for n in ("a", "b")]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        client.close()
    assert len(caught) == 2 and all(tx == named for tx, named in caught.items()), caught


def test_two_threads_sharing_a_client_each_get_their_own_deliveries(
    settings: KafkaSettings,
) -> None:
    barrier = threading.Barrier(2)
    results: dict[str, list[tuple[str, Delivered]]] = {}

    with SagaClient(settings) as client:

        def send(name: str) -> None:
            requests = [client.build([STEP], tx_id=f"{name}-{i}") for i in range(25)]
            barrier.wait()
            futures = [(r.tx_id, client.send(r, wait_delivery=i % 2 == 0)) for i, r in
                       enumerate(requests)]  # fmt: skip
            client.flush(30)
            results[name] = [(tx, future.result(timeout=30)) for tx, future in futures]

        threads = [threading.Thread(target=send, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert sorted(results) == ["a", "b"]
    places = set()
    for name, delivered in results.items():
        assert [d.tx_id for _, d in delivered] == [tx for tx, _ in delivered]
        assert all(tx.startswith(f"{name}-") for tx, _ in delivered)
        places |= {(d.topic, d.partition, d.offset) for _, d in delivered}
    assert len(places) == 50 and {t for t, _, _ in places} == {settings.topics.requests}
