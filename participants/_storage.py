"""What every storage adapter implements, and the one algorithm that drives it.

A participant hands its storage a batch of *work items* (signals about its own
steps). :class:`LedgerStorage` owns the work: the batch loop, the error boundary,
re-running an item that lost a race, and the policy for a rejected confirmation.
For each item it asks the adapter for a :class:`Unit`, an isolated scope inside
the batch's local atomic unit (an SQL savepoint, a Redis WATCH/MULTI, a MongoDB
transaction or per-document write), and :func:`run_item` does the rest through
it: read the ledger entry, ask the barrier for a plan, run the business effect,
write the ledger entry. Ledger entries are stored with the one codec of
:mod:`participants._ledger`. Only once the batch is done does the runtime emit
the events.

How an adapter plugs in (see :class:`LedgerStorage` for the details)::

    class MyUnit(Unit[MySession]):          # one item's reads and writes, native: MySession
        def entry(...), entries(...), tx_rolled_back(...), known_fingerprint(...),
        def write(...), rollback_effect(...)
        # optional: finish(error) to keep/undo the item, close() to release it

    class MyStorage(LedgerStorage[MySession, MyBatch]):
        driver_errors = (MyDriverError,)          # what translate() handles
        atomic_batch = False                      # True: a batch is one local transaction
        def __init__(self, ..., faults=NO_FAULTS):
            super().__init__(faults=faults)       # then set name, where, actions
        def prepare(self): ...                    # create the ledger, check the targets
        def open_batch(self, items, attempt): ... # context manager: the batch's scope
        def open_unit(self, batch, item, previous): ...
        def translate(self, exc, what): ...       # driver error -> saga error (NoReturn)
        def ledger(...), in_flight_sequential(), prune(...)
        # optional: run_again(unit, exc), mark_seen(batch, items), close()

Built-in actions are described by :mod:`participants._actions` (an adapter
derives ``BuiltinActions[MySession]`` and says how to reach a record); custom
actions by :mod:`participants._handlers` (``combine`` puts both together).
``TypeVar`` comes from ``typing_extensions`` (a dependency of SQLAlchemy) for its
``default=``: an adapter may still name ``Unit`` or ``Actions`` without a type.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from typing import Any, ClassVar, Generic, NoReturn, cast

from typing_extensions import TypeVar

from saga.participants._barrier import (
    Decided,
    Effect,
    LedgerEntry,
    LedgerStatus,
    Requested,
    Signal,
    isolation_of,
    plan,
)
from saga.participants._ledger import rolled_back_marker, seen_marker
from saga.participants._refusals import StoreRefused, run_again_after
from saga.participants._work import DecisionArrived as DecisionArrived  # noqa: PLC0414 - re-exported
from saga.participants._work import Report as Report  # noqa: PLC0414 - re-exported
from saga.participants._work import RequestSeen as RequestSeen  # noqa: PLC0414 - re-exported
from saga.participants._work import StepScope as StepScope  # noqa: PLC0414 - re-exported
from saga.participants._work import WorkItem as WorkItem  # noqa: PLC0414 - re-exported
from saga.streams import BusinessRejection, Outcome, StepStatus, TransientError
from saga.streams._faults import NO_FAULTS, Faults

log = logging.getLogger("saga.participant")

NativeT = TypeVar("NativeT", default=Any)
"""The native session an adapter hands to actions and custom handlers."""
BatchT = TypeVar("BatchT", default=None)
"""What an adapter keeps for one batch (its connection, its view of the ledger)."""


class Actions(ABC, Generic[NativeT]):
    """Runs actions against a storage's native session; built-in and custom alike.

    ``apply`` returns the before-image the compensation needs (JSON-serialisable)
    and raises :class:`BusinessRejection` when the step must fail. ``compensate``
    undoes an applied step from its before-image; ``confirm`` runs on commit.
    """

    @abstractmethod
    def apply(self, native: NativeT, action: str, args: Mapping[str, Any]) -> Any: ...

    @abstractmethod
    def compensate(
        self, native: NativeT, action: str, args: Mapping[str, Any], before: Any
    ) -> None: ...

    @abstractmethod
    def confirm(self, native: NativeT, action: str, args: Mapping[str, Any]) -> None: ...

    def scoped(self, scope: StepScope) -> Actions[NativeT]:
        """These actions as they run for one step: built-in ones hold under ``read_committed``
        and write at once under ``none``; custom handlers are the same at every level
        (they hold in ``try`` and write in ``confirm``). By default: ``self``."""
        return self

    def has_confirm(self, action: str) -> bool:
        """Whether a step of ``action`` has something to confirm on commit.

        A step without (every built-in action) is left as it is by a commit decision:
        no local transaction, no ledger change, no ``committed`` event; its ``applied``
        event says so. The answer must not change while a saga using ``action`` is in
        flight. By default true, the safe side for an :class:`Actions` of unknown
        handlers: every step is confirmed, as before steps could say otherwise.
        """
        return True

    def confirms_any(self) -> bool:
        """Whether any action here has something to confirm (``False``: a commit decision
        needs no work at all). Consistent with :meth:`has_confirm`; by default true."""
        return True


class Unit(ABC, Generic[NativeT]):
    """One work item's isolated scope inside a batch's local atomic unit.

    Reads lock what they read where the storage can (``SELECT ... FOR UPDATE``),
    so two workers never act on one step at once. The markers are written with
    :meth:`write` unless an adapter stores them its own way.
    """

    native: NativeT
    """The storage's own session, handed to actions and custom handlers."""

    @abstractmethod
    def entry(self, tx_id: str, step: int) -> LedgerEntry | None: ...

    @abstractmethod
    def entries(self, tx_id: str) -> list[LedgerEntry]:
        """This participant's step entries of a transaction (not the markers)."""

    @abstractmethod
    def tx_rolled_back(self, tx_id: str) -> bool:
        """Whether a rollback was recorded before this participant knew its steps."""

    def mark_tx_rolled_back(self, tx_id: str, now_ms: int) -> None:
        """Record the rollback marker (the transaction has no step entry here)."""
        self.write(rolled_back_marker(tx_id, now_ms))

    @abstractmethod
    def known_fingerprint(self, tx_id: str) -> str | None:
        """The request fingerprint recorded for the transaction (a step entry or the seen
        marker); ``None`` when none is (unknown here, or recorded before fingerprints)."""

    def mark_tx_seen(self, item: RequestSeen) -> None:
        """Record the seen marker (see :class:`RequestSeen`); the transaction is unknown."""
        self.write(
            seen_marker(
                item.tx_id,
                fingerprint=item.fingerprint,
                deadline_ms=item.deadline_ms,
                now_ms=item.now_ms,
            )
        )

    @abstractmethod
    def write(self, entry: LedgerEntry) -> None: ...

    @abstractmethod
    def rollback_effect(self) -> None:
        """Undo this item's business change (not the batch's): the step is rejected."""

    def finish(self, error: BaseException | None) -> None:
        """The item's attempt ended: keep its work (``error`` is ``None``) or undo what
        this unit holds (``error`` ended it: a rejected confirmation, a lost race, a
        failure). May raise :class:`RunBatchAgain`."""

    def close(self) -> None:
        """Release what the unit holds; called after :meth:`finish`, always."""


class RunBatchAgain(Exception):
    """Raised inside a batch by an adapter: roll the batch back and run it again (the
    adapter's :meth:`LedgerStorage.open_batch` sees the next ``attempt``)."""


class Storage(ABC):
    """A participant's storage as the runtime sees it: the ledger and the business data,
    changed together. Adapters derive from :class:`LedgerStorage`, which implements
    :meth:`execute`."""

    name: str

    @abstractmethod
    def setup(self) -> None:
        """Create the ledger if absent and check the configured targets exist."""

    @abstractmethod
    def execute(self, items: Sequence[WorkItem]) -> list[Report]:
        """Run a batch; return the events to emit.

        Every item takes effect together with its ledger entries, or not at all;
        whether the whole batch is one local atomic unit depends on the adapter
        (:attr:`LedgerStorage.atomic_batch`). Raises :class:`streams.TransientError`
        when the storage is unavailable: the caller retries the batch, which is
        safe either way because the items that took effect find their ledger
        entries and report again.
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

    def has_confirm(self, action: str) -> bool:
        """Whether a step of ``action`` has something to confirm on commit (see
        :meth:`Actions.has_confirm`); by default true."""
        return True

    def needs_decision(self, outcome: Outcome) -> bool:
        """Whether a decision with ``outcome`` may need work here. ``False`` for a commit
        when no action has anything to confirm: such a decision can be dropped unread by
        the storage (a cheap predicate for the runtime; by default true)."""
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class LedgerStorage(Storage, Generic[NativeT, BatchT]):
    """The storage base class: it owns the work, an adapter supplies its unit.

    What it owns:

    * the batch loop (:meth:`execute`): :meth:`setup` on first use, the adapter's
      batch scope, every item in order (repeats included: a repeat re-reports its
      step), runs of :class:`RequestSeen` handed to :meth:`mark_seen` together;
    * re-running an item whose unit lost a race (:meth:`run_again`), at most
      :attr:`max_attempts` times, then a :class:`~streams.TransientError`;
    * the store's refusals (:mod:`participants._refusals`): a step the store refuses
      fails; one that timed out, or a decision the store refuses, is run again
      :attr:`refusal_attempts` times with a doubling backoff, then the refusal is
      recorded on that item alone (the step fails, or the decision is parked and
      reported ``compensation_failed``) and the batch goes on;
    * re-running a whole batch when the adapter raises :class:`RunBatchAgain`;
    * the confirm policy: a custom confirmation that raises
      :class:`~streams.BusinessRejection` leaves its step applied, reports
      nothing and logs it; a replayed commit decision tries it again;
    * the error boundary (:meth:`boundary`): the adapter's :attr:`driver_errors`
      are translated by its :meth:`translate` into the saga error tree;
    * the fault hooks (``faults``), passed to :func:`run_item`.

    What an adapter supplies: ``name``, ``where`` (the store, for messages, never
    a password), ``actions`` (built-in and custom, for its native session),
    :attr:`driver_errors`, :attr:`atomic_batch`, and the methods :meth:`prepare`,
    :meth:`open_batch`, :meth:`open_unit`, :meth:`translate`, :meth:`ledger`,
    :meth:`in_flight_sequential` and :meth:`prune` (the last three inside
    :meth:`boundary`). Ledger entries are stored with :mod:`participants._ledger`.
    """

    where: str
    """The store, for messages (never a password)."""
    actions: Actions[NativeT]
    driver_errors: ClassVar[tuple[type[BaseException], ...]] = ()
    """The driver's exceptions that :meth:`translate` turns into saga errors."""
    atomic_batch: ClassVar[bool] = False
    """Whether a batch is one local atomic unit (else every item is one on its own)."""
    max_attempts: int = 25
    """How often one item is run again after losing a race."""
    refusal_attempts: int = 3
    """How often a step that timed out, or a decision the store refuses, is run."""
    refusal_backoff_s: float = 0.2
    """The wait before the second of those runs; it doubles before each next one."""

    def __init__(self, *, faults: Faults = NO_FAULTS) -> None:
        self.faults = faults
        self._ready = False

    # -- what an adapter supplies

    @abstractmethod
    def prepare(self) -> None:
        """Create the ledger if absent and check the targets; idempotent (see :meth:`setup`)."""

    @abstractmethod
    def open_batch(self, items: Sequence[WorkItem], attempt: int) -> AbstractContextManager[BatchT]:
        """The batch's scope: entered before its first item, left after its last.

        Leaving it normally commits what the batch's scope holds; an exception
        rolls it back. ``attempt`` counts the runs of this batch (0 first; see
        :class:`RunBatchAgain`).
        """

    @abstractmethod
    def open_unit(
        self, batch: BatchT, item: WorkItem, previous: Unit[NativeT] | None
    ) -> Unit[NativeT]:
        """A fresh unit for one attempt of ``item``; ``previous`` is the unit of the
        attempt before (it lost a race, see :meth:`run_again`), else ``None``."""

    @abstractmethod
    def translate(self, exc: BaseException, what: str) -> NoReturn:
        """Raise the saga error for driver error ``exc`` met while trying to ``what``:
        :class:`~streams.TransientError` (retry), :class:`~streams.ConfigurationError`
        (fix the setup) or :class:`~streams.BusinessRejection`."""

    def run_again(self, unit: Unit[NativeT], exc: Exception) -> bool:
        """Whether ``exc``, which ended ``unit``'s attempt, means *run the item again*
        (another writer won a race); the default: never."""
        return False

    def mark_seen(self, batch: BatchT, items: Sequence[RequestSeen]) -> None:
        """Record a run of requests without a step here; by default one by one through
        :func:`run_item`. An adapter may write them together."""
        for item in items:
            self.run_one(batch, item)

    # -- what it owns

    def setup(self) -> None:
        """Create the ledger if absent and check the configured targets exist; idempotent.

        Raises :class:`~streams.ConfigurationError` naming what to fix, and
        :class:`~streams.TransientError` when the store is unreachable.
        """
        self.prepare()
        self._ready = True

    def has_confirm(self, action: str) -> bool:
        return self.actions.has_confirm(action)

    def needs_decision(self, outcome: Outcome) -> bool:
        return outcome is not Outcome.COMMIT or self.actions.confirms_any()

    def execute(self, items: Sequence[WorkItem]) -> list[Report]:
        """Run the batch (see :meth:`Storage.execute` and the class doc).

        Commit decisions are dropped first when no action here has anything to
        confirm (:meth:`needs_decision`): a batch of only those costs no round trip.
        """
        items = [
            item
            for item in items
            if not isinstance(item, DecisionArrived) or self.needs_decision(item.outcome)
        ]
        if not items:
            return []
        if not self._ready:
            self.setup()
        attempt = 0
        while True:
            try:
                with self.boundary("run a batch"):
                    return self._batch(items, attempt)
            except RunBatchAgain:
                attempt += 1
                if attempt >= self.max_attempts:
                    raise

    def settled(self, batch: BatchT) -> Mapping[str, list[Report]]:
        """The events of the commit decisions the adapter settled for the whole batch when
        it opened it, by transaction (each the batch's only item of its transaction): the
        loop reports them instead of running those decisions. None by default."""
        return {}

    def _batch(self, items: Sequence[WorkItem], attempt: int) -> list[Report]:
        reports: list[Report] = []
        with self.open_batch(items, attempt) as batch:
            seen: list[RequestSeen] = []
            settled = self.settled(batch)
            for item in items:
                if settled and isinstance(item, DecisionArrived) and item.tx_id in settled:
                    reports.extend(settled[item.tx_id])
                    continue
                if isinstance(item, RequestSeen):
                    seen.append(item)
                    continue
                if seen:  # before any item that may read those ledgers
                    self.mark_seen(batch, seen)
                    seen = []
                reports.extend(self.run_one(batch, item))
            if seen:
                self.mark_seen(batch, seen)
        return reports

    def run_one(self, batch: BatchT, item: WorkItem) -> list[Report]:
        """Run one item in a unit of its own, again while it loses races or the store
        refuses it for a while (see the class doc)."""
        previous: Unit[NativeT] | None = None
        refusals, spent = 0, cast(StoreRefused | None, None)
        for _ in range(self.max_attempts):
            unit = self.open_unit(batch, item, previous)
            try:
                reports = run_item(unit, self.actions, item, self.faults, spent)
            except StoreRefused as exc:  # let through by run_item: another run may pass
                unit.finish(exc)
                refusals += 1
                if not run_again_after(self.name, item.tx_id, exc, refusals, self):
                    spent = exc  # recorded on the next run
                previous = unit
                continue
            except BusinessRejection as exc:
                # run_item turns rejections of apply and compensate into events; only a
                # custom confirm gets here. The step stays applied, nothing is reported,
                # and a replayed commit decision tries the confirmation again.
                unit.finish(exc)
                log.error(
                    "participant %r: confirming %s was rejected and is left for a replayed "
                    "decision: %s",
                    self.name,
                    item.tx_id,
                    exc.reason,
                )
                return []
            except Exception as exc:
                unit.finish(exc)
                if not self.run_again(unit, exc):
                    raise
                previous = unit
                continue
            except BaseException as exc:
                unit.finish(exc)
                raise
            else:
                unit.finish(None)
                return reports
            finally:
                unit.close()
        raise TransientError(
            f"participant {self.name!r}: {item.tx_id} kept conflicting with other writers on "
            f"{self.where} ({self.max_attempts} attempts); retrying the batch is safe"
        )

    @contextmanager
    def boundary(self, what: str) -> Iterator[None]:
        """Translate the driver's errors into the saga error tree (:meth:`translate`)."""
        try:
            yield
        except self.driver_errors as exc:
            self.translate(exc, what)


def run_item(
    unit: Unit[NativeT],
    actions: Actions[NativeT],
    item: WorkItem,
    faults: Faults = NO_FAULTS,
    spent: StoreRefused | None = None,
) -> list[Report]:
    """Drive one work item through the barrier inside ``unit``; return what to report.

    A :class:`StoreRefused` from a step's effect that another run may pass (a timeout; a
    decision's) is raised, naming its step, for the caller to run the item again; given
    back as ``spent``, it is recorded on that step instead of running the effect.
    ``faults.unsafe("barrier-off")`` (a test's negative control only) makes requests
    ignore the ledger.
    """
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
            view = actions.scoped(scope_of(known))
            confirm = known.action is not None and view.has_confirm(known.action)
            signal = Decided(item.tx_id, known.step, item.outcome, item.now_ms, confirm)
            reports.extend(_run_signal(unit, view, known, signal, faults, spent))
        return reports
    entry = unit.entry(item.tx_id, item.step)
    if isinstance(item, Requested):
        actions = actions.scoped(StepScope(item.tx_id, item.step, item.isolation, item.deadline_ms))
    elif entry is not None:
        actions = actions.scoped(scope_of(entry))
    return _run_signal(unit, actions, entry, item, faults, spent)


def _again_if_it_may_pass(
    exc: BusinessRejection, spent: StoreRefused | None, step: int, *, decision: bool
) -> None:
    """Raise a store's refusal that another run of the item may pass (a timeout; any
    refusal of a decision) for :meth:`LedgerStorage.run_one`, unless it is ``spent``."""
    if isinstance(exc, StoreRefused) and exc is not spent and (decision or exc.timeout):
        exc.step = step
        raise exc


def scope_of(entry: LedgerEntry) -> StepScope:
    """The scope a recorded step's actions run in (its level is in its ``before``)."""
    return StepScope(entry.tx_id, entry.step, isolation_of(entry.before), entry.deadline_ms)


def _run_signal(
    unit: Unit[NativeT],
    actions: Actions[NativeT],
    entry: LedgerEntry | None,
    signal: Signal,
    faults: Faults,
    spent: StoreRefused | None = None,
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
        if spent is not None and spent.step != target.step:
            spent = None  # another step's
        if p.effect is Effect.APPLY:
            try:
                if isinstance(signal, Requested) and signal.fail_reason is not None:
                    raise BusinessRejection(signal.fail_reason)
                if spent is not None:
                    raise spent
                before = actions.apply(unit.native, action, args)
            except BusinessRejection as exc:
                _again_if_it_may_pass(exc, spent, target.step, decision=False)
                unit.rollback_effect()
                failed = replace(
                    target, status=LedgerStatus.FAILED, effect=False, reason=exc.reason
                )
                unit.write(failed)
                return [Report(target.tx_id, target.step, StepStatus.FAILED, exc.reason)]
            target = replace(target, before=before)
        elif p.effect is Effect.COMPENSATE:
            try:
                if spent is not None:
                    raise spent
                actions.compensate(unit.native, action, args, target.before)
            except BusinessRejection as exc:
                _again_if_it_may_pass(exc, spent, target.step, decision=True)
                unit.rollback_effect()
                stuck = replace(
                    target,
                    status=LedgerStatus.COMPENSATION_FAILED,
                    reason=f"compensation failed: {exc.reason}",
                )
                unit.write(stuck)
                parked = isinstance(exc, StoreRefused)
                status = StepStatus.COMPENSATION_FAILED
                return [Report(target.tx_id, target.step, status, stuck.reason, parked=parked)]
        elif p.effect is Effect.CONFIRM:
            try:
                if spent is not None:
                    raise spent
                actions.confirm(unit.native, action, args)
            except StoreRefused as exc:
                # Parked: the step stays applied (its hold kept), so a re-driven or
                # replayed decision tries again; reported so that an operator sees it.
                _again_if_it_may_pass(exc, spent, target.step, decision=True)
                unit.rollback_effect()
                why = f"commit refused, left applied for a re-driven decision: {exc.reason}"
                status = StepStatus.COMPENSATION_FAILED
                return [Report(target.tx_id, target.step, status, why, parked=True)]
    if target is not None:
        unit.write(target)
    if p.emit is None:
        return []
    reason = target.reason if target is not None else (entry.reason if entry else None)
    if p.emit not in (StepStatus.FAILED, StepStatus.COMPENSATION_FAILED):
        reason = None
    # `applied` says whether a commit will be confirmed; a repeat says it again, the same
    # way, from the recorded action (the answer is a property of the configured actions).
    recorded = target if target is not None else entry
    confirm = (
        p.emit is StepStatus.APPLIED
        and recorded is not None
        and recorded.action is not None
        and actions.has_confirm(recorded.action)
    )
    return [Report(signal.tx_id, signal.step, p.emit, reason, confirm)]
