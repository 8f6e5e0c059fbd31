"""The saga state machine: a pure function of its inputs.

``decide(saga, input) -> (saga, outputs)`` holds every rule of the coordinator
and nothing else: no I/O, no clock reads, no id generation. Time arrives inside
the input (``at_ms`` / ``now_ms``). The service around it (``_service``) feeds
it what it consumes and produces what it returns, inside Kafka transactions.

Rules (docs/architecture.md §2, §6):

* every step ``applied`` and no decision yet -> ``commit``;
* the first ``failed`` step, an operator abort, or the deadline passing before
  a decision -> ``rollback``; a step reported ``compensated`` before any
  decision also forces ``rollback`` (a commit could no longer hold);
* at most one decision per transaction, ever: later inputs never change it;
* a repeated request (same payload) changes nothing; its status is published again;
* after ``commit`` the saga is ``committed`` once every step is ``committed``. A step
  whose ``applied`` event did not say ``confirm`` has nothing to confirm: its
  participant does nothing on commit and sends no ``committed`` event, so the
  machine marks it ``committed`` itself when it decides. A commit in which no step
  said ``confirm`` is therefore ``committed`` at once: the decision and the final
  status leave in the same Kafka transaction (no ``committing`` record);
  after ``rollback`` it is ``rolled_back`` once every step is ``compensated``, or
  ``failed`` when a compensation could not be completed (in a sequential saga, also
  when the steps left wait behind one: ``_sequential``);
* a step naming a participant that does not exist counts as compensated, and its saga
  rolls back: when the request comes (the names known at once), or when the wait for
  its participants ends (``ParticipantsMissing``, for a step still pending);
* an operator's ``saga.resolve`` of a ``failed`` saga marks a step whose
  compensation failed ``resolved`` (handled by hand); with no failed step left
  the saga is ``rolled_back``, its reason naming who resolved it. A resolve of
  anything else changes nothing and is reported (``Ignored``: the DLQ).

A step event may arrive before its request (topics are read concurrently): the
machine keeps a published *placeholder* saga (``request_seen`` false) recording the
events, and counts them with the request's checks when it comes; nothing is decided
on an early event.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from saga.coordinator._machine_io import (
    AbortRequested,
    Ignored,
    Input,
    Output,
    ParticipantsMissing,
    RequestReceived,
    ResolveRequested,
    StepReported,
    Tick,
    input_of,
    tx_of,
)
from saga.coordinator._sequential import blocked_by_failure
from saga.streams import (
    MAX_REASON_CHARS,
    Decision,
    Mode,
    Outcome,
    SagaRequest,
    SagaResolve,
    SagaState,
    SagaStatus,
    StepEvent,
    StepProgress,
    StepStatus,
)

__all__ = [
    "UNKNOWN_PARTICIPANT",
    "AbortRequested",
    "Ignored",
    "Input",
    "Output",
    "ParticipantsMissing",
    "RequestReceived",
    "ResolveRequested",
    "Saga",
    "StepReported",
    "Tick",
    "decide",
    "input_of",
    "tx_of",
]

UNKNOWN_PARTICIPANT = "?"
"""Participant name of a step known only from an early event's index."""

_OPERATOR_MUST_ACT = "; compensation of step(s) {} failed: an operator must act"

# A decision's reason quotes what it was given (a failed step's reason, an abort's,
# participant names): cut so that it, and the status reason that adds the operator
# note for up to 64 steps, stay within the wire contract's limit.
_DECISION_REASON_CHARS = MAX_REASON_CHARS - 400

# How far a step has come; a report never moves a step backwards.
_RANK = {
    StepStatus.PENDING: 0,
    StepStatus.APPLIED: 1,
    StepStatus.FAILED: 1,
    StepStatus.COMPENSATION_FAILED: 2,
    StepStatus.COMMITTED: 3,
    StepStatus.COMPENSATED: 3,
    StepStatus.RESOLVED: 3,
}
_CLOSED_BY_ROLLBACK = (StepStatus.COMPENSATED, StepStatus.RESOLVED)


# ---------------------------------------------------------------- state


@dataclass(frozen=True, slots=True)
class Saga:
    """The coordinator's view of one transaction."""

    tx_id: str
    saga: str
    request_seen: bool
    participants: tuple[str, ...]
    steps: tuple[StepStatus, ...]
    outcome: Outcome | None
    state: SagaState
    reason: str | None
    created_ms: int
    updated_ms: int
    deadline_ms: int
    fingerprint: str | None
    early: tuple[StepEvent, ...] = ()
    """Step events seen before the request, checked and counted when it arrives."""
    confirms: tuple[bool, ...] = ()
    """Per step: the event that moved it said ``confirm`` (only ``applied`` events do: a
    ``committed`` event will follow a commit). Empty is read as all false."""
    mode: Mode | None = field(default=None, compare=False)
    """The request's mode (not published, so not part of the state: None after a restore,
    read as sequential)."""

    @property
    def decided(self) -> bool:
        return self.outcome is not None

    def status(self) -> SagaStatus:
        """The record that publishes this state on the status topic."""
        return SagaStatus(
            tx_id=self.tx_id,
            saga=self.saga,
            state=self.state,
            steps=tuple(
                StepProgress(participant=p, status=s, confirm=self.confirm_of(i))
                for i, (p, s) in enumerate(zip(self.participants, self.steps, strict=True))
            ),
            reason=self.reason,
            created_ms=self.created_ms,
            updated_ms=self.updated_ms,
            deadline_ms=self.deadline_ms,
            fingerprint=self.fingerprint,
        )

    def confirm_of(self, step: int) -> bool:
        """Whether ``step``'s ``applied`` event said it has something to confirm."""
        return step < len(self.confirms) and self.confirms[step]

    @classmethod
    def ended(cls, **fields: Any) -> Saga:
        """What :meth:`from_status` rebuilds from a final status whose request was seen, from
        plain fields (not ``request_seen``, ``outcome``, ``early``; coordinator._finished)."""
        outcome = Outcome.COMMIT if fields["state"] is SagaState.COMMITTED else Outcome.ROLLBACK
        made = cls(request_seen=True, outcome=outcome, **fields)
        return _committed_if_nothing_to_confirm(made, made.updated_ms)

    @classmethod
    def from_status(cls, status: SagaStatus) -> Saga:
        """Rebuild the state that published ``status`` (restart, rebalance)."""
        outcome: Outcome | None
        if status.state in (SagaState.COMMITTING, SagaState.COMMITTED):
            outcome = Outcome.COMMIT
        elif status.state in (SagaState.ROLLING_BACK, SagaState.ROLLED_BACK, SagaState.FAILED):
            outcome = Outcome.ROLLBACK
        else:
            outcome = None
        saga = cls(
            tx_id=status.tx_id,
            saga=status.saga,
            request_seen=status.fingerprint is not None,
            participants=tuple(s.participant for s in status.steps),
            steps=tuple(s.status for s in status.steps),
            confirms=tuple(s.confirm for s in status.steps),
            outcome=outcome,
            state=status.state,
            reason=status.reason,
            created_ms=status.created_ms,
            updated_ms=status.updated_ms,
            deadline_ms=status.deadline_ms,
            fingerprint=status.fingerprint,
            early=()
            if status.fingerprint is not None
            else tuple(
                StepEvent(
                    status.tx_id, i, p.participant, p.status, status.updated_ms, confirm=p.confirm
                )
                for i, p in enumerate(status.steps)
                if p.status is not StepStatus.PENDING and p.participant != UNKNOWN_PARTICIPANT
            ),
        )
        # A status written before steps said `confirm` (an older coordinator) waits for a
        # `committed` event from every step; the steps' participants send none now.
        return _committed_if_nothing_to_confirm(saga, saga.updated_ms)


def _new_from_request(request: SagaRequest, at_ms: int) -> Saga:
    return Saga(
        tx_id=request.tx_id,
        saga=request.saga,
        request_seen=True,
        participants=tuple(s.participant for s in request.steps),
        steps=(StepStatus.PENDING,) * len(request.steps),
        confirms=(False,) * len(request.steps),
        outcome=None,
        state=SagaState.PENDING,
        reason=None,
        created_ms=request.created_ms,
        updated_ms=at_ms,
        deadline_ms=request.deadline_ms,
        fingerprint=request.fingerprint(),
        mode=request.mode,
    )


def _placeholder(tx_id: str, at_ms: int) -> Saga:
    return Saga(
        tx_id=tx_id,
        saga="",
        request_seen=False,
        participants=(),
        steps=(),
        outcome=None,
        state=SagaState.PENDING,
        reason="request not seen yet",
        created_ms=at_ms,
        updated_ms=at_ms,
        deadline_ms=0,
        fingerprint=None,
    )


# ---------------------------------------------------------------- transitions


def decide(saga: Saga | None, inp: Input) -> tuple[Saga | None, list[Output]]:
    """Apply one input to one transaction's state.

    Returns the new state and what to publish: at most one ``Decision`` (only when
    the transaction is decided by this very input), a ``SagaStatus`` when the state
    changed (or for a repeated request), and ``Ignored`` notes for inputs that change
    nothing worth reporting. ``saga`` is ``None`` for a transaction not seen before.
    """
    if isinstance(inp, RequestReceived):
        if saga is not None and saga.request_seen:
            if saga.fingerprint == inp.request.fingerprint():
                return saga, [saga.status()]  # a repeat: nothing changes, the sender learns
            return saga, [
                Ignored(
                    inp.request.tx_id,
                    f"transaction {inp.request.tx_id} was already submitted with a different "
                    "payload; the new request is ignored",
                )
            ]
        after = _on_request(saga, inp)
        unknown = [
            i
            for i, p in enumerate(after.participants)
            if inp.known is not None and p not in inp.known
        ]
        after, voided = _void_unknown(after, unknown, inp.unknown_why, inp.at_ms)
        before, after = saga, _settle(after, inp.at_ms)
        return after, [*_outputs(before, after), *voided]
    elif isinstance(inp, StepReported):
        before = saga
        result = _on_step(saga, inp)
        if isinstance(result, Ignored):
            return saga, [result]
        after = _settle(result, inp.at_ms)
    elif isinstance(inp, AbortRequested):
        before = saga
        if saga is None:
            # The request may still come: record the abort by deciding now, so
            # the request, when it arrives, finds the rollback.
            saga = _placeholder(inp.abort.tx_id, inp.abort.at_ms)
        if saga.decided:
            return saga, [
                Ignored(saga.tx_id, f"abort of {saga.tx_id} ignored: it is already decided")
            ]
        by = f" {inp.abort.by}" if inp.abort.by else ""
        reason = f"aborted by operator{by}" + (f": {inp.abort.reason}" if inp.abort.reason else "")
        after = _settle(_decide(saga, Outcome.ROLLBACK, reason, inp.abort.at_ms), inp.abort.at_ms)
    elif isinstance(inp, ParticipantsMissing):
        if saga is None or not saga.request_seen:
            return saga, []
        unknown = [
            i
            for i, (p, s) in enumerate(zip(saga.participants, saga.steps, strict=True))
            if s is StepStatus.PENDING and p not in inp.known
        ]
        if not unknown:
            return saga, []
        after, voided = _void_unknown(saga, unknown, inp.why, inp.at_ms)
        after = _settle(replace(after, updated_ms=inp.at_ms), inp.at_ms)
        return after, [*_outputs(saga, after), *voided]
    elif isinstance(inp, ResolveRequested):
        before = saga
        resolved = _on_resolve(saga, inp.resolve)
        if isinstance(resolved, Ignored):
            return saga, [resolved]
        after = resolved
    else:
        if saga is None:
            return None, []
        before, after = saga, _settle(saga, inp.now_ms)
    return after, _outputs(before, after)


def _on_resolve(saga: Saga | None, resolve: SagaResolve) -> Saga | Ignored:
    """Mark ``resolve.step`` resolved, or say why the resolve cannot be honoured."""
    tx_id, step = resolve.tx_id, resolve.step
    if saga is None or not saga.request_seen:
        return Ignored(tx_id, f"resolve of {tx_id} ignored: the coordinator knows no such saga")
    if saga.state is not SagaState.FAILED:
        return Ignored(
            tx_id,
            f"resolve of {tx_id} ignored: it is {saga.state.value}, not failed; only a failed "
            "compensation can be resolved by hand",
        )
    if step >= len(saga.steps) or saga.steps[step] is not StepStatus.COMPENSATION_FAILED:
        failed = [i for i, s in enumerate(saga.steps) if s is StepStatus.COMPENSATION_FAILED]
        return Ignored(
            tx_id,
            f"resolve of {tx_id} ignored: step {step} has no failed compensation "
            f"(those that do: {failed})",
        )
    steps = list(saga.steps)
    steps[step] = StepStatus.RESOLVED
    saga = replace(saga, steps=tuple(steps), updated_ms=resolve.at_ms)
    base = (saga.reason or "").split(_OPERATOR_MUST_ACT.split("{", maxsplit=1)[0])[0]
    left = [i for i, s in enumerate(saga.steps) if s is StepStatus.COMPENSATION_FAILED]
    if left:  # still failed: the operator note names only the steps left
        return replace(saga, reason=f"{base}{_OPERATOR_MUST_ACT.format(left)}")
    reason = f"{base}; failed compensation resolved by hand by {resolve.by}"
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[: MAX_REASON_CHARS - 3] + "..."
    return replace(saga, state=SagaState.ROLLED_BACK, reason=reason)


def _void_unknown(
    saga: Saga, unknown: list[int], why: str | None, at_ms: int
) -> tuple[Saga, list[Output]]:
    """``saga`` with its steps ``unknown`` (of participants that do not exist) compensated
    and, if undecided, rolled back; and, unless it is known to be parallel, a
    ``compensated`` report of each (the step before waits for it: sequential)."""
    if not unknown:
        return saga, []
    steps = list(saga.steps)
    for i in unknown:
        steps[i] = StepStatus.COMPENSATED
    saga = replace(saga, steps=tuple(steps))
    if not saga.decided:
        saga = _decide(saga, Outcome.ROLLBACK, _unknown_reason(saga, unknown, why), at_ms)
    if saga.mode is Mode.PARALLEL:
        return saga, []
    note = "nothing to compensate: no such participant (reported by the coordinator)"
    return saga, [
        StepEvent(saga.tx_id, i, saga.participants[i], StepStatus.COMPENSATED, at_ms, note)
        for i in unknown
    ]


def _unknown_reason(saga: Saga, unknown: list[int], why: str | None) -> str:
    # The audit (streams/reconcile/_audit.py) reads the names after the last
    # "names unknown participant(s): ", up to the end: that part stays last.
    names = sorted({saga.participants[i] for i in unknown})
    listed = ", ".join(names)
    tail = f"step {unknown[0]} names unknown participant(s): {listed}"
    if why is None:
        return tail
    quoted = ", ".join(repr(n) for n in names)
    return f"unknown participant {quoted}: {why}; {tail}"


def _on_request(saga: Saga | None, inp: RequestReceived) -> Saga:
    request = inp.request
    fresh = _new_from_request(request, inp.at_ms)
    if saga is None:
        return fresh
    # Complete a placeholder: keep an early decision (an abort), then count the
    # early step events as if they came now, with the request's checks.
    after = replace(
        fresh,
        outcome=saga.outcome,
        state=saga.state,
        reason=saga.reason if saga.decided else None,
    )
    # In step order, not arrival order: a coordinator restored from the status
    # topic knows only the steps, and must decide the same way.
    for event in sorted(saga.early, key=lambda e: e.step):
        result = _on_step(after, StepReported(event, inp.at_ms))
        if not isinstance(result, Ignored):
            after = result
    return after


def _on_step(saga: Saga | None, inp: StepReported) -> Saga | Ignored:
    event = inp.event
    if saga is None:
        saga = _placeholder(event.tx_id, inp.at_ms)
    if not saga.request_seen:
        return _remember_early(saga, event, inp.at_ms)
    if event.step >= len(saga.steps):
        return Ignored(
            event.tx_id,
            f"step {event.step} of {event.tx_id} does not exist "
            f"(the request has {len(saga.steps)} steps)",
        )
    if saga.participants[event.step] != event.participant:
        return Ignored(
            event.tx_id,
            f"step {event.step} of {event.tx_id} belongs to "
            f"{saga.participants[event.step]!r}, not {event.participant!r}",
        )
    current = saga.steps[event.step]
    if not _advances(current, event.status):
        return saga
    steps = list(saga.steps)
    steps[event.step] = event.status
    participants = list(saga.participants)
    participants[event.step] = event.participant
    saga = replace(
        saga,
        steps=tuple(steps),
        participants=tuple(participants),
        confirms=_with_confirm(saga, event),
        updated_ms=inp.at_ms,
    )

    if not saga.decided:
        if event.status is StepStatus.FAILED:
            reason = f"step {event.step} failed" + (f": {event.reason}" if event.reason else "")
            saga = _decide(saga, Outcome.ROLLBACK, reason, inp.at_ms)
        elif event.status in (StepStatus.COMPENSATED, StepStatus.COMPENSATION_FAILED):
            saga = _decide(
                saga,
                Outcome.ROLLBACK,
                f"step {event.step} was compensated before a decision",
                inp.at_ms,
            )
    return saga


def _remember_early(saga: Saga, event: StepEvent, at_ms: int) -> Saga:
    """Keep an event that came before its request (whose checks it awaits); decide nothing.
    The published placeholder shows the latest report per step, for a restarted coordinator."""
    if any(
        e.step == event.step and e.participant == event.participant and e.status == event.status
        for e in saga.early
    ):
        return saga
    steps, participants = list(saga.steps), list(saga.participants)
    confirms = [saga.confirm_of(i) for i in range(len(steps))]
    if event.step >= len(steps):
        grow = event.step + 1 - len(steps)
        steps += [StepStatus.PENDING] * grow
        participants += [UNKNOWN_PARTICIPANT] * grow
        confirms += [False] * grow
    same = participants[event.step] == event.participant
    if not same or _advances(steps[event.step], event.status):
        steps[event.step] = event.status
        participants[event.step] = event.participant
        # The published placeholder carries the flag, so a restore keeps it with the event.
        confirms[event.step] = event.confirm
    return replace(
        saga,
        steps=tuple(steps),
        participants=tuple(participants),
        confirms=tuple(confirms),
        early=(*saga.early, event),
        updated_ms=at_ms,
    )


def _with_confirm(saga: Saga, event: StepEvent) -> tuple[bool, ...]:
    """``saga.confirms`` after ``event`` moved its step: the flag is the moving event's
    (only ``applied`` says ``confirm``), so a restore from latest states rebuilds them."""
    confirms = [saga.confirm_of(i) for i in range(len(saga.steps))]
    confirms[event.step] = event.confirm
    return tuple(confirms)


def _committed_if_nothing_to_confirm(saga: Saga, at_ms: int) -> Saga:
    """After a commit decision: a step applied with nothing to confirm is ``committed`` now.

    Its participant does nothing on commit and reports nothing, so the decision itself
    is what commits it; the saga is ``committed`` once no step has a confirmation left.
    """
    if saga.outcome is not Outcome.COMMIT:
        return saga
    steps = tuple(
        StepStatus.COMMITTED if s is StepStatus.APPLIED and not saga.confirm_of(i) else s
        for i, s in enumerate(saga.steps)
    )
    state = saga.state
    if steps and all(s is StepStatus.COMMITTED for s in steps):
        state = SagaState.COMMITTED
    if steps == saga.steps and state is saga.state:
        return saga
    return replace(saga, steps=steps, state=state, updated_ms=at_ms)


def _advances(current: StepStatus, new: StepStatus) -> bool:
    if _RANK[new] > _RANK[current]:
        return True
    # A compensation retried after a failure may still succeed; nothing else moves sideways.
    return current is StepStatus.COMPENSATION_FAILED and new is StepStatus.COMPENSATED


def _decide(saga: Saga, outcome: Outcome, reason: str, at_ms: int) -> Saga:
    if len(reason) > _DECISION_REASON_CHARS:
        reason = reason[: _DECISION_REASON_CHARS - 3] + "..."
    state = SagaState.COMMITTING if outcome is Outcome.COMMIT else SagaState.ROLLING_BACK
    return replace(saga, outcome=outcome, state=state, reason=reason, updated_ms=at_ms)


def _settle(saga: Saga, at_ms: int) -> Saga:
    """Decide commit when every step is applied, and reach final states."""
    if not saga.request_seen:
        return saga
    if not saga.decided:
        if saga.steps and all(s is StepStatus.APPLIED for s in saga.steps):
            return _settle(_decide(saga, Outcome.COMMIT, "all steps applied", at_ms), at_ms)
        if at_ms >= saga.deadline_ms:
            return _settle(_decide(saga, Outcome.ROLLBACK, "deadline passed", at_ms), at_ms)
        return saga
    state = saga.state
    if saga.outcome is Outcome.COMMIT:
        return _committed_if_nothing_to_confirm(saga, at_ms)
    stuck = blocked_by_failure(saga.steps) if saga.mode is Mode.SEQUENTIAL else frozenset()
    if all(s in _CLOSED_BY_ROLLBACK for s in saga.steps):
        state = SagaState.ROLLED_BACK
    elif all(
        s in (*_CLOSED_BY_ROLLBACK, StepStatus.COMPENSATION_FAILED) or i in stuck
        for i, s in enumerate(saga.steps)
    ):
        state = SagaState.FAILED
    else:
        state = SagaState.ROLLING_BACK
    if state is SagaState.FAILED and saga.state is not SagaState.FAILED:
        failed = [i for i, s in enumerate(saga.steps) if s is StepStatus.COMPENSATION_FAILED]
        reason = f"{saga.reason}{_OPERATOR_MUST_ACT.format(failed)}"
        return replace(saga, state=state, reason=reason, updated_ms=at_ms)
    if state is SagaState.ROLLED_BACK and saga.state is SagaState.FAILED and saga.reason:
        # A retried compensation succeeded: the operator note no longer holds.
        reason = saga.reason.split(_OPERATOR_MUST_ACT.split("{", maxsplit=1)[0])[0]
        return replace(saga, state=state, reason=reason, updated_ms=at_ms)
    if state is not saga.state:
        return replace(saga, state=state, updated_ms=at_ms)
    return saga


def _outputs(before: Saga | None, after: Saga) -> list[Output]:
    out: list[Output] = []
    if after.outcome is not None and (before is None or before.outcome is None):
        assert after.reason is not None
        out.append(
            Decision(
                tx_id=after.tx_id,
                outcome=after.outcome,
                reason=after.reason,
                at_ms=after.updated_ms,
            )
        )
    if before is None or _published_view(before) != _published_view(after):
        out.append(after.status())
    return out


def _published_view(saga: Saga) -> tuple[object, ...]:
    # updated_ms alone does not make a new status worth publishing
    return (
        saga.saga,
        saga.request_seen,
        saga.participants,
        saga.steps,
        saga.confirms,
        saga.outcome,
        saga.state,
        saga.reason,
        saga.deadline_ms,
    )
