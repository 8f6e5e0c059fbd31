"""Small helpers the test modules share, where none of the larger helper modules fits."""

from __future__ import annotations

from saga.streams import KafkaSettings
from saga.streams.testing import InMemoryLog, ManualClock


def memory_log(settings: KafkaSettings, clock: ManualClock, partitions: int) -> InMemoryLog:
    """An in-memory log on ``clock`` with every saga topic of ``settings`` created."""
    made = InMemoryLog(settings, clock=clock)
    made.create_topics(partitions)
    return made
