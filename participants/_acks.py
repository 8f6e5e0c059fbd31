"""Commits acknowledged together: one ``saga.committed`` record per batch and partition.

A participant applies the commit decisions of a batch in one local transaction, so
it acknowledges them together: instead of one ``committed`` step event per step, one
:class:`~streams.StepsCommitted` per events partition lists the ``(tx_id, step)``
pairs whose sagas live there (the coordinator that owns the partition reads them
all). A report with a reason, and every other status, still goes as a step event.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from saga.participants._storage import Report
from saga.streams import StepsCommitted, StepStatus
from saga.streams.kafka import partition_for

ACKS_PER_RECORD: Final = 500
"""Most steps one ``saga.committed`` lists (its schema allows 1,000): a few tens of
kilobytes at most, far below the record size limit."""


def acknowledgements(
    name: str, at_ms: int, reports: Sequence[Report], partitions: int
) -> tuple[list[Report], list[tuple[StepsCommitted, Report | None]]]:
    """The reports still sent as step events, and the ``saga.committed`` records of the rest.

    A record comes with a report when it lists the steps of one saga: it carries that
    saga's trace context then, as its step events would have; one listing several
    sagas carries none.
    """
    events: list[Report] = []
    by_partition: dict[int, list[Report]] = {}
    for r in reports:
        if r.status is StepStatus.COMMITTED and r.reason is None:
            by_partition.setdefault(partition_for(r.tx_id.encode(), partitions), []).append(r)
        else:
            events.append(r)
    acks: list[tuple[StepsCommitted, Report | None]] = []
    for committed in by_partition.values():
        for at in range(0, len(committed), ACKS_PER_RECORD):
            chunk = committed[at : at + ACKS_PER_RECORD]
            steps = tuple(dict.fromkeys((r.tx_id, r.step) for r in chunk))
            one_saga = len({tx_id for tx_id, _ in steps}) == 1
            acks.append((StepsCommitted(name, at_ms, steps), chunk[0] if one_saga else None))
    return events, acks
