"""The fate of each record a client produces: one future per record.

A client shares one Kafka producer between all its callers (threads, or an event
loop's worker threads). Each record it produces gets its own
:class:`concurrent.futures.Future`, resolved by the record's own delivery report: with
:class:`Delivered` (where Kafka wrote it), or with the error that names its
transaction. A caller learns the fate of its own record and of nobody else's (the
producer's shared list of failures, raised to whichever thread flushed next, is not
used).

Delivery reports are served by whichever thread polls or flushes the producer, so a
caller waiting for its record flushes in short slices until its own future is done.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Final

from saga.streams import FatalKafkaError, SagaError, SubmitUncertain
from saga.streams.kafka import DeliveryCallback, Message
from saga.streams.log import LogProducer

__all__ = ["Delivered", "delivery_future", "submit_error", "wait_delivered"]

_SLICE_S: Final = 0.2  # how long one flush of a waiting caller lasts at most


@dataclass(frozen=True, slots=True)
class Delivered:
    """Where Kafka wrote a record of transaction ``tx_id``: its topic, partition and offset."""

    tx_id: str
    topic: str
    partition: int
    offset: int


def submit_error(tx_id: str, error: SagaError) -> SagaError:
    """The error a caller gets for its record of ``tx_id`` that ``error`` stopped.

    What may be retried (Kafka unreachable, a time-out) becomes
    :class:`~streams.SubmitUncertain`, which names ``tx_id`` and says to send it again
    with it; anything else keeps its type (a refused authorisation, a fenced producer)
    and names the transaction. Every one carries ``tx_id`` as an attribute.
    """
    made: SagaError
    if isinstance(error, SubmitUncertain):
        made = error
    elif error.retryable:
        made = SubmitUncertain(tx_id, str(error))
    elif isinstance(error, FatalKafkaError):
        made = FatalKafkaError(f"transaction {tx_id} was not sent: {error}", fenced=error.fenced)
    else:
        try:
            made = type(error)(f"transaction {tx_id} was not sent: {error}")
        except TypeError:  # a subclass with another constructor: keep it as it is
            made = error
    made.tx_id = tx_id
    return made


def delivery_future(tx_id: str) -> tuple[Future[Delivered], DeliveryCallback]:
    """A future for one record of ``tx_id`` and the delivery callback that resolves it."""
    future: Future[Delivered] = Future()
    future.set_running_or_notify_cancel()

    def delivered(error: SagaError | None, message: Message) -> None:
        if error is None:
            future.set_result(Delivered(tx_id, message.topic, message.partition, message.offset))
        else:
            future.set_exception(submit_error(tx_id, error))

    return future, delivered


def wait_delivered(
    producer: LogProducer, future: Future[Delivered], tx_id: str, timeout: float, where: str
) -> Delivered:
    """Wait up to ``timeout`` seconds for ``future`` (a record of ``tx_id`` sent through
    ``producer`` to Kafka at ``where``), serving delivery reports meanwhile.

    Raises:
        SubmitUncertain: no answer within ``timeout`` (the producer may still deliver
            the record later), or Kafka gave up on it for a reason worth a retry.
        SagaError: the record was refused for good (see :func:`submit_error`).
    """
    deadline = time.monotonic() + timeout
    while not future.done():
        left = deadline - time.monotonic()
        if left <= 0:
            raise submit_error(
                tx_id,
                SubmitUncertain(
                    tx_id, f"Kafka at {where} did not acknowledge it within {timeout:g} s"
                ),
            )
        try:
            producer.flush(min(left, _SLICE_S))
        except SagaError as exc:
            if not exc.retryable:  # the producer cannot go on: no report will come
                raise submit_error(tx_id, exc) from exc
    return future.result()
