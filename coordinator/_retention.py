"""The coordinator's retention chores: which sagas to forget, which statuses to publish again.

The rules are those of :class:`~coordinator._service.CoordinatorService` (its
*Retention* paragraph); this module holds the per-partition state they work on
and the two sweeps, so that the service module stays about consuming, deciding
and producing.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

from saga.coordinator._machine import Saga
from saga.streams import SagaStatus, encode

__all__ = ["PartitionState", "due_to_forget", "due_to_refresh"]

# Forgetting is a chore, not a reason to make one transaction huge.
_FORGET_PER_BATCH: Final = 5000

ForgetAt = Callable[[Saga], "int | None"]
"""When a saga may be forgotten, or None: keep it."""


@dataclass(slots=True)
class PartitionState:
    """What the coordinator holds for one owned partition number."""

    sagas: dict[str, Saga] = field(default_factory=dict)
    # Timers, (due ms, tx_id); changed only when a batch commits (coordinator._timers).
    # Entries go stale when their saga changes: each is checked when it fires.
    deadlines: list[tuple[int, str]] = field(default_factory=list)
    waits: list[tuple[int, str]] = field(default_factory=list)  # a participant's grace ends
    redrive: list[tuple[int, str]] = field(default_factory=list)  # a stalled decision re-sent
    # tx_id -> (updated_ms of the saga, decisions re-sent since that change, next one due)
    redriven: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    # (when the saga may be forgotten, tx_id); entries go stale when a saga changes
    forget: list[tuple[int, str]] = field(default_factory=list)
    # tx_id -> when its unchanged status was last published again (kept sagas only)
    refreshed: dict[str, int] = field(default_factory=dict)


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
        for tx_id, saga in part.sagas.items():
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
    """Sagas to forget in this batch: (partition, when due, tx_id)."""
    due: list[tuple[int, int, str]] = []
    for p, part in partitions.items():
        while part.forget and part.forget[0][0] <= now and len(due) < _FORGET_PER_BATCH:
            at, tx_id = heapq.heappop(part.forget)
            saga = part.sagas.get(tx_id)
            # Stale entries (the saga changed since, or is gone) are dropped; a saga
            # changed by this batch is scheduled again when its change is merged.
            if saga is None or tx_id in changed or forget_at(saga) != at:
                continue
            due.append((p, at, tx_id))
    return due
