"""How many records a participant reads per batch: fewer when its storage is slow.

A participant commits a batch's input offsets only after the batch's storage work and
events, and it must poll Kafka again within ``max.poll.interval.ms`` (librdkafka's
default: 300 s) or it leaves its group: its commit then fails, and the same records
are read again. With a fixed batch size, a storage slow enough that a full batch takes
longer than that (a backlog after a broker outage on a slow server) would read the
same batch for ever: every attempt is lost.

:class:`BatchPace` keeps each batch within a quarter of the interval: a batch that
took longer halves the records read next (down to one), and :data:`QUICK_RUN` full
batches in a row well within it (an eighth) double them again, up to the configured
batch size. Whatever a batch's time, nothing is skipped: a slow batch is only followed
by smaller ones.
"""

from __future__ import annotations

import logging
from typing import Final

from saga.streams.kafka import KafkaSettings

__all__ = ["DEFAULT_MAX_POLL_INTERVAL_MS", "BatchPace", "max_poll_interval_s"]

log = logging.getLogger("saga.participant")

QUICK_RUN: Final = 8
"""Quick full batches in a row before the limit doubles (a batch of cheap records, such as
other participants' events, says little about the next batch of steps)."""

DEFAULT_MAX_POLL_INTERVAL_MS: Final = 300_000
"""librdkafka's ``max.poll.interval.ms`` when the settings do not name one."""


def max_poll_interval_s(settings: KafkaSettings) -> float:
    """The consumer's ``max.poll.interval.ms`` in seconds, as ``settings`` make it."""
    value = settings.extra.get("max.poll.interval.ms", DEFAULT_MAX_POLL_INTERVAL_MS)
    try:
        return max(1.0, float(value) / 1000)
    except (TypeError, ValueError):  # librdkafka refuses it at start anyway
        return DEFAULT_MAX_POLL_INTERVAL_MS / 1000


class BatchPace:
    """The number of records to read next (:attr:`limit`), between 1 and ``most``."""

    def __init__(self, most: int, budget_s: float) -> None:
        self.most = most
        self.budget_s = budget_s
        self.limit = most
        self._quick = 0

    def took(self, records: int, seconds: float) -> None:
        """A batch of ``records`` took ``seconds`` from its read to its offsets' commit."""
        if seconds > self.budget_s and records > 1:
            self._quick = 0
            before, self.limit = self.limit, max(1, min(records, self.limit) // 2)
            if self.limit < before:
                log.warning(
                    "a batch of %d records took %.1f s (more than a quarter of "
                    "max.poll.interval.ms): reading at most %d per batch for now",
                    records,
                    seconds,
                    self.limit,
                )
        elif seconds < self.budget_s / 8 and self.limit < self.most and records >= self.limit:
            self._quick += 1
            if self._quick >= QUICK_RUN:
                self._quick = 0
                self.limit = min(self.most, self.limit * 2)
        else:
            self._quick = 0
