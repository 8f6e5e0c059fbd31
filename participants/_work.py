"""The work a storage is handed and what it hands back: the items of a batch that are not
barrier signals, the scope an action runs in, and the events to emit (re-exported by
:mod:`participants._storage`, which drives them)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from saga.participants._barrier import PredecessorApplied, Requested, SuccessorCompensated
from saga.streams import Isolation, Outcome, StepStatus


@dataclass(frozen=True, slots=True)
class DecisionArrived:
    """A decision for a transaction; the storage finds this participant's steps in its ledger."""

    tx_id: str
    outcome: Outcome
    now_ms: int


@dataclass(frozen=True, slots=True)
class RequestSeen:
    """A request in which this participant has no step: remember its fingerprint.

    The storage records the transaction-level *seen* marker unless the
    transaction is known here already, so that a later request of the same
    ``tx_id`` with another payload is recognised (and applies nothing).
    """

    tx_id: str
    fingerprint: str
    deadline_ms: int
    now_ms: int


@dataclass(frozen=True, slots=True)
class StepScope:
    """The step an action runs for: its level, and the holder of what it holds."""

    tx_id: str
    step: int
    isolation: Isolation
    deadline_ms: int = 0


WorkItem = Requested | PredecessorApplied | SuccessorCompensated | DecisionArrived | RequestSeen


@dataclass(frozen=True, slots=True)
class Report:
    """A step event to emit once the batch is committed.

    ``confirm`` (with ``applied`` only): the step's action has something to confirm,
    so a commit decision will be answered by ``committed`` (the event says so).
    ``parked``: a decision the store refused, reported for an operator (a metric counts it).
    """

    tx_id: str
    step: int
    status: StepStatus
    reason: str | None = None
    confirm: bool = False
    parked: bool = False


def unique(items: Iterable[WorkItem]) -> list[WorkItem]:
    """Drop exact repeats inside one batch (a redelivered record seen twice)."""
    seen: set[tuple[object, ...]] = set()
    out: list[WorkItem] = []
    for item in items:
        key = (
            type(item).__name__,
            item.tx_id,
            getattr(item, "step", None),
            getattr(item, "outcome", None),
        )
        if key in seen:
            continue
        seen.add(key)
        out.append(item)
    return out
