"""Time and the stop switch shared by the long-running services."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

Clock = Callable[[], int]
"""Milliseconds since the epoch; services take one so tests can drive time."""


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class Stoppable:
    """A service loop that runs until :meth:`stop`, SIGTERM or SIGINT."""

    def __init__(self) -> None:
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def install_signal_handlers(self) -> None:
        """Stop after the current batch on SIGTERM or SIGINT (call from the main thread)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())
