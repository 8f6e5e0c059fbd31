"""The coordinator's timers, changed only when the batch that fired them commits.

Each owned partition keeps its timers in heaps of ``(due_ms, tx_id)`` entries
(:class:`~coordinator._retention.PartitionState`): saga deadlines, the end of a
participant's grace, the next re-drive of a stalled decision. A batch *fires* the
entries that are due (reads them, leaves them in place) and records what it would
change: entries to take off, new entries, status refreshes done. Those changes are
applied by :meth:`TimerBatch.commit`, called only once the batch's Kafka transaction
has committed. A batch whose transaction aborts is processed again (its records are
re-read), and finds its timers as they were: a deadline taken off before an abort
was lost for good (issue 31), and its saga stayed ``pending`` past its deadline.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Literal

from saga.coordinator._retention import PartitionState

__all__ = ["Heap", "TimerBatch", "due"]

Heap = Literal["deadlines", "waits", "redrive"]
"""The timer heaps of a :class:`~coordinator._retention.PartitionState`."""

Entry = tuple[int, str]


def due(heap: list[Entry], now: int, limit: int | None = None) -> list[Entry]:
    """The entries of ``heap`` due at ``now`` (``due_ms <= now``), smallest first; at most
    ``limit``. The heap is not changed: only the entries reached are visited."""
    found: list[Entry] = []
    stack = [0] if heap else []
    while stack:
        i = stack.pop()
        if i < len(heap) and heap[i][0] <= now:
            found.append(heap[i])
            stack += (2 * i + 1, 2 * i + 2)
    found.sort()
    return found if limit is None else found[:limit]


@dataclass(slots=True)
class TimerBatch:
    """What one batch did to the timers, to apply when (and only if) its transaction commits."""

    now: int
    _fired: list[tuple[PartitionState, Heap, int]] = field(default_factory=list)
    _pushed: list[tuple[PartitionState, Heap, Entry]] = field(default_factory=list)
    _refreshed: list[tuple[PartitionState, str]] = field(default_factory=list)
    _redriven: list[tuple[PartitionState, str, tuple[int, int, int]]] = field(default_factory=list)
    next_refresh_ms: int | None = None
    """When the next refresh sweep is due, once this batch commits (None: unchanged)."""

    def fire(self, part: PartitionState, heap: Heap, limit: int | None = None) -> list[Entry]:
        """The due entries of ``part``'s ``heap`` (smallest first, at most ``limit``); they
        leave the heap when the batch commits. Fire each heap of a partition once."""
        entries = due(getattr(part, heap), self.now, limit)
        if entries:
            self._fired.append((part, heap, len(entries)))
        return entries

    def push(self, part: PartitionState, heap: Heap, entry: Entry) -> None:
        """Add ``entry`` to ``part``'s ``heap`` when the batch commits."""
        self._pushed.append((part, heap, entry))

    def refreshed(self, part: PartitionState, tx_id: str) -> None:
        """Note that the batch published ``tx_id``'s unchanged status again (a refresh)."""
        self._refreshed.append((part, tx_id))

    def redriven(self, part: PartitionState, tx_id: str, mark: tuple[int, int, int]) -> None:
        """Note that the batch re-sent ``tx_id``'s decision: ``mark`` is the saga's
        ``updated_ms``, the re-drives since that change and when the next one is due."""
        self._redriven.append((part, tx_id, mark))

    @property
    def refreshes(self) -> int:
        return len(self._refreshed)

    def commit(self) -> int | None:
        """Apply the batch's timer changes (its transaction committed); returns
        :attr:`next_refresh_ms`."""
        for part, heap, count in self._fired:
            # The fired entries are the smallest ones: nothing was pushed since they were
            # read (pushes wait for this call), so popping as many takes exactly them.
            entries: list[Entry] = getattr(part, heap)
            for _ in range(count):
                heapq.heappop(entries)
        for part, heap, entry in self._pushed:
            heapq.heappush(getattr(part, heap), entry)
        for part, tx_id in self._refreshed:
            part.refreshed[tx_id] = self.now
        for part, tx_id, mark in self._redriven:
            part.redriven[tx_id] = mark
        return self.next_refresh_ms
