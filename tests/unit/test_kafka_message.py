"""A record read from confluent-kafka, copied into a :class:`~streams.kafka.Message`."""

from __future__ import annotations

import confluent_kafka as ck
import pytest

from saga.streams.kafka._message import _to_message


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, ()),
        ([], ()),
        (
            [("saga.for", b"bank"), ("saga.sig", b"\x00" * 64)],
            (("saga.for", b"bank"), ("saga.sig", b"\x00" * 64)),
        ),
        ([("a", b"1"), ("b", None)], (("a", b"1"), ("b", b""))),  # a null value: b""
        ([("a", None), ("a", b"2")], (("a", b""), ("a", b"2"))),  # order and repeats kept
    ],
)
def test_headers_are_name_and_bytes_pairs_in_order(
    given: list[tuple[str, str | bytes | None]] | None, expected: tuple[tuple[str, bytes], ...]
) -> None:
    raw = ck.Message(topic="t", partition=2, offset=9, key=b"k", value=b"v", headers=given)
    message = _to_message(raw)
    assert message.headers == expected
    assert all(type(value) is bytes for _, value in message.headers)
    assert (message.topic, message.partition, message.offset) == ("t", 2, 9)
    assert (message.key, message.value, message.timestamp_ms) == (b"k", b"v", None)


def test_a_timestamp_is_kept_when_the_broker_gave_one() -> None:
    raw = ck.Message(topic="t", partition=0, offset=1, timestamp=(ck.TIMESTAMP_CREATE_TIME, 7))
    assert _to_message(raw).timestamp_ms == 7
