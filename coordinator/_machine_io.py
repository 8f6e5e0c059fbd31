"""The state machine's inputs and outputs (see :mod:`coordinator._machine`).

Plain frozen values: what the coordinator feeds :func:`coordinator._machine.decide`
(made from a validated record by :func:`input_of`) and what it gets back besides the
wire records (:class:`Ignored`).
"""

from __future__ import annotations

from dataclasses import dataclass

from saga.streams import (
    Decision,
    Record,
    SagaAbort,
    SagaRequest,
    SagaResolve,
    SagaStatus,
    StepEvent,
    StepsCommitted,
)
from saga.streams.kafka import partition_for

# ---------------------------------------------------------------- inputs


@dataclass(frozen=True, slots=True)
class RequestReceived:
    """A request; ``known`` lists the participants that exist, when the coordinator knows.

    A step naming a participant outside ``known`` can never be applied: the
    transaction rolls back at once and that step counts as compensated. In a
    sequential saga the machine also reports that step ``compensated`` on the
    events topic (a :class:`~streams.StepEvent` output): the step before it waits
    for that event before it compensates, and its participant will never send it.
    ``unknown_why`` (e.g. "no participant of that name has announced itself on
    saga.participants") leads the rollback reason, before the part that names them.
    """

    request: SagaRequest
    at_ms: int
    known: frozenset[str] | None = None
    unknown_why: str | None = None


@dataclass(frozen=True, slots=True)
class StepReported:
    event: StepEvent
    at_ms: int


@dataclass(frozen=True, slots=True)
class AbortRequested:
    abort: SagaAbort


@dataclass(frozen=True, slots=True)
class ResolveRequested:
    """An operator says a failed compensation was handled by hand (``saga.resolve``)."""

    resolve: SagaResolve


@dataclass(frozen=True, slots=True)
class ParticipantsMissing:
    """The wait for a saga's participants ended at ``at_ms`` (the coordinator's grace).

    A step still pending whose participant is outside ``known`` can never be applied: it
    counts as compensated and the saga rolls back (if it is not decided yet), as for a
    request naming such a participant (:class:`RequestReceived`); ``why`` leads the
    rollback reason.
    """

    tx_id: str
    known: frozenset[str]
    why: str
    at_ms: int


@dataclass(frozen=True, slots=True)
class Tick:
    """Time has reached ``now_ms``: deadlines up to it have passed."""

    now_ms: int


Input = (
    RequestReceived | StepReported | AbortRequested | ResolveRequested | ParticipantsMissing | Tick
)


def input_of(
    record: Record,
    now_ms: int,
    participants: frozenset[str] | None,
) -> Input | None:
    """The machine's input for a validated record read at ``now_ms`` (a decision: none).

    The coordinator reads its own decisions only to screen them; ``participants`` is
    the set of names that exist (``None``: any name is accepted).
    """
    if isinstance(record, SagaRequest):
        return RequestReceived(record, now_ms, participants)
    if isinstance(record, SagaAbort):
        return AbortRequested(record)
    if isinstance(record, SagaResolve):
        return ResolveRequested(record)
    if isinstance(record, StepEvent):
        return StepReported(record, now_ms)
    return None


def acknowledged(
    record: StepsCommitted, now_ms: int, partition: int, partitions: int
) -> tuple[StepReported, ...] | str:
    """One ``committed`` report per step of a ``saga.committed`` read on ``partition``.

    Or why it is not acted on: a step of a transaction of another partition would be
    settled by an owner that does not hold its saga (a participant never lists one).
    """
    for tx_id, _ in record.steps:
        if partition_for(tx_id.encode(), partitions) != partition:
            return f"saga.committed lists {tx_id}, whose records belong on another partition"
    return tuple(StepReported(event, now_ms) for event in record.events())


def tx_of(inp: Input) -> str:
    """The transaction an input is about (a tick is about none: TypeError)."""
    if isinstance(inp, RequestReceived):
        return inp.request.tx_id
    if isinstance(inp, StepReported):
        return inp.event.tx_id
    if isinstance(inp, AbortRequested):
        return inp.abort.tx_id
    if isinstance(inp, ResolveRequested):
        return inp.resolve.tx_id
    if isinstance(inp, ParticipantsMissing):
        return inp.tx_id
    raise TypeError(inp)


# ---------------------------------------------------------------- outputs


@dataclass(frozen=True, slots=True)
class Ignored:
    """An input that changes nothing and deserves a word in the log or the DLQ."""

    tx_id: str
    reason: str


Output = Decision | SagaStatus | StepEvent | Ignored
