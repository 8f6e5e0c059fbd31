"""The coordinator's retention chores: which sagas to forget, which statuses to publish again.

The rules are those of :class:`~coordinator._service.CoordinatorService` (its
*Retention* paragraph); this module holds the per-partition state they work on
(:class:`PartitionState`, its sagas in :class:`Sagas`: those in flight in memory, the
finished ones on disk, :mod:`coordinator._finished`), the two sweeps, and the merge of a
committed batch's changes, so that the service module stays about consuming, deciding
and producing.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Final

from saga.coordinator._finished import FINISHED, FinishedTable
from saga.coordinator._machine import Saga
from saga.streams import SagaStatus, encode

__all__ = ["PartitionState", "Sagas", "due_to_forget", "due_to_refresh", "settle"]

# Forgetting is a chore, not a reason to make one transaction huge.
_FORGET_PER_BATCH: Final = 5000
# Stale timer entries a partition may hold beyond twice its sagas in memory.
_PRUNE_SLACK: Final = 1000

ForgetAt = Callable[[Saga], "int | None"]
"""When a saga may be forgotten, or None: keep it."""

Merged = Callable[["PartitionState", str, "Saga | None", Saga], None]
"""Schedules a saga's timers after a committed change (``Chores.merged``)."""


class Sagas:
    """The sagas of one partition, by ``tx_id``: in memory while in flight (:attr:`live`:
    pending, deciding, ``failed``, placeholders), on disk once finished (:attr:`finished`:
    ``committed`` or ``rolled_back``, until forgotten). Lookups see both."""

    def __init__(self, finished: FinishedTable | None = None) -> None:
        self.live: dict[str, Saga] = {}
        self.finished = finished if finished is not None else FinishedTable.private()

    def get(self, tx_id: str) -> Saga | None:
        saga = self.live.get(tx_id)
        return saga if saga is not None else self.finished.get(tx_id)

    def __getitem__(self, tx_id: str) -> Saga:
        saga = self.get(tx_id)
        if saga is None:
            raise KeyError(tx_id)
        return saga

    def __contains__(self, tx_id: object) -> bool:
        return tx_id in self.live or tx_id in self.finished

    def __len__(self) -> int:
        return len(self.live) + len(self.finished)

    def put(self, saga: Saga, forget_at: int | None) -> None:
        """Keep ``saga``'s new state; a finished one (``forget_at`` given) goes to disk.

        A finished saga never changes again (the machine ignores whatever comes for it),
        so nothing moves back from disk to memory.
        """
        if forget_at is not None and saga.request_seen and saga.state in FINISHED:
            self.live.pop(saga.tx_id, None)
            self.finished.put(saga, forget_at)
        else:
            self.live[saga.tx_id] = saga

    def forget(self, tx_id: str) -> None:
        if self.live.pop(tx_id, None) is None:
            self.finished.remove(tx_id)


@dataclass(slots=True)
class PartitionState:
    """What the coordinator holds for one owned partition number."""

    sagas: Sagas = field(default_factory=Sagas)
    # Timers, (due ms, tx_id); changed only when a batch commits (coordinator._timers).
    # Entries go stale when their saga changes: each is checked when it fires.
    deadlines: list[tuple[int, str]] = field(default_factory=list)
    waits: list[tuple[int, str]] = field(default_factory=list)  # a participant's grace ends
    redrive: list[tuple[int, str]] = field(default_factory=list)  # a stalled decision re-sent
    # tx_id -> (updated_ms of the saga, decisions re-sent since that change, next one due)
    redriven: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    # (when the saga may be forgotten, tx_id) of sagas in memory (placeholders): a finished
    # saga's time is in its row on disk. Entries go stale when a saga changes.
    forget: list[tuple[int, str]] = field(default_factory=list)
    # tx_id -> when its unchanged status was last published again (kept sagas only)
    refreshed: dict[str, int] = field(default_factory=dict)

    def due(self, now: int) -> bool:
        """Whether a timer of the partition is due at ``now`` (a batch should run)."""
        if any(heap and heap[0][0] <= now for heap in (self.deadlines, self.waits, self.redrive)):
            return True
        if self.forget and self.forget[0][0] <= now:
            return True
        first = self.sagas.finished.next_due()
        return first is not None and first <= now

    def forget_later(self, at: int, tx_id: str) -> None:
        """Schedule ``tx_id``'s forgetting at ``at`` (a saga on disk has its time in its row)."""
        if tx_id in self.sagas.live:
            heapq.heappush(self.forget, (at, tx_id))

    def prune(self) -> None:
        """Drop the timer entries of sagas no longer in memory, once they outnumber those
        that are: a saga that finished long before its deadline (or its grace, or its next
        re-drive) would otherwise keep its entry, and memory, until then. Never while a
        batch's timer changes are pending (coordinator._timers)."""
        live = self.sagas.live
        for heap in (self.deadlines, self.waits, self.redrive, self.forget):
            if len(heap) > 2 * len(live) + _PRUNE_SLACK:
                heap[:] = [entry for entry in heap if entry[1] in live]
                heapq.heapify(heap)

    def close(self) -> None:
        """The partition is no longer owned: its finished sagas leave the disk."""
        self.sagas.finished.drop()


def due_to_refresh(
    partitions: Mapping[int, PartitionState],
    now: int,
    changed: Mapping[str, tuple[int, Saga]],
    retention_ms: int,
    forget_at: ForgetAt,
) -> list[tuple[int, SagaStatus, bytes]]:
    """Statuses of kept sagas to publish again, so the status topic never deletes them.

    The caller sweeps every quarter retention over the owned sagas; one whose status
    was last published (``updated_ms``, or its last refresh) half a retention ago or
    more is published again, unchanged. Only sagas kept that long are concerned:
    pending with a long deadline, stuck, or ``failed``. Nothing is changed here: the
    caller notes each refresh in ``PartitionState.refreshed`` once its batch commits.
    """
    half = retention_ms // 2
    out: list[tuple[int, SagaStatus, bytes]] = []
    for p, part in partitions.items():
        for tx_id, saga in part.sagas.live.items():
            if tx_id in changed or forget_at(saga) is not None:
                continue
            published = max(saga.updated_ms, part.refreshed.get(tx_id, 0))
            if published + half <= now:
                status = saga.status()
                out.append((p, status, encode(status)))
    return out


def due_to_forget(
    partitions: Mapping[int, PartitionState],
    now: int,
    changed: Mapping[str, tuple[int, Saga]],
    forget_at: ForgetAt,
) -> list[tuple[int, int, str]]:
    """Sagas to forget in this batch: (partition, when due, tx_id).

    Entries of the in-memory heap are taken off (the caller puts them back when the
    batch's transaction fails); rows on disk stay until :func:`settle` removes them.
    """
    due: list[tuple[int, int, str]] = []
    for p, part in partitions.items():
        taken: set[str] = set()
        while part.forget and part.forget[0][0] <= now and len(due) < _FORGET_PER_BATCH:
            at, tx_id = heapq.heappop(part.forget)
            saga = part.sagas.get(tx_id)
            # Stale entries (the saga changed since, or is gone) are dropped; a saga
            # changed by this batch is scheduled again when its change is merged.
            if saga is None or tx_id in changed or forget_at(saga) != at or tx_id in taken:
                continue
            taken.add(tx_id)
            due.append((p, at, tx_id))
        left = _FORGET_PER_BATCH - len(due)
        if left > 0 and (first := part.sagas.finished.next_due()) is not None and first <= now:
            for at, tx_id in part.sagas.finished.due(now, left):
                if tx_id not in changed and tx_id not in taken:
                    due.append((p, at, tx_id))
    return due


def settle(
    partitions: Mapping[int, PartitionState],
    forgotten: list[tuple[int, int, str]],
    changed: Mapping[str, tuple[int, Saga]],
    forget_at: ForgetAt,
    merged: Merged,
) -> None:
    """Apply a committed batch: forget ``forgotten``, keep the new states of ``changed``
    (finished ones on disk) and schedule their timers (``merged``)."""
    with ExitStack() as writing:  # one SQLite transaction per store for the whole batch
        for store in {
            id(x.sagas.finished.store): x.sagas.finished.store for x in partitions.values()
        }.values():
            writing.enter_context(store.writing())
        for p, _, tx_id in forgotten:
            if (owner := partitions.get(p)) is not None:
                owner.sagas.forget(tx_id)
                owner.refreshed.pop(tx_id, None)
                owner.redriven.pop(tx_id, None)
        for tx_id, (p, saga) in changed.items():
            if (owner := partitions.get(p)) is None:
                continue
            before = owner.sagas.live.get(tx_id)
            owner.sagas.put(saga, forget_at(saga))
            merged(owner, tx_id, before, saga)
            if tx_id not in owner.sagas.live:  # finished: nothing more to refresh
                owner.refreshed.pop(tx_id, None)
    for part in partitions.values():
        part.prune()
