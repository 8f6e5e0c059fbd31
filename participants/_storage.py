"""What every storage adapter implements, and the one algorithm that drives it.

A participant hands its storage a batch of *work items* (signals about its own
steps). For each item the storage opens an isolated scope inside the batch's
local atomic unit (an SQL savepoint, a Redis WATCH/MULTI, a MongoDB transaction
or per-document write), and :func:`run_item` does the rest through the
:class:`Unit` interface: read the ledger entry, ask the barrier for a plan, run
the business effect, write the ledger entry. The batch's changes and ledger
records commit together; only then does the runtime emit the events.

Adapters implement :class:`Storage` (batch lifecycle) and :class:`Unit` (one
item's reads and writes). Built-in actions are described by
:mod:`participants._actions`; custom actions by :mod:`participants._handlers`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from participants._barrier import (
    Decided,
    Effect,
    LedgerEntry,
    LedgerStatus,
    PredecessorApplied,
    Requested,
    Signal,
    SuccessorCompensated,
    plan,
)
from streams import BusinessRejection, Outcome, StepStatus
from streams import _faults as faults


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


WorkItem = Requested | PredecessorApplied | SuccessorCompensated | DecisionArrived | RequestSeen


@dataclass(frozen=True, slots=True)
class Report:
    """A step event to emit once the batch is committed."""

    tx_id: str
    step: int
    status: StepStatus
    reason: str | None = None


class Actions(ABC):
    """Runs actions against a storage's native session; built-in and custom alike.

    ``apply`` returns the before-image the compensation needs (JSON-serialisable)
    and raises :class:`BusinessRejection` when the step must fail. ``compensate``
    undoes an applied step from its before-image; ``confirm`` runs on commit.
    """

    @abstractmethod
    def apply(self, native: Any, action: str, args: Mapping[str, Any]) -> Any: ...

    @abstractmethod
    def compensate(
        self, native: Any, action: str, args: Mapping[str, Any], before: Any
    ) -> None: ...

    @abstractmethod
    def confirm(self, native: Any, action: str, args: Mapping[str, Any]) -> None: ...


class Unit(ABC):
    """One work item's isolated scope inside a batch's local atomic unit.

    Reads lock what they read where the storage can (``SELECT ... FOR UPDATE``),
    so two workers never act on one step at once.
    """

    native: Any
    """The storage's own session/connection, handed to custom handlers."""

    @abstractmethod
    def entry(self, tx_id: str, step: int) -> LedgerEntry | None: ...

    @abstractmethod
    def entries(self, tx_id: str) -> list[LedgerEntry]:
        """This participant's step entries of a transaction (not the marker)."""

    @abstractmethod
    def tx_rolled_back(self, tx_id: str) -> bool:
        """Whether a rollback was recorded before this participant knew its steps."""

    @abstractmethod
    def mark_tx_rolled_back(self, tx_id: str, now_ms: int) -> None: ...

    @abstractmethod
    def known_fingerprint(self, tx_id: str) -> str | None:
        """The request fingerprint recorded for the transaction (a step entry or the seen
        marker); ``None`` when none is (unknown here, or recorded before fingerprints)."""

    @abstractmethod
    def mark_tx_seen(self, item: RequestSeen) -> None:
        """Record the seen marker (see :class:`RequestSeen`); the transaction is unknown."""

    @abstractmethod
    def write(self, entry: LedgerEntry) -> None: ...

    @abstractmethod
    def rollback_effect(self) -> None:
        """Undo this item's business change (not the batch's): the step is rejected."""


class Storage(ABC):
    """A participant's storage: the ledger and the business data, changed together."""

    name: str

    @abstractmethod
    def setup(self) -> None:
        """Create the ledger if absent and check the configured targets exist."""

    @abstractmethod
    def execute(self, items: Sequence[WorkItem]) -> list[Report]:
        """Run a batch in one local atomic unit (per-item isolation); return the events.

        Raises :class:`streams.TransientError` when the storage is unavailable:
        nothing of the batch took effect and the caller retries it.
        """

    @abstractmethod
    def ledger(self, tx_id: str | None = None) -> list[LedgerEntry]:
        """The ledger's step entries (of one transaction, or all): for audits and tests."""

    @abstractmethod
    def in_flight_sequential(self) -> set[str]:
        """Transactions with a step waiting on a neighbour (sequential sagas)."""

    @abstractmethod
    def prune(self, horizon_ms: int, limit: int) -> int:
        """Remove up to ``limit`` ledger entries (steps and markers) that finished at or
        before ``horizon_ms`` (:func:`participants._barrier.finished_ms`); return how many.

        The runtime passes ``now - retention``; see *Retention* in
        :mod:`participants._barrier` for why that is safe.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


def run_item(unit: Unit, actions: Actions, item: WorkItem) -> list[Report]:
    """Drive one work item through the barrier inside ``unit``; return what to report."""
    if isinstance(item, RequestSeen):
        if unit.known_fingerprint(item.tx_id) is None and not unit.entries(item.tx_id):
            unit.mark_tx_seen(item)
        return []
    if isinstance(item, DecisionArrived):
        entries = unit.entries(item.tx_id)
        if not entries:
            if item.outcome is Outcome.ROLLBACK:
                unit.mark_tx_rolled_back(item.tx_id, item.now_ms)
            return []
        reports: list[Report] = []
        for known in entries:
            signal = Decided(item.tx_id, known.step, item.outcome, item.now_ms)
            reports.extend(_run_signal(unit, actions, known, signal))
        return reports
    return _run_signal(unit, actions, unit.entry(item.tx_id, item.step), item)


def _run_signal(
    unit: Unit, actions: Actions, entry: LedgerEntry | None, signal: Signal
) -> list[Report]:
    rolled_back = (
        isinstance(signal, Requested) and entry is None and unit.tx_rolled_back(signal.tx_id)
    )
    known = unit.known_fingerprint(signal.tx_id) if isinstance(signal, Requested) else None
    if isinstance(signal, Requested) and faults.unsafe("barrier-off"):
        # TEST-ONLY negative control: ignore the ledger
        entry, rolled_back, known = None, False, None
    p = plan(entry, rolled_back, signal, known)
    target = p.entry
    if target is not None and target.action is not None:
        action, args = target.action, target.args or {}
        if p.effect is Effect.APPLY:
            try:
                if isinstance(signal, Requested) and signal.fail_reason is not None:
                    raise BusinessRejection(signal.fail_reason)
                before = actions.apply(unit.native, action, args)
            except BusinessRejection as exc:
                unit.rollback_effect()
                failed = replace(
                    target, status=LedgerStatus.FAILED, effect=False, reason=exc.reason
                )
                unit.write(failed)
                return [Report(target.tx_id, target.step, StepStatus.FAILED, exc.reason)]
            target = replace(target, before=before)
        elif p.effect is Effect.COMPENSATE:
            try:
                actions.compensate(unit.native, action, args, target.before)
            except BusinessRejection as exc:
                unit.rollback_effect()
                stuck = replace(
                    target,
                    status=LedgerStatus.COMPENSATION_FAILED,
                    reason=f"compensation failed: {exc.reason}",
                )
                unit.write(stuck)
                return [
                    Report(
                        target.tx_id,
                        target.step,
                        StepStatus.COMPENSATION_FAILED,
                        stuck.reason,
                    )
                ]
        elif p.effect is Effect.CONFIRM:
            actions.confirm(unit.native, action, args)
    if target is not None:
        unit.write(target)
    if p.emit is None:
        return []
    reason = target.reason if target is not None else (entry.reason if entry else None)
    if p.emit not in (StepStatus.FAILED, StepStatus.COMPENSATION_FAILED):
        reason = None
    return [Report(signal.tx_id, signal.step, p.emit, reason)]


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
