"""librdkafka's repeated lines (a refused connection, every reconnect backoff) once per window."""

from __future__ import annotations

import logging

import pytest

from saga.streams._repeats import RepeatFilter, RoutineRetryFilter
from saga.streams.kafka._settings import _librdkafka_log

pytestmark = pytest.mark.unit

REFUSED = (
    "127.0.0.1:9092/1: Connect to ipv4#127.0.0.1:9092 failed: Connection refused "
    "(after {} ms in state CONNECT)"
)


def line(
    after_ms: int, level: int = logging.ERROR, name: str = "saga.kafka.librdkafka"
) -> logging.LogRecord:
    """As confluent-kafka hands librdkafka's lines to a logger: facility, client, text."""
    args = ("FAIL", "rdkafka#producer-1", REFUSED.format(after_ms))
    return logging.LogRecord(name, level, __file__, 1, "%s [%s] %s", args, None)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_repeated_line_shows_once_per_window_then_says_how_many_were_held() -> None:
    clock = Clock()
    repeats = RepeatFilter(10.0, clock=clock)
    assert repeats.filter(line(0))
    shown = []
    for i in range(1, 300):  # 15 s of a line every 50 ms, its timing differing
        clock.now = 100.0 + i / 20
        record = line(i % 7)
        if repeats.filter(record):
            shown.append(record.getMessage())
    assert len(shown) == 1
    assert shown[0] == (
        "FAIL [rdkafka#producer-1] " + REFUSED.format(200 % 7) + " (199 more like it since "
        "the last one logged)"
    )


def test_other_kinds_and_levels_are_not_held() -> None:
    repeats = RepeatFilter(10.0, clock=Clock())
    assert repeats.filter(line(0))
    assert repeats.filter(line(0, level=logging.WARNING))
    assert repeats.filter(line(0, name="saga.other"))
    other = logging.LogRecord(
        "saga.kafka.librdkafka", logging.ERROR, __file__, 1, "group rebalanced", None, None
    )
    assert repeats.filter(other)
    assert not repeats.filter(line(3))


def test_memory_is_bounded_by_the_number_of_kinds() -> None:
    repeats = RepeatFilter(10.0, max_kinds=8, clock=Clock())
    for i in range(1000):
        text = f"broker {chr(65 + i % 26)}{chr(65 + i // 26 % 26)} is down"
        repeats.filter(logging.LogRecord("x", logging.ERROR, __file__, 1, text, None, None))
    assert len(repeats._kinds) == 8


def test_librdkafkas_logger_has_the_filter() -> None:
    assert any(isinstance(f, RepeatFilter) for f in _librdkafka_log.filters)


def test_a_routine_retry_warning_is_a_notice_shown_only_at_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A fresh broker's "Coordinator load in progress: retrying" is not a warning."""
    logger = logging.getLogger("saga.test.routine")
    logger.addFilter(RoutineRetryFilter())
    line = (
        "GETPID [saga.client#producer-3] [thrd:main]: Failed to acquire idempotence PID "
        "from broker 127.0.0.1:19092/1: Broker: Coordinator load in progress: retrying"
    )
    with caplog.at_level(logging.WARNING, logger="saga.test.routine"):
        logger.warning(line)
        logger.warning("Connect to ipv4#127.0.0.1:19092 failed: Connection refused")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "Connect to ipv4#127.0.0.1:19092 failed: Connection refused")
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="saga.test.routine"):
        logger.warning(line)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.INFO, line)]
