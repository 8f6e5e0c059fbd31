"""A logging filter that shows a repeated line once per window (librdkafka's retries)."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

_NUMBERS: Final = re.compile(r"\d+")


class RepeatFilter(logging.Filter):
    """One line of each kind per ``window_s``; the ones in between are counted, not logged.

    A line's kind is its logger, level and text with every number taken out, so
    librdkafka's "Connect to ipv4#127.0.0.1:9092 failed: Connection refused (after
    0ms in state CONNECT)" is one kind whatever the timings. During a broker outage
    each client repeated that line at ERROR every 50 to 100 ms (its reconnect backoff);
    now an operator sees it once per window per kind, and the next one says how
    many like it were not logged. At most ``max_kinds`` kinds are remembered (the
    oldest is forgotten first), so memory stays bounded whatever the lines say.
    """

    def __init__(
        self,
        window_s: float = 10.0,
        *,
        max_kinds: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.window_s = window_s
        self.max_kinds = max_kinds
        self._clock = clock
        self._lock = threading.Lock()
        self._kinds: OrderedDict[tuple[str, int, str], list[float]] = OrderedDict()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        kind = (record.name, record.levelno, _NUMBERS.sub("#", text))
        now = self._clock()
        with self._lock:
            seen = self._kinds.get(kind)
            if seen is not None and now - seen[0] < self.window_s:
                seen[1] += 1
                return False
            held = int(seen[1]) if seen is not None else 0
            self._kinds[kind] = [now, 0]
            self._kinds.move_to_end(kind)
            while len(self._kinds) > self.max_kinds:
                self._kinds.popitem(last=False)
        if held:
            record.msg = f"{text} ({held} more like it since the last one logged)"
            record.args = None
        return True


_ROUTINE_RETRIES: Final = (
    # A broker that has just started loads its transaction and group state before it
    # hands out producer ids: the first producer waits for it, retrying by itself.
    "Coordinator load in progress: retrying",
)


class RoutineRetryFilter(logging.Filter):
    """Lowers to INFO the librdkafka warnings that only say it retries something routine.

    A fresh broker answers the first idempotent producer with "Failed to acquire
    idempotence PID from broker ...: Coordinator load in progress: retrying"; the
    producer retries on its own and nothing is lost, yet the line read as a failure on
    the first screen of ``make demo``. It stays visible at INFO (``-v``).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and any(
            text in record.getMessage() for text in _ROUTINE_RETRIES
        ):
            record.levelno = logging.INFO
            record.levelname = logging.getLevelName(logging.INFO)
            # The logger let it through as a warning; as a notice it shows only where
            # INFO is on.
            return logging.getLogger(record.name).isEnabledFor(logging.INFO)
        return True
