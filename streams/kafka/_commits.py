"""At most one asynchronous offset commit in flight per consumer.

The group coordinator answers the requests of one connection one at a time, and
holds each offset commit a few milliseconds (``group.coordinator.append.linger.ms``,
5 ms by default) before it answers. A consumer that sent a commit after every small
batch, without waiting, queued them on its connection faster than the broker
answered: at 1,500 a second the queue grew by 1,300 a second, the heartbeats waited
behind it, and after 6 s the broker dropped the member from its group (seen in the
bench's open loop: a participant stalled 12 s). :class:`CommitGate` keeps one
commit in flight and holds the offsets asked for meanwhile, each partition's newest
replacing the one before: the group ends at the same offsets, with one request per
answer instead of one per batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from saga.streams.kafka._message import Partition

# How long an unanswered commit holds the next one back: a backstop only, librdkafka
# answers every commit (its request timeouts included).
COMMIT_ANSWER_S = 10.0


class CommitGate:
    """The offsets held back while an asynchronous commit is in flight."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: dict[Partition, int] = {}
        self._sent_at: float | None = None
        self.sent = 0
        """Commits let through (asynchronous ones by :meth:`release`, others by :meth:`take`)."""

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def hold(self, offsets: Mapping[Partition, int]) -> None:
        """Offsets to commit; a partition's later offset replaces the one held before."""
        self._held.update(offsets)

    def release(self, *, now: bool = False) -> dict[Partition, int] | None:
        """The held offsets to send now, or ``None`` while a commit is in flight.

        ``now`` lets them go even then (closing). The caller sends what it gets and
        calls :meth:`answered` when the broker's answer arrives.
        """
        if not self._held:
            return None
        since = self._sent_at
        if since is not None and not now and self._clock() - since < COMMIT_ANSWER_S:
            return None
        offsets, self._held = self._held, {}
        self._sent_at = self._clock()
        self.sent += 1
        return offsets

    def take(self, offsets: Mapping[Partition, int] | None = None) -> dict[Partition, int]:
        """The held offsets with ``offsets`` over them, for a commit the caller waits for.

        Held offsets are older than any asked for after them: they go with these,
        never after them.
        """
        merged = {**self._held, **(offsets or {})}
        self._held = {}
        if merged:
            self.sent += 1
        return merged

    def answered(self) -> None:
        """The broker answered a commit: the next held offsets may leave."""
        self._sent_at = None

    def drop(self, partitions: Iterable[Partition]) -> None:
        """Forget the held offsets of partitions that are no longer ours."""
        for p in partitions:
            self._held.pop(p, None)

    def holds_any(self, partitions: Iterable[Partition]) -> bool:
        return any(p in self._held for p in partitions)

    def reset(self) -> None:
        """A new client: nothing held, nothing in flight."""
        self._held, self._sent_at = {}, None
