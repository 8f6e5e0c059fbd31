"""Wire records, version 1 (docs/architecture.md §3): frozen, typed, one class per record type.

Every record carries ``"v": 1`` and a ``"type"``; the records of a transaction are
keyed by its ``tx_id``, a participant's announcement by ``<name>/<instance>``.
Encoding and decoding live in one place, :mod:`streams._codec`; these classes
only hold values.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

import orjson

WIRE_VERSION = 1
MAX_STEPS = 64
TX_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"


class Mode(StrEnum):
    """How the participants act on a request."""

    PARALLEL = "parallel"
    SEQUENTIAL = "sequential"


class Isolation(StrEnum):
    """What other sagas and readers of the stores may see of a saga before its decision.

    ``read_committed`` (the default): a built-in action changes a business record only
    when the saga's ``commit`` is applied; until then the record is held (``insert``,
    ``put``, ``update``, ``delete``) or the amount reserved (``increment``, escrow).
    ``none``: apply writes at once and a rollback compensates (the classic saga, for
    the lowest latency); a compensation that would overwrite another saga's work fails
    instead (``compensation_failed``). docs/architecture.md, "Isolation".
    """

    READ_COMMITTED = "read_committed"
    NONE = "none"


class StepStatus(StrEnum):
    """A step's progress. ``pending`` appears only in status records."""

    PENDING = "pending"
    APPLIED = "applied"
    FAILED = "failed"
    COMMITTED = "committed"
    COMPENSATED = "compensated"
    COMPENSATION_FAILED = "compensation_failed"
    RESOLVED = "resolved"
    """Only in status records: a failed compensation an operator handled by hand."""


class Outcome(StrEnum):
    """The coordinator's decision for a transaction."""

    COMMIT = "commit"
    ROLLBACK = "rollback"


class SagaState(StrEnum):
    """A transaction's state as published on the status topic."""

    PENDING = "pending"
    COMMITTING = "committing"
    COMMITTED = "committed"
    ROLLING_BACK = "rolling_back"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        return self in (SagaState.COMMITTED, SagaState.ROLLED_BACK, SagaState.FAILED)


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a saga: which participant does which action with which arguments."""

    participant: str
    action: str
    args: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SagaRequest:
    """``saga.request`` on the requests topic: the transaction a client asks for."""

    TYPE: ClassVar[str] = "saga.request"

    tx_id: str
    saga: str
    mode: Mode
    steps: tuple[Step, ...]
    deadline_ms: int
    created_ms: int
    meta: Mapping[str, Any] | None = None
    isolation: Isolation = Isolation.READ_COMMITTED
    """Chosen by the client; absent on the wire means ``read_committed``."""

    def fingerprint(self) -> str:
        """A digest of what the transaction does (not when it was sent, nor its ``meta``).

        Two submissions of one ``tx_id`` are the same request exactly when their
        fingerprints match. ``meta`` is left out: it carries per-send data such
        as trace ids, which must not make an honest resubmission a conflict.
        """
        payload = {
            "saga": self.saga,
            "mode": str(self.mode),
            "steps": [
                {"participant": s.participant, "action": s.action, "args": dict(s.args)}
                for s in self.steps
            ],
        }
        if self.isolation is not Isolation.READ_COMMITTED:
            # Only a non-default level enters the digest, so fingerprints recorded
            # before levels existed still match the same request.
            payload["isolation"] = str(self.isolation)
        return hashlib.sha256(orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class SagaAbort:
    """``saga.abort`` on the requests topic: an operator asks for a rollback.

    Honoured only while the transaction has no decision yet.
    """

    TYPE: ClassVar[str] = "saga.abort"

    tx_id: str
    reason: str
    at_ms: int
    by: str | None = None
    """Who asked (an operator's name), when the sender said."""


@dataclass(frozen=True, slots=True)
class SagaResolve:
    """``saga.resolve`` on the requests topic: an operator handled a failed compensation.

    Says that step ``step`` of a ``failed`` transaction, whose compensation failed,
    was put right by hand (``note`` says how, ``by`` who). Once no failed step is
    left, the transaction is ``rolled_back``.
    """

    TYPE: ClassVar[str] = "saga.resolve"

    tx_id: str
    step: int
    note: str
    by: str
    at_ms: int


@dataclass(frozen=True, slots=True)
class StepEvent:
    """``saga.step`` on the events topic: what a participant did with one step."""

    TYPE: ClassVar[str] = "saga.step"

    tx_id: str
    step: int
    participant: str
    status: StepStatus
    at_ms: int
    reason: str | None = None
    confirm: bool = False
    """Only with ``applied``: the step has something to confirm (a custom ``confirm``
    handler), so a commit decision is answered by a ``committed`` event for it. False
    (absent on the wire): nothing happens to the step on commit and no ``committed``
    event comes."""


@dataclass(frozen=True, slots=True)
class StepsCommitted:
    """``saga.committed`` on the events topic: steps one participant committed, at once.

    What a participant writes instead of one ``committed`` :class:`StepEvent` per step
    when it applies several commit decisions in one local transaction: the
    ``(tx_id, step)`` pairs of one events partition (every ``tx_id`` belongs on the
    partition of the record key, the first ``tx_id``). Readers treat each pair as
    that step's ``committed`` event, at ``at_ms``.
    """

    TYPE: ClassVar[str] = "saga.committed"

    participant: str
    at_ms: int
    steps: tuple[tuple[str, int], ...]

    @property
    def tx_id(self) -> str:
        """The record key: the first step's ``tx_id``."""
        return self.steps[0][0]

    def events(self) -> tuple[StepEvent, ...]:
        """Each step as the ``committed`` event it stands for."""
        return tuple(
            StepEvent(tx_id, step, self.participant, StepStatus.COMMITTED, self.at_ms)
            for tx_id, step in self.steps
        )


@dataclass(frozen=True, slots=True)
class Decision:
    """``saga.decision`` on the decisions topic: commit or roll back, once per transaction."""

    TYPE: ClassVar[str] = "saga.decision"

    tx_id: str
    outcome: Outcome
    reason: str
    at_ms: int


@dataclass(frozen=True, slots=True)
class StepProgress:
    """One entry of a status record's ``steps`` list.

    ``confirm`` (absent on the wire when false): set while the step is ``applied`` and
    its ``applied`` event said it has something to confirm, so the saga is
    ``committed`` only once this step reports ``committed``. An applied step without
    it shows ``committed`` as soon as the saga is decided ``commit``.
    """

    participant: str
    status: StepStatus
    confirm: bool = False


@dataclass(frozen=True, slots=True)
class SagaStatus:
    """``saga.status`` on the compacted status topic: the latest state of a transaction."""

    TYPE: ClassVar[str] = "saga.status"

    tx_id: str
    saga: str
    state: SagaState
    steps: tuple[StepProgress, ...]
    reason: str | None
    created_ms: int
    updated_ms: int
    deadline_ms: int
    fingerprint: str | None = None


class StorageKind(StrEnum):
    """What a participant stores into; ``other`` is a storage class of one's own."""

    SQL = "sql"
    MONGO = "mongo"
    REDIS = "redis"
    OTHER = "other"


class ParticipantState(StrEnum):
    """What an announcement says of its process: running, or leaving on purpose."""

    UP = "up"
    STOPPING = "stopping"


@dataclass(frozen=True, slots=True)
class ParticipantAnnouncement:
    """``saga.participant`` on the participants topic: a participant process says it exists.

    Unlike the transaction records it is keyed by :attr:`key` (``<name>/<instance>``),
    so the compacted topic keeps the latest announcement of each process. A process
    announces itself before it consumes, again every ``interval_ms`` (its heartbeat),
    and with ``state`` ``stopping`` when it stops on purpose.
    """

    TYPE: ClassVar[str] = "saga.participant"

    name: str
    storage: StorageKind
    targets: tuple[str, ...]
    version: str
    instance: str
    started_ms: int
    heartbeat_ms: int
    interval_ms: int
    state: ParticipantState = ParticipantState.UP
    host: str | None = None

    @property
    def key(self) -> str:
        """The record key: ``<name>/<instance>``."""
        return f"{self.name}/{self.instance}"


def step_events(record: StepEvent | StepsCommitted) -> tuple[StepEvent, ...]:
    """The step events a record of the events topic stands for, in order.

    A ``saga.step`` is its own one event; a ``saga.committed`` is one ``committed``
    event per step it lists (:meth:`StepsCommitted.events`). How every reader of the
    events topic (the coordinator, the audit, tools) should see that topic.
    """
    return (record,) if isinstance(record, StepEvent) else record.events()


Record = (
    SagaRequest
    | SagaAbort
    | SagaResolve
    | StepEvent
    | StepsCommitted
    | Decision
    | SagaStatus
    | ParticipantAnnouncement
)
TxRecord = (
    SagaRequest | SagaAbort | SagaResolve | StepEvent | StepsCommitted | Decision | SagaStatus
)
"""The records of one transaction, keyed by its ``tx_id``."""
RECORD_TYPES: dict[str, type[Record]] = {
    cls.TYPE: cls
    for cls in (
        SagaRequest,
        SagaAbort,
        StepEvent,
        Decision,
        SagaStatus,
        SagaResolve,
        ParticipantAnnouncement,
        StepsCommitted,
    )
}
